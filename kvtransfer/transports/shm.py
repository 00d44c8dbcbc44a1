"""shm: same-host transfers through a shared-memory ring.

Each connection owns a ring of `shm_num_slots` slots of `shm_slot_bytes`, in an anonymous
memfd that the sender creates and passes to the receiver over the control socket (SCM_RIGHTS),
so no name is left in /dev/shm if either process dies. The control socket is a Unix socket in
the abstract namespace, which also makes the transport unreachable from another host or
network namespace (an `auto` sender then falls back to tcp).

Data path: the sender gathers a message's chunks into a free slot (one copy) and sends the
header naming the slot; the receiver scatters the slot into the destination blocks (one copy)
and hands the slot back. Several slots keep both copies running at once.
"""
from __future__ import annotations

import asyncio
import mmap
import os
import socket
import struct
import sys
import uuid
from typing import Callable

import torch

from .._common import cancel_and_wait, within
from .._payload import BlockSink, BlockSource, DiscardSink
from ..addresses import Endpoint
from ..status import TransferError
from ._stream import AsyncSocket, StreamChannel
from .base import Channel, ChannelClosed, Listener, Transport, TransportContext

_SETUP = struct.Struct("!4sIQ")  # magic, number of slots, bytes per slot
_SETUP_MAGIC = b"PDSM"
_SLOT_FREE = "slot_free"


def _socket_name(token: str) -> str:
    return "\0pdserve-kvtransfer-" + token


def this_host() -> str:
    return socket.gethostname().lower()


class _SlotRing:
    def __init__(self, mapping: mmap.mmap, num_slots: int, slot_bytes: int) -> None:
        self.mapping = mapping
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.slots = torch.frombuffer(mapping, dtype=torch.uint8).view(num_slots, slot_bytes)

    def release(self) -> None:
        self.slots = None
        try:
            self.mapping.close()
        except BufferError:
            pass  # a view is still alive somewhere: unmapped when it is collected


class ShmChannel(StreamChannel):
    def __init__(self, stream: AsyncSocket, ring: _SlotRing, ctx: TransportContext) -> None:
        super().__init__(stream)
        self.ring = ring
        self.max_payload_bytes = ring.slot_bytes
        self._device = ctx.layout.device
        self._free_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(ring.num_slots):
            self._free_slots.put_nowait(slot)

    async def recv_control(self) -> dict:
        while True:
            message = await self.stream.recv_frame()
            if message.get("type") != _SLOT_FREE:
                return message
            self._free_slots.put_nowait(int(message["slot"]))

    def _check_open(self) -> None:
        if self.stream.closed:
            raise ChannelClosed(f"connection to {self.peer} is closed")

    async def send_data(self, header: dict, source: BlockSource) -> None:
        slot = await self._free_slots.get()
        self._check_open()
        if not source.is_active():
            self._free_slots.put_nowait(slot)
            return
        target = self.ring.slots[slot]
        if source.views.layout.is_cuda:
            staging = torch.empty(source.nbytes, dtype=torch.uint8, device=self._device)
            target[:source.nbytes].copy_(source.gather_into(staging))
        else:
            source.gather_into(target)
        await self.send_control(dict(header, nbytes=source.nbytes, slot=slot))

    async def recv_data(self, header: dict, sink: BlockSink | DiscardSink) -> bool:
        self._check_open()
        slot = int(header["slot"])
        if not 0 <= slot < self.ring.num_slots or int(header["nbytes"]) > self.ring.slot_bytes:
            raise ChannelClosed(f"{self.peer} named slot {slot} of {header['nbytes']} bytes "
                                "outside the ring")
        try:
            return sink.scatter_from(self.ring.slots[slot][:sink.nbytes])
        finally:
            await self.send_control({"type": _SLOT_FREE, "slot": slot})

    async def close(self) -> None:
        await super().close()
        self.ring.release()


class _ShmListener(Listener):
    def __init__(self, ctx: TransportContext, on_channel: Callable[[Channel], None]) -> None:
        self._ctx = ctx
        token = f"{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(_socket_name(token))
            self._sock.listen(128)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self.endpoint = Endpoint("shm", this_host(), None, token)
        self._on_channel = on_channel
        self._setups: set[asyncio.Task] = set()
        self._task = ctx.loop.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = await self._ctx.loop.sock_accept(self._sock)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            task = self._ctx.loop.create_task(self._set_up(conn))
            self._setups.add(task)
            task.add_done_callback(self._setups.discard)

    async def _set_up(self, conn: socket.socket) -> None:
        """Receive the sender's ring (fd + geometry) before the generic protocol starts."""
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  struct.calcsize("3i")))[0]
        stream = AsyncSocket(conn, self._ctx.loop, f"{self.endpoint} peer pid {pid}")
        try:
            fds: list[int] = []
            data = b""
            while len(data) < _SETUP.size:
                try:
                    chunk, new_fds, _, _ = socket.recv_fds(conn, _SETUP.size - len(data), 1)
                except (BlockingIOError, InterruptedError):
                    await within(self._ctx.config.timeout_s, stream._wait(writable=False))
                    continue
                if not chunk:
                    raise ChannelClosed("shm peer closed during setup")
                data += chunk
                fds.extend(new_fds)
            try:
                magic, num_slots, slot_bytes = _SETUP.unpack(data)
                if magic != _SETUP_MAGIC or len(fds) != 1:
                    raise ChannelClosed("shm peer sent a malformed setup")
                mapping = mmap.mmap(fds[0], num_slots * slot_bytes)
            finally:
                for fd in fds:
                    os.close(fd)
        except (ChannelClosed, OSError, asyncio.TimeoutError):
            stream.close()
            return
        self._on_channel(ShmChannel(stream, _SlotRing(mapping, num_slots, slot_bytes), self._ctx))

    async def close(self) -> None:
        await cancel_and_wait([self._task, *self._setups])
        self._sock.close()


class ShmTransport(Transport):
    name = "shm"

    @staticmethod
    def unavailable_reason() -> str | None:
        if not sys.platform.startswith("linux"):
            return "shm needs Linux (memfd_create and abstract Unix sockets)"
        if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            return "this Python lacks os.memfd_create or socket.send_fds"
        return None

    async def listen(self, ctx: TransportContext,
                     on_channel: Callable[[Channel], None]) -> Listener:
        return _ShmListener(ctx, on_channel)

    async def connect(self, ctx: TransportContext, endpoint: Endpoint) -> Channel:
        if endpoint.host != this_host():
            raise TransferError(f"shm receiver is on host {endpoint.host!r}, this is {this_host()!r}")
        config = ctx.config
        if ctx.layout.chunk_nbytes > config.shm_slot_bytes:
            raise TransferError(f"one KV chunk is {ctx.layout.chunk_nbytes} bytes, above "
                                f"shm_slot_bytes={config.shm_slot_bytes}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        memfd = -1
        try:
            await ctx.loop.sock_connect(sock, _socket_name(endpoint.path))
            size = config.shm_num_slots * config.shm_slot_bytes
            memfd = os.memfd_create("pdserve-kvtransfer-ring", os.MFD_CLOEXEC)
            os.ftruncate(memfd, size)
            mapping = mmap.mmap(memfd, size)
            setup = _SETUP.pack(_SETUP_MAGIC, config.shm_num_slots, config.shm_slot_bytes)
            socket.send_fds(sock, [setup], [memfd])
        except BaseException:
            sock.close()
            raise
        finally:
            if memfd >= 0:
                os.close(memfd)
        ring = _SlotRing(mapping, config.shm_num_slots, config.shm_slot_bytes)
        return ShmChannel(AsyncSocket(sock, ctx.loop, str(endpoint)), ring, ctx)
