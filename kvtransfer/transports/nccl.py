"""nccl: torch.distributed point-to-point, NCCL for GPU caches and gloo for CPU caches.

The receiver listens on a TCP control socket and hosts a TCPStore. Each sender that connects
gets its own 2-rank process group (receiver rank 0, sender rank 1), rendezvoused through the
receiver's store under a fresh prefix, so one receiver serves any number of senders and no
global `init_process_group` is touched. Control messages travel on the TCP socket; each data
message is one contiguous staging tensor sent with `send`/`recv` on the pair's group, gathered
from and scattered into the scattered blocks on both ends. Group operations block, so each
connection runs them on its own thread.
"""
from __future__ import annotations

import asyncio
import datetime
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from .._payload import BlockSink, BlockSource, DiscardSink
from ..addresses import Endpoint
from ..status import TransferError
from ._stream import AsyncSocket, StreamChannel
from .base import Channel, ChannelClosed, Listener, Transport, TransportContext
from .tcp import TcpListener, open_tcp_socket

_RECEIVER_RANK, _SENDER_RANK = 0, 1
_PIPELINE_DEPTH = 2  # send staging buffers: gather one while the other is on the wire


def _distributed():
    import torch.distributed as dist
    return dist


class NcclChannel(StreamChannel):
    def __init__(self, stream: AsyncSocket, ctx: TransportContext, store_factory: Callable,
                 local_host: str) -> None:
        super().__init__(stream)
        self._ctx = ctx
        self._store_factory = store_factory  # runs on the group thread, returns a Store
        self._local_host = local_host
        self._pair: str | None = None
        self._group = None
        self._store = None
        self._staging: torch.Tensor | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtransfer-pg")
        self.max_payload_bytes = ctx.config.max_message_bytes
        self._free_send_buffers: asyncio.Queue[torch.Tensor] | None = None
        self._send_error: ChannelClosed | None = None

    async def accept_hello(self, hello: dict) -> dict:
        remote_device = torch.device(hello["layout"]["device"]).type
        local_device = torch.device(self._ctx.layout.device).type
        if remote_device != local_device:
            raise TransferError(f"nccl needs both caches on the same kind of device: sender on "
                                f"{remote_device}, receiver on {local_device} (use tcp or ucx)")
        self._pair = uuid.uuid4().hex
        return {"pair": self._pair}

    async def after_hello_ok(self, reply: dict) -> None:
        if self._pair is None:
            self._pair = str(reply["pair"])
        rank = _RECEIVER_RANK if self._ctx.role == "receiver" else _SENDER_RANK
        await self._on_group_thread(self._create_group, rank)

    def _create_group(self, rank: int) -> None:
        dist = _distributed()
        timeout = datetime.timedelta(seconds=self._ctx.config.timeout_s)
        self._store = self._store_factory()
        store = dist.PrefixStore(f"kvtransfer/{self._pair}", self._store)
        if self._ctx.layout.is_cuda:
            # Read as the group is built; an operator's own setting wins. The TP groups of the
            # worker's engine were built before any KV connection, with torch's default.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            torch.cuda.set_device(torch.device(self._ctx.layout.device))
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(store, rank, 2, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._local_host)]
            options._timeout = timeout
            self._group = dist.ProcessGroupGloo(store, rank, 2, options)

    async def _on_group_thread(self, fn: Callable, *args):
        if self.stream.closed:
            raise ChannelClosed(f"connection to {self.peer} is closed")
        try:
            return await self._ctx.loop.run_in_executor(self._executor, fn, *args)
        except RuntimeError as exc:  # gloo/NCCL report a dead peer or timeout this way
            raise ChannelClosed(f"process group with {self.peer} failed: {exc}") from exc

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        """The receive staging buffer, grown to the largest payload seen."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self._ctx.layout.device)
        return self._staging[:nbytes]

    def _point_to_point(self, send: bool, tensor: torch.Tensor) -> None:
        peer = _RECEIVER_RANK if send else _SENDER_RANK
        op = self._group.send if send else self._group.recv
        try:
            op([tensor], peer, 0).wait(datetime.timedelta(seconds=self._ctx.config.timeout_s))
        except RuntimeError:
            self._group.abort()  # the pair's communicator goes now, not later by the watchdog
            raise
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    async def send_data(self, header: dict, source: BlockSource) -> None:
        """Gather into a free staging buffer and queue its send on the group thread, which
        sends in order; the next payload is gathered while this one is on the wire."""
        if self._free_send_buffers is None:
            self._free_send_buffers = asyncio.Queue()
            for _ in range(_PIPELINE_DEPTH):
                self._free_send_buffers.put_nowait(torch.empty(
                    self.max_payload_bytes, dtype=torch.uint8, device=self._ctx.layout.device))
        buffer = await self._free_send_buffers.get()
        async with self.send_lock:
            if self._send_error is not None:
                raise self._send_error
            if self.stream.closed or self._free_send_buffers is None:
                raise ChannelClosed(f"connection to {self.peer} is closed")
            if not source.is_active():
                self._free_send_buffers.put_nowait(buffer)
                return
            staged = source.gather_into(buffer)
            await self.stream.send_frame(dict(header, nbytes=source.nbytes))
            sending = self._ctx.loop.run_in_executor(self._executor, self._point_to_point, True,
                                                      staged)
            sending.add_done_callback(lambda done: self._sent(done, buffer))

    def _sent(self, done: asyncio.Future, buffer: torch.Tensor) -> None:
        if done.cancelled() or done.exception() is not None:
            reason = "cancelled" if done.cancelled() else done.exception()
            self._send_error = ChannelClosed(f"process group with {self.peer} failed: {reason}")
            self.stream.close()  # wakes the connection's reader, which reports the failure
        elif self._free_send_buffers is not None:
            self.mark_tx()
            self._free_send_buffers.put_nowait(buffer)

    async def recv_data(self, header: dict, sink: BlockSink | DiscardSink) -> bool:
        staging = self._staging_buffer(int(header["nbytes"]))
        await self._on_group_thread(self._point_to_point, False, staging)
        self.mark_rx()
        return sink.scatter_from(staging)

    async def close(self) -> None:
        if self._executor is None:
            return
        await super().close()
        executor, self._executor = self._executor, None
        executor.submit(self._destroy_group)
        # Joining may wait for an operation in flight to fail (bounded by timeout_s); do it
        # off the event loop so other connections keep running. The join is finished even if
        # the caller is cancelled (an owner's close cancels its connection tasks), so that a
        # closed sender or receiver has no group thread left behind.
        joined = self._ctx.loop.run_in_executor(None, executor.shutdown)
        cancelled = False
        while not joined.done():
            try:
                await asyncio.shield(joined)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    def _destroy_group(self) -> None:
        self._group = None
        self._store = None
        self._store_factory = None
        self._staging = None
        self._free_send_buffers = None


class _NcclListener(Listener):
    def __init__(self, ctx: TransportContext, on_channel: Callable[[Channel], None]) -> None:
        dist = _distributed()
        config = ctx.config
        self._store = dist.TCPStore(config.host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=config.timeout_s))

        def on_socket(conn: socket.socket, peer: str) -> None:
            local_host = conn.getsockname()[0]
            stream = AsyncSocket(conn, ctx.loop, f"nccl://{peer}")
            on_channel(NcclChannel(stream, ctx, self._get_store, local_host))

        self._control = TcpListener(ctx, "nccl", on_socket)
        control = self._control.endpoint
        self.endpoint = Endpoint("nccl", control.host, control.port,
                                 query={"store": str(self._store.port)})

    def _get_store(self):
        if self._store is None:
            raise ChannelClosed("the receiver's store is closed")
        return self._store

    async def close(self) -> None:
        await self._control.close()
        self._store = None


class NcclTransport(Transport):
    name = "nccl"

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            dist = _distributed()
        except ImportError as exc:
            return f"torch.distributed cannot be imported: {exc}"
        if not dist.is_available():
            return "this torch build has no torch.distributed"
        if not dist.is_gloo_available() and not dist.is_nccl_available():
            return "this torch build has neither gloo nor NCCL"
        return None

    async def listen(self, ctx: TransportContext,
                     on_channel: Callable[[Channel], None]) -> Listener:
        dist = _distributed()
        backend_ok = dist.is_nccl_available() if ctx.layout.is_cuda else dist.is_gloo_available()
        if not backend_ok:
            raise TransferError(f"nccl transport: no {'NCCL' if ctx.layout.is_cuda else 'gloo'} "
                                "backend in this torch build")
        return _NcclListener(ctx, on_channel)

    async def connect(self, ctx: TransportContext, endpoint: Endpoint) -> Channel:
        if "store" not in endpoint.query:
            raise TransferError(f"nccl address {endpoint} names no store port (?store=PORT)")
        store_port = int(endpoint.query["store"])
        sock = await open_tcp_socket(ctx, endpoint.host, endpoint.port)
        local_host = sock.getsockname()[0]
        timeout = datetime.timedelta(seconds=ctx.config.timeout_s)

        def connect_store():
            return _distributed().TCPStore(endpoint.host, store_port, is_master=False,
                                           timeout=timeout)

        return NcclChannel(AsyncSocket(sock, ctx.loop, str(endpoint)), ctx, connect_store,
                           local_host)
