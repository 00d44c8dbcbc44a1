"""Non-blocking stream sockets on an asyncio loop: framed control messages, and payloads
moved with scatter/gather syscalls straight between the socket and cache memory."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time
from typing import Callable, Sequence

import torch

from .._payload import BlockSink, BlockSource, DiscardSink
from .base import Channel, ChannelClosed

_FRAME_HEADER = struct.Struct("!4sI")
_MAGIC = b"PDKV"
_MAX_FRAME_JSON = 64 << 20
_SCRATCH_BYTES = 1 << 20
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_GENUINE = memoryview(b"\x01")  # trailer of a payload read entirely from the source blocks


def encode_frame(message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _FRAME_HEADER.pack(_MAGIC, len(body)) + body


class AsyncSocket:
    """A non-blocking socket driven by `loop.add_reader/add_writer`."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, peer: str) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.loop = loop
        self.peer = peer
        self.fd = sock.fileno()
        self.closed = False
        self.last_rx = time.monotonic()
        self.last_tx = time.monotonic()
        self._waiters: set[asyncio.Future] = set()
        self._scratch: bytearray | None = None

    async def _wait(self, writable: bool) -> None:
        if self.closed:
            raise ChannelClosed(f"connection to {self.peer} is closed")
        future = self.loop.create_future()

        def ready() -> None:
            if not future.done():
                future.set_result(None)

        (self.loop.add_writer if writable else self.loop.add_reader)(self.fd, ready)
        self._waiters.add(future)
        try:
            await future
        finally:
            self._waiters.discard(future)
            if not self.closed:
                (self.loop.remove_writer if writable else self.loop.remove_reader)(self.fd)

    def _scratch_buffer(self) -> memoryview:
        if self._scratch is None:
            self._scratch = bytearray(_SCRATCH_BYTES)
        return memoryview(self._scratch)

    async def recv_into(self, buffers: Sequence[memoryview],
                        keep_writing: Callable[[], bool] | None = None) -> bool:
        """Fill `buffers` in order. If `keep_writing()` turns False, stop writing into them and
        drain the rest of the bytes into scratch memory; return whether all landed."""
        lengths = [len(buffer) for buffer in buffers]
        index, offset = 0, 0
        while index < len(buffers):
            if keep_writing is not None and not keep_writing():
                await self.discard(sum(lengths[index:]) - offset)
                return False
            iov = [buffers[index][offset:] if offset else buffers[index]]
            iov.extend(buffers[index + 1:index + _IOV_MAX])
            try:
                received = self.sock.recvmsg_into(iov)[0]
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=False)
                continue
            except OSError as exc:
                raise ChannelClosed(f"connection to {self.peer} failed: {exc}") from exc
            if received == 0:
                raise ChannelClosed(f"{self.peer} closed the connection")
            self.last_rx = time.monotonic()
            received += offset
            while index < len(buffers) and received >= lengths[index]:
                received -= lengths[index]
                index += 1
            offset = received
        return True

    async def discard(self, nbytes: int) -> None:
        scratch = self._scratch_buffer()
        while nbytes > 0:
            await self.recv_into([scratch[:min(nbytes, len(scratch))]])
            nbytes -= min(nbytes, len(scratch))

    async def recv_exact(self, nbytes: int) -> bytearray:
        buffer = bytearray(nbytes)
        await self.recv_into([memoryview(buffer)])
        return buffer

    async def send_buffers(self, buffers: Sequence[memoryview],
                           keep_reading: Callable[[], bool] | None = None,
                           protected_buffers: int = 0) -> bool:
        """Send `buffers` in order. If `keep_reading()` turns False once the first
        `protected_buffers` are out, the remaining bytes are sent as zeros, so the source memory
        is not read any more; return whether every byte came from `buffers`."""
        lengths = [len(buffer) for buffer in buffers]
        index, offset = 0, 0
        while index < len(buffers):
            if index >= protected_buffers and keep_reading is not None and not keep_reading():
                await self._send_zeros(sum(lengths[index:]) - offset)
                return False
            iov = [buffers[index][offset:] if offset else buffers[index]]
            iov.extend(buffers[index + 1:index + _IOV_MAX])
            try:
                sent = self.sock.sendmsg(iov)
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=True)
                continue
            except OSError as exc:
                raise ChannelClosed(f"connection to {self.peer} failed: {exc}") from exc
            self.last_tx = time.monotonic()
            sent += offset
            while index < len(buffers) and sent >= lengths[index]:
                sent -= lengths[index]
                index += 1
            offset = sent
        return True

    async def _send_zeros(self, nbytes: int) -> None:
        zeros = memoryview(bytes(min(nbytes, _SCRATCH_BYTES)))
        while nbytes > 0:
            size = min(nbytes, len(zeros))
            await self.send_buffers([zeros[:size]])
            nbytes -= size

    async def send_frame(self, message: dict) -> None:
        await self.send_buffers([memoryview(encode_frame(message))])

    async def recv_frame(self) -> dict:
        magic, length = _FRAME_HEADER.unpack(await self.recv_exact(_FRAME_HEADER.size))
        if magic != _MAGIC or length > _MAX_FRAME_JSON:
            raise ChannelClosed(f"{self.peer} sent a malformed frame (not a kvtransfer peer?)")
        return json.loads(await self.recv_exact(length))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for future in list(self._waiters):
            if not future.done():
                future.set_exception(ChannelClosed(f"connection to {self.peer} is closed"))
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        self.sock.close()


class StreamChannel(Channel):
    """A channel whose control messages travel as frames on one stream socket."""

    def __init__(self, stream: AsyncSocket) -> None:
        super().__init__(stream.peer)
        self.stream = stream
        self.send_lock = asyncio.Lock()

    @property
    def last_rx(self) -> float:
        return self.stream.last_rx

    @property
    def last_tx(self) -> float:
        return self.stream.last_tx

    def mark_rx(self) -> None:
        self.stream.last_rx = time.monotonic()

    def mark_tx(self) -> None:
        self.stream.last_tx = time.monotonic()

    async def send_control(self, message: dict) -> None:
        async with self.send_lock:
            await self.stream.send_frame(message)

    async def recv_control(self) -> dict:
        return await self.stream.recv_frame()

    async def close(self) -> None:
        self.stream.close()


class SocketPayloadChannel(StreamChannel):
    """Payloads follow their header on the same socket, then one trailer byte that says
    whether the payload is genuine (1) or was cut short by a cancel and padded (0).
    Zero-copy for caches in host memory; through a host copy for caches on a GPU."""

    async def send_data(self, header: dict, source: BlockSource) -> None:
        async with self.send_lock:
            if not source.is_active():
                return
            if source.supports_chunk_views:
                payload = source.chunk_views()
            else:
                staging = torch.empty(source.nbytes, dtype=torch.uint8,
                                      device=source.views.layout.device)
                payload = [memoryview(source.gather_into(staging).cpu().numpy())]
            frame = memoryview(encode_frame(dict(header, nbytes=source.nbytes)))
            # one gather write: frame, payload, trailer 1; a cancel midway turns the rest of the
            # payload and the trailer into zeros
            await self.stream.send_buffers([frame, *payload, _GENUINE], source.is_active,
                                           protected_buffers=1)

    async def recv_data(self, header: dict, sink: BlockSink | DiscardSink) -> bool:
        nbytes = int(header["nbytes"])
        if nbytes != sink.nbytes:
            raise ChannelClosed(f"{self.peer} announced {nbytes} payload bytes, expected {sink.nbytes}")
        if not sink.is_active():
            await self.stream.discard(nbytes + 1)
            return False
        trailer = bytearray(1)
        if sink.supports_chunk_views:
            landed = await self.stream.recv_into([*sink.chunk_views(), memoryview(trailer)],
                                                 sink.is_active)
            return landed and trailer == _GENUINE
        host = torch.empty(nbytes, dtype=torch.uint8)
        await self.stream.recv_into([memoryview(host.numpy()), memoryview(trailer)])
        return trailer == _GENUINE and sink.scatter_from(host)
