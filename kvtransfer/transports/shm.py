"""shm: same-host transfers: from the sender's mapped shared caches or by cross-memory reads (one
copy), or through a shared-memory ring (two copies).

See `ShmChannel` for the three data paths. Each connection owns a ring of `shm_num_slots` slots of `shm_slot_bytes`, in an anonymous
memfd that the sender creates and passes to the receiver over the control socket (SCM_RIGHTS),
so no name is left in /dev/shm if either process dies; a sender whose caches lie in a memfd
(`shared_memory`) passes that descriptor along with it (with an `auth_key`, only once the
receiver proved the key: `ShmChannel.after_auth`). The control socket is a Unix socket in
the abstract namespace, which also makes the transport unreachable from another host or
network namespace (an `auto` sender then falls back to tcp).

Ring data path: the sender gathers a message's chunks into a free slot (one copy) and sends
the header naming the slot; the receiver scatters the slot into the destination blocks (one
copy) and hands the slot back. Several slots keep both copies running at once. The ring's
pages cost nothing until touched, so a connection on a single-copy path never allocates it.
"""
from __future__ import annotations

import asyncio
import logging
import mmap
import os
import socket
import struct
import sys
import uuid
from typing import Callable

import numpy as np
import torch

from . import _cma
from .._common import accept_connections, cancel_and_wait, within
from .._payload import BlockSink, BlockSource, DiscardSink, chunk_addresses
from ..addresses import Endpoint
from ..status import TransferError
from ._stream import AsyncSocket, StreamChannel
from .base import Channel, ChannelClosed, Listener, Transport, TransportContext

log = logging.getLogger(__name__)

_SETUP = struct.Struct("!4sIQ")  # magic, number of slots, bytes per slot
_SETUP_MAGIC = b"PDSM"
_SLOT_FREE = "slot_free"
_CMA_COPIED = "cma_copied"
_CMA_VALID = "cma_valid"


def _socket_name(token: str) -> str:
    return "\0pdserve-kvtransfer-" + token


def this_host() -> str:
    return socket.gethostname().lower()


def _shares_caches(ctx: TransportContext) -> bool:
    """Sender: whether it offers its shared caches for the receiver to map (the mapped path)."""
    return ctx.shared_memory is not None and ctx.config.shm_mapped and not ctx.layout.is_cuda


async def _send_fds(stream: AsyncSocket, fds: list[int]) -> None:
    """One marker byte carrying `fds` (SCM_RIGHTS), between two control frames."""
    while True:
        try:
            socket.send_fds(stream.sock, [b"\0"], fds)
            return
        except (BlockingIOError, InterruptedError):
            await stream._wait(writable=True)
        except OSError as exc:
            raise ChannelClosed(f"connection to {stream.peer} failed: {exc}") from exc


async def _recv_fd(stream: AsyncSocket, timeout_s: float) -> int | None:
    """The marker byte `_send_fds` sent, and the descriptor it carried (if any; extra ones are closed)."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(stream.sock, 1, 2)
        except (BlockingIOError, InterruptedError):
            await within(timeout_s, stream._wait(writable=False))
            continue
        except OSError as exc:
            raise ChannelClosed(f"connection to {stream.peer} failed: {exc}") from exc
        kept = fds[0] if data and fds else None
        for fd in fds:
            if fd != kept:
                os.close(fd)
        if not data:
            raise ChannelClosed(f"{stream.peer} closed the connection")
        return kept


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
    """Three data paths, chosen at the handshake (best first):

    mapped (one copy): the sender's caches are in a memfd it passed at setup; the receiver maps
    them read-only and memcpys the source chunks into place (`_cma.copy_local`). Then, as for cma:
    cma (one copy): the receiver copies the source chunks straight out of the sender's memory
    (`_cma.read_chunks`), then reports `cma_copied`; the sender answers `cma_valid`, true only
    if the transfer was not cancelled meanwhile, and only then does the receiver count the
    message. A copy that raced with a sender cancel (blocks possibly reused) is never counted.
    ring (two copies): the sender gathers into a free slot, the receiver scatters from it and
    hands the slot back. Used when the OS forbids cross-memory reads, or for GPU caches.
    """

    def __init__(self, stream: AsyncSocket, ring: _SlotRing, ctx: TransportContext,
                 peer_cache_fd: int | None = None) -> None:
        super().__init__(stream)
        self._peer_cache_fd = peer_cache_fd  # receiver: the sender's shared cache file, if passed
        self._peer_mapping: mmap.mmap | None = None
        self._peer_view: np.ndarray | None = None  # pins the mapping while in use
        self.ring = ring
        self.max_payload_bytes = ring.slot_bytes
        self._ctx = ctx
        self._free_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(ring.num_slots):
            self._free_slots.put_nowait(slot)
        # receiver: how to reach the sender's memory: {"pid", "layer_addresses"} (cma) or
        # {"layer_addresses", "limit"} (mapped: addresses in our mapping of its shared caches)
        self._cma_peer: dict | None = None
        self._peer_mode = "ring"
        self._cma_send = False  # sender: the receiver reads our memory (cma or mapped)
        self._send_mode = "ring"
        self._probe = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
        self._next_seq = 0
        self._lent: dict[int, BlockSource] = {}  # sender: announced, not yet reported copied
        self._confirmations: dict[int, asyncio.Future] = {}  # receiver: copied, awaiting verdict

    # ---- handshake ------------------------------------------------------------------------

    def hello_fields(self) -> dict:
        fields: dict = {}
        shared = self._ctx.shared_memory
        if _shares_caches(self._ctx):
            fields["mapped"] = {"nbytes": shared.nbytes,
                                "layer_offsets": [a - shared.address for a in self._ctx.cache_addresses]}
        if self._ctx.config.shm_cross_memory_attach and _cma.available() and not self._ctx.layout.is_cuda:
            fields["cma"] = {"pid": os.getpid(), "layer_addresses": list(self._ctx.cache_addresses),
                             "probe_address": int(self._probe.ctypes.data),
                             "probe": self._probe.tobytes().hex()}
        return fields

    async def after_auth(self) -> None:
        """A keyed connection passes the sender's shared caches here, once the receiver proved
        the key, not in the setup (`ShmTransport.connect`): an impostor never gets them."""
        if self._ctx.role == "sender":
            await _send_fds(self.stream, [self._ctx.shared_memory.fd] if _shares_caches(self._ctx) else [])
            return
        fd = await _recv_fd(self.stream, self._ctx.config.timeout_s)
        if self._peer_cache_fd is not None:  # a setup that passed one already: keep the newest
            os.close(self._peer_cache_fd)
        self._peer_cache_fd = fd

    async def accept_hello(self, hello: dict) -> dict:
        if self._map_peer(hello.get("mapped")):
            return {"shm_mode": "mapped"}
        offer = hello.get("cma")
        if (offer and self._ctx.config.shm_cross_memory_attach and not self._ctx.layout.is_cuda
                and _cma.probe(int(offer["pid"]), int(offer["probe_address"]),
                               bytes.fromhex(offer["probe"]))):
            self._cma_peer = {"pid": int(offer["pid"]),
                              "layer_addresses": [int(a) for a in offer["layer_addresses"]]}
            self._peer_mode = "cma"
            return {"shm_mode": "cma"}
        return {"shm_mode": "ring"}

    def _map_peer(self, offer: dict | None) -> bool:
        """Map the sender's shared caches read-only, if it offered them and passed their file."""
        fd, self._peer_cache_fd = self._peer_cache_fd, None
        if fd is None:
            return False
        try:
            if not (offer and self._ctx.config.shm_mapped and not self._ctx.layout.is_cuda):
                return False
            nbytes = int(offer["nbytes"])
            offsets = [int(o) for o in offer["layer_offsets"]]
            chunk = self._ctx.layout.chunk_nbytes
            if len(offsets) != self._ctx.layout.num_layers or not all(0 <= o <= nbytes - chunk for o in offsets):
                return False
            try:
                # MAP_POPULATE: map every page now, once per connection, instead of taking a
                # page fault per 4 KiB inside each copy (that halved the copy rate here).
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapping = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ)
            except (OSError, ValueError):
                return False
        finally:
            os.close(fd)
        self._peer_mapping = mapping
        self._peer_view = np.frombuffer(mapping, dtype=np.uint8)
        base = int(self._peer_view.ctypes.data)
        self._cma_peer = {"layer_addresses": [base + o for o in offsets], "limit": base + nbytes}
        self._peer_mode = "mapped"
        return True

    async def after_hello_ok(self, reply: dict) -> None:
        if self._ctx.role == "sender":
            self._send_mode = reply.get("shm_mode", "ring")
            self._cma_send = self._send_mode in ("cma", "mapped")

    @property
    def mode(self) -> str:
        return self._send_mode if self._ctx.role == "sender" else self._peer_mode

    # ---- control messages of the data paths ------------------------------------------------

    async def recv_control(self) -> dict:
        while True:
            message = await self.stream.recv_frame()
            kind = message.get("type")
            if kind == _SLOT_FREE:
                self._free_slots.put_nowait(int(message["slot"]))
            elif kind == _CMA_COPIED:  # sender: was the lent source still valid?
                source = self._lent.pop(int(message["seq"]), None)
                valid = source is not None and source.is_active()
                await self.send_control({"type": _CMA_VALID, "seq": message["seq"],
                                         "valid": valid})
            elif kind == _CMA_VALID:  # receiver: the verdict on a copy
                verdict = self._confirmations.pop(int(message["seq"]), None)
                if verdict is not None and not verdict.done():
                    verdict.set_result(bool(message["valid"]))
            else:
                return message

    def _check_open(self) -> None:
        if self.stream.closed:
            raise ChannelClosed(f"connection to {self.peer} is closed")

    # ---- data -----------------------------------------------------------------------------

    async def send_data(self, header: dict, source: BlockSource) -> None:
        if self._cma_send:
            async with self.send_lock:
                self._check_open()
                if not source.is_active():
                    return
                seq, self._next_seq = self._next_seq, self._next_seq + 1
                self._lent[seq] = source
                await self.stream.send_frame(dict(header, nbytes=source.nbytes, cma_seq=seq,
                                                  src_block_ids=list(source.block_ids)))
            return
        slot = await self._free_slots.get()
        self._check_open()
        if not source.is_active():
            self._free_slots.put_nowait(slot)
            return
        target = self.ring.slots[slot]
        if source.views.layout.is_cuda:
            staging = torch.empty(source.nbytes, dtype=torch.uint8, device=self._ctx.layout.device)
            target[:source.nbytes].copy_(source.gather_into(staging))
        else:
            source.gather_into(target)
        await self.send_control(dict(header, nbytes=source.nbytes, slot=slot))

    async def recv_data(self, header: dict, sink: BlockSink | DiscardSink):
        self._check_open()
        if "cma_seq" in header:
            return await self._recv_cma(header, sink)
        slot = int(header["slot"])
        if not 0 <= slot < self.ring.num_slots or int(header["nbytes"]) > self.ring.slot_bytes:
            raise ChannelClosed(f"{self.peer} named slot {slot} of {header['nbytes']} bytes "
                                "outside the ring")
        try:
            return sink.scatter_from(self.ring.slots[slot][:sink.nbytes])
        finally:
            await self.send_control({"type": _SLOT_FREE, "slot": slot})

    async def _recv_cma(self, header: dict, sink: BlockSink | DiscardSink):
        """Copy out of the sender's memory; the result is a future of the sender's verdict."""
        if self._cma_peer is None:
            raise ChannelClosed(f"{self.peer} sent a cross-memory message without agreement")
        seq = int(header["cma_seq"])
        copied = False
        if sink.is_active():
            layout = self._ctx.layout
            src_ids = np.asarray(header["src_block_ids"], dtype=np.uint64)
            dst_ids = np.asarray(sink.block_ids, dtype=np.uint64)
            if len(src_ids) != len(dst_ids):
                raise ChannelClosed(f"{self.peer} sent {len(src_ids)} source blocks for "
                                    f"{len(dst_ids)} destinations")
            layers = sink.piece.layers
            remote = chunk_addresses(self._cma_peer["layer_addresses"], layers, src_ids, layout.chunk_nbytes)
            local = chunk_addresses(self._ctx.cache_addresses, layers, dst_ids, layout.chunk_nbytes)
            threads = self._ctx.config.shm_copy_threads
            try:
                # On the loop thread, blocking it: a receiver cancel is handled on this loop, so
                # it cannot release the destination blocks while the copy writes into them.
                if self._peer_mode == "mapped":
                    if len(remote) and int(remote.max()) + layout.chunk_nbytes > self._cma_peer["limit"]:
                        raise ChannelClosed(f"{self.peer} named blocks outside its shared caches")
                    copied = _cma.copy_local(local, remote, layout.chunk_nbytes, sink.is_active, threads)
                else:
                    copied = _cma.read_chunks(self._cma_peer["pid"], local, remote, layout.chunk_nbytes,
                                              sink.is_active, threads=threads)
            except OSError as exc:
                raise ChannelClosed(f"cannot read the memory of {self.peer}: {exc}") from None
        await self.send_control({"type": _CMA_COPIED, "seq": seq})
        if not copied:
            return False
        verdict = asyncio.get_running_loop().create_future()
        self._confirmations[seq] = verdict
        return verdict

    async def close(self) -> None:
        await super().close()
        for verdict in self._confirmations.values():
            if not verdict.done():
                verdict.set_result(False)
        self._confirmations.clear()
        self._lent.clear()
        self.ring.release()
        if self._peer_cache_fd is not None:
            os.close(self._peer_cache_fd)
            self._peer_cache_fd = None
        self._cma_peer = None
        self._peer_view = None
        if self._peer_mapping is not None:
            try:
                self._peer_mapping.close()
            except BufferError:
                pass  # a view is still alive somewhere: unmapped when it is collected
            self._peer_mapping = None


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
        self._task = ctx.loop.create_task(accept_connections(ctx.loop, self._sock, self._accepted, str(self.endpoint)))

    def _accepted(self, conn: socket.socket, peer: object) -> None:
        task = self._ctx.loop.create_task(self._set_up(conn))
        self._setups.add(task)
        task.add_done_callback(self._setups.discard)

    async def _set_up(self, conn: socket.socket) -> None:
        """Receive the sender's ring (fd + geometry) before the generic protocol starts."""
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  struct.calcsize("3i")))[0]
        stream = AsyncSocket(conn, self._ctx.loop, f"{self.endpoint} peer pid {pid}")
        fds: list[int] = []  # received descriptors not yet closed or kept: closed exactly once
        try:
            data = b""
            while len(data) < _SETUP.size:
                try:
                    chunk, new_fds, _, _ = socket.recv_fds(conn, _SETUP.size - len(data), 2)
                except (BlockingIOError, InterruptedError):
                    await within(self._ctx.config.timeout_s, stream._wait(writable=False))
                    continue
                if not chunk:
                    raise ChannelClosed("shm peer closed during setup")
                data += chunk
                fds.extend(new_fds)
            peer_cache_fd = None
            try:
                magic, num_slots, slot_bytes = _SETUP.unpack(data)
                if magic != _SETUP_MAGIC or len(fds) not in (1, 2):
                    raise ChannelClosed("shm peer sent a malformed setup")
                mapping = mmap.mmap(fds[0], num_slots * slot_bytes)
                if len(fds) == 2:  # the sender's shared caches, mapped if its hello offers them
                    peer_cache_fd = fds.pop()
            finally:
                while fds:
                    os.close(fds.pop())
        except (ChannelClosed, OSError, asyncio.TimeoutError) as exc:
            while fds:
                try:
                    os.close(fds.pop())
                except OSError:
                    pass
            log.warning("shm: no channel from peer pid %d: %s", pid, str(exc) or type(exc).__name__)
            stream.close()
            return
        self._on_channel(ShmChannel(stream, _SlotRing(mapping, num_slots, slot_bytes), self._ctx,
                                    peer_cache_fd=peer_cache_fd))

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
            fds = [memfd]
            if _shares_caches(ctx) and config.auth_key is None:  # keyed: after the auth instead
                fds.append(ctx.shared_memory.fd)
            socket.send_fds(sock, [setup], fds)
        except BaseException:
            sock.close()
            raise
        finally:
            if memfd >= 0:
                os.close(memfd)
        ring = _SlotRing(mapping, config.shm_num_slots, config.shm_slot_bytes)
        return ShmChannel(AsyncSocket(sock, ctx.loop, str(endpoint)), ring, ctx)
