"""The sending side (prefill worker): pushes source blocks into a receiver's destination blocks.

Lifecycle of one outgoing transfer (request id):
    start() / send()        -> PENDING       connecting (handshake once per receiver) and queued
    first data message out  -> TRANSFERRING
    receiver acknowledged every layer -> SUCCESS
    layout mismatch, receiver refused or cancelled, connection lost, receiver silent for
    timeout_s, close()      -> FAILED (error says why)
    handshake refused for want of the auth_key -> FAILED with `auth_refused` (see below)
    cancel()                -> forgotten     the source blocks are not read after it returns

Layer-wise streaming: `start()` opens a transfer over some layers, `send_layers()` pushes a
group of them as soon as prefill has computed it; `send()` does both for layers that are ready.
`send_layers(..., num_blocks=n)` pushes only the first n blocks of the group (the blocks a prompt
chunk completed); a later call for the same layers pushes the blocks after them.

Sliding windows: `start(..., skip_blocks=s)` (`s[layer]` per cache layer) moves only blocks
[s[layer], end) of each layer; a layer's skipped blocks count as sent (and, on the receiver, as
arrived). Only a layer with a window in the layout (`layer_windows`) may skip blocks.

`epoch` (constructor; default: random, i.e. new per sender and so per process) is sent in every `begin`, so the receiver can tell which incarnation of
the sending process wrote the bytes; `on_transfer_end(request_id)` is called on the I/O thread
whenever a transfer ends (SUCCESS or FAILED), so an engine loop can sleep until then instead of
polling.

Authentication (`TransferConfig.auth_key`): a keyed sender proves the key to each receiver and
checks the receiver's proof before anything else (kvtransfer/_auth.py), so it never sends KV to a
receiver that lacks the key; a refused handshake (either side refused) fails the connection's
transfers with "KV handshake refused: ..." and `TransferStatus.auth_refused`, and `connect()`
raises AuthenticationError.

Threading: the public methods are called from the engine thread and never wait on the network;
connections, handshakes and all reads of the source blocks run on one event-loop thread.
"""
from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections import deque
from typing import Callable, Iterable, Sequence

import torch

from . import _auth, _protocol as proto
from ._common import (cancel_and_wait, check_block_ids, check_request_id, check_skip_blocks, normalize_layers,
                      within)
from ._endpoint import TransferEndpoint
from ._payload import BlockSource, DataPiece, plan_pieces
from .addresses import Endpoint, parse_address
from .config import TransferConfig
from .layout import PackedBlocks
from .shared_memory import SharedMemory
from .status import (AuthenticationError, LayoutMismatchError, TransferError, TransferState, TransferStatus,
                     TransportUnavailableError)
from .transports.base import Channel, ChannelClosed, Transport, TransportContext


_MIN_MESSAGES_PER_GROUP = 2  # split a layer group at least this much...
_MIN_SPLIT_BYTES = 1 << 20  # ...unless its messages would get smaller than this


class _OutgoingTransfer:
    def __init__(self, request_id: str, address: str, src_block_ids: list[int],
                 dst_block_ids: list[int], layers: tuple[int, ...], skip_blocks: tuple[int, ...],
                 device: str) -> None:
        self.uid = uuid.uuid4().hex
        self.request_id = request_id
        self.address = address
        self.src_block_ids = src_block_ids
        self.dst_block_ids = dst_block_ids
        self.layers = layers
        self.skip_blocks = skip_blocks  # per cache layer
        self.layer_position = {layer: position for position, layer in enumerate(layers)}
        self.index = torch.tensor(src_block_ids, dtype=torch.int64, device=device)
        skips = [skip_blocks[layer] for layer in layers]
        self.blocks_queued = list(skips)  # per layer: blocks [0, n) skipped or handed to send_layers
        self.pending_pieces: deque[DataPiece] = deque()  # planned, not sent yet (loop thread)
        self.in_rotation = False  # has a "next_piece" turn queued on its connection
        self.blocks_acked = list(skips)  # skipped blocks count as acknowledged
        self.layers_acked = 0
        self.unacked_messages = 0
        self.state = TransferState.PENDING
        self.error: str | None = None
        self.bytes = 0
        self.active = True  # False once ended or cancelled; the loop thread reads it per write
        self.auth_refused = False  # failed at a handshake refused for want of the auth_key

    def status(self) -> TransferStatus:
        return TransferStatus(self.request_id, self.state, self.error, self.bytes,
                              self.layers_acked, len(self.layers), auth_refused=self.auth_refused)


class _ReceiverConnection:
    def __init__(self, address: str, candidates: list[tuple[Transport, Endpoint]]) -> None:
        self.address = address
        self.candidates = candidates
        self.channel: Channel | None = None
        self.transport: Transport | None = None
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.transfers: dict[str, _OutgoingTransfer] = {}  # uid -> transfer
        self.task: asyncio.Task | None = None
        self.ping_queued = False


class KVSender(TransferEndpoint):
    """Sends KV blocks from `layer_caches`. Create with `kvtransfer.create_sender`."""

    side = "sender"
    unknown_hint = "never started, or cancelled"

    def __init__(self, transports: Sequence[Transport], layer_caches: Sequence[torch.Tensor],
                 config: TransferConfig | None = None, transport_name: str | None = None,
                 shared_memory: SharedMemory | None = None, epoch: int | None = None,
                 on_transfer_end: Callable[[str], None] | None = None, packed: PackedBlocks | None = None,
                 layer_windows: Sequence[int] = ()) -> None:
        if shared_memory is not None and not all(
                shared_memory.covers(cache.data_ptr(), cache.numel() * cache.element_size())
                for cache in layer_caches):
            raise ValueError("shared_memory must contain every layer cache")
        self.epoch = (secrets.randbits(63) | 1) if epoch is None else int(epoch)  # 0 means "not begun"
        super().__init__(transports, layer_caches, config, on_transfer_end, packed, transport_name,
                         layer_windows)  # takes a loop
        self.shared_memory = None if self.layout.is_cuda else shared_memory
        self._transfers: dict[str, _OutgoingTransfer]
        self._connections: dict[str, _ReceiverConnection] = {}
        self._run_start(30.0)

    # ---- public API (engine thread) -------------------------------------------------------

    def start(self, request_id: str, dst_address: str, src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int], layers: Iterable[int] | None = None,
              skip_blocks: Sequence[int] | None = None) -> "TransferHandle":
        """Open a transfer of `layers` (default: all) of `src_block_ids` into the receiver's
        `dst_block_ids` (same length, matched in order). Nothing is sent until
        `send_layers()`; the receiver must `expect()` the same request id, blocks, layers and
        skips. `skip_blocks[layer]` (one per cache layer; None: all 0): how many leading blocks
        of the transfer that layer does not move, in [0, len(src_block_ids)), 0 for a
        full-attention layer. The source blocks must stay unchanged until the transfer ends or
        is cancelled."""
        check_request_id(request_id)
        src = check_block_ids(src_block_ids, self.layout.num_blocks, "src_block_ids")
        dst = check_block_ids(dst_block_ids, None, "dst_block_ids")
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
        layer_tuple = normalize_layers(layers, self.layout.num_layers)
        skips = check_skip_blocks(skip_blocks, self.layout, len(src))
        candidates = self._candidates(dst_address)
        transfer = _OutgoingTransfer(request_id, dst_address, src, dst, layer_tuple, skips,
                                     self.layout.device)
        self._check_open()
        with self._lock:
            if request_id in self._transfers:
                raise ValueError(f"request {request_id!r} already has a transfer; cancel it first")
            self._transfers[request_id] = transfer
        self._loop_thread.call_soon(self._open_on_loop, transfer, candidates)
        return TransferHandle(self, request_id)

    def send_layers(self, request_id: str, layers: Iterable[int], num_blocks: int | None = None) -> None:
        """Push `layers` of an open transfer, blocks [already pushed, `num_blocks`) of each
        (default: all): call it as soon as prefill has written them. A layer's pushed count
        starts at its skip, so a layer whose blocks below `num_blocks` are all skipped pushes
        nothing; the layers of one call may start at different blocks. Raises ValueError,
        pushing nothing, if a layer had blocks up to `num_blocks` or beyond pushed already, or
        `num_blocks` is not in [1, len(src_block_ids)].
        Returns at once; on GPU the copy waits for the work queued so far on the current
        stream."""
        layer_tuple = normalize_layers(layers, self.layout.num_layers)
        with self._lock:
            transfer = self._get(request_id)
            outside = [layer for layer in layer_tuple if layer not in transfer.layer_position]
            if outside:
                raise ValueError(f"layers {outside} are not part of transfer {request_id!r} "
                                 f"(it covers {list(transfer.layers)})")
            total = len(transfer.src_block_ids)
            end = total if num_blocks is None else int(num_blocks)
            groups: dict[int, list[int]] = {}  # first block to push -> the layers starting there
            for layer in layer_tuple:
                position = transfer.layer_position[layer]
                start = transfer.blocks_queued[position]
                if 0 < end <= start == transfer.skip_blocks[layer]:
                    continue  # every block below `end` is skipped: nothing to push
                if not start < end <= total:
                    raise ValueError(f"layer {layer} of {request_id!r}: blocks [{start}, {end}) "
                                     f"are already sent or outside its {total} blocks")
                groups.setdefault(start, []).append(layer)
            for group in groups.values():
                for layer in group:
                    transfer.blocks_queued[transfer.layer_position[layer]] = end
        if not groups:
            return
        ready_event = None
        if self.layout.is_cuda:
            ready_event = torch.cuda.Event()
            ready_event.record(torch.cuda.current_stream(torch.device(self.layout.device)))
        planned = tuple((tuple(group), start) for start, group in groups.items())
        self._loop_thread.call_soon(self._queue_on_loop, transfer, ("layers", transfer, planned,
                                                                    ready_event, end))

    def send(self, request_id: str, dst_address: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], layers: Iterable[int] | None = None,
             skip_blocks: Sequence[int] | None = None) -> "TransferHandle":
        """`start()` and `send_layers()` of every layer in one call: for blocks already computed."""
        handle = self.start(request_id, dst_address, src_block_ids, dst_block_ids, layers, skip_blocks)
        with self._lock:
            transfer_layers = self._get(request_id).layers
        self.send_layers(request_id, transfer_layers)
        return handle

    def unreachable_reason(self, dst_address: str) -> str | None:
        """None if this sender has a transport the receiver at `dst_address` offers, else why not."""
        try:
            self._candidates(dst_address)
        except (TransportUnavailableError, ValueError) as exc:
            return str(exc)
        return None

    def connect(self, dst_address: str, timeout: float | None = None) -> str:
        """Connect and handshake now instead of on the first transfer; return the transport
        used. Raises LayoutMismatchError (naming both layouts), AuthenticationError (the
        handshake was refused for want of the auth_key) or TransferError."""
        self._check_open()
        candidates = self._candidates(dst_address)
        timeout = timeout if timeout is not None else 3 * self.config.timeout_s
        return self._loop_thread.run(self._connect_on_loop(dst_address, candidates), timeout)

    @property
    def total_bytes_sent(self) -> int:
        """Bytes the receivers acknowledged as written, over all transfers."""
        with self._lock:
            return self._total_bytes

    def __repr__(self) -> str:
        return f"KVSender({self.transport}, {self.layout.describe()})"

    # ---- helpers ------------------------------------------------------------------------

    def _candidates(self, dst_address: str) -> list[tuple[Transport, Endpoint]]:
        endpoints = parse_address(dst_address)
        by_name = {transport.name: transport for transport in self._transports}
        candidates = [(by_name[e.scheme], e) for e in endpoints if e.scheme in by_name]
        if not candidates:
            offered = ", ".join(sorted({e.scheme for e in endpoints}))
            raise TransportUnavailableError(
                f"receiver {dst_address!r} offers {offered}; this sender uses "
                f"{', '.join(by_name)}")
        return candidates

    # ---- loop thread ----------------------------------------------------------------------

    async def _start(self) -> None:
        self._tasks.spawn(self._watchdog())

    async def _shutdown(self) -> None:
        for connection in list(self._connections.values()):
            if connection.channel is not None:
                await connection.channel.close()
        await self._tasks.cancel_all()

    def _connection_for(self, address: str,
                        candidates: list[tuple[Transport, Endpoint]]) -> _ReceiverConnection:
        connection = self._connections.get(address)
        if connection is None:
            connection = _ReceiverConnection(address, candidates)
            self._connections[address] = connection
            connection.task = self._tasks.spawn(self._run_connection(connection))
        return connection

    def _open_on_loop(self, transfer: _OutgoingTransfer,
                      candidates: list[tuple[Transport, Endpoint]]) -> None:
        if not transfer.active:
            return
        connection = self._connection_for(transfer.address, candidates)
        connection.transfers[transfer.uid] = transfer
        connection.queue.put_nowait(("begin", transfer))

    def _queue_on_loop(self, transfer: _OutgoingTransfer, item: tuple) -> None:
        connection = self._connections.get(transfer.address)
        if transfer.active and connection is not None and transfer.uid in connection.transfers:
            connection.queue.put_nowait(item)

    async def _connect_on_loop(self, address: str,
                               candidates: list[tuple[Transport, Endpoint]]) -> str:
        connection = self._connection_for(address, candidates)
        await asyncio.shield(connection.ready)
        return connection.transport.name

    def _cancel_on_loop(self, request_id: str) -> None:
        with self._lock:
            transfer = self._transfers.pop(request_id, None)
            if transfer is None:
                return
            ended = self._end_locked(transfer, TransferState.FAILED, "cancelled by the sender")
        connection = self._connections.get(transfer.address)
        if connection is not None and connection.transfers.pop(transfer.uid, None) is not None:
            if ended:
                connection.queue.put_nowait(("abort", transfer, "cancelled by the sender"))

    def _fail(self, transfer: _OutgoingTransfer, reason: str, auth_refused: bool = False) -> None:
        with self._lock:
            if not transfer.state.is_terminal:
                transfer.auth_refused = auth_refused
            self._end_locked(transfer, TransferState.FAILED, reason)

    async def _establish(self, connection: _ReceiverConnection) -> Channel:
        loop = asyncio.get_running_loop()
        ctx = TransportContext(self.config, self.layout, loop, "sender",
                               self._views.cache_addresses(), self.shared_memory)
        errors = []
        for transport, endpoint in connection.candidates:
            try:
                channel = await within(self.config.timeout_s, transport.connect(ctx, endpoint))
            except (OSError, TransferError, asyncio.TimeoutError) as exc:
                errors.append(f"{endpoint}: {exc or type(exc).__name__}")
                continue
            try:
                await self._handshake(channel)
            except BaseException:
                await channel.close()
                raise
            connection.transport = transport
            return channel
        raise TransferError(f"cannot connect to receiver {connection.address}: "
                            + "; ".join(errors))

    async def _handshake(self, channel: Channel) -> None:
        """The hello exchange (kvtransfer/_protocol.py), authenticated when either side has an
        auth_key; raises TransferError (LayoutMismatchError, AuthenticationError) if refused."""
        hello = dict(channel.hello_fields(), type=proto.HELLO, version=proto.PROTOCOL_VERSION,
                     layout=self.layout.to_wire())
        if self.config.auth_key is not None:
            hello["auth"] = _auth.new_nonce()
        await channel.send_control(hello)
        reply = await self._handshake_reply(channel)
        if reply.get("type") == proto.HELLO_AUTH or self.config.auth_key is not None:
            reply = await self._authenticate(channel, hello, reply)
        if reply.get("type") == proto.HELLO_REJECT:
            error_type = (AuthenticationError if reply.get("auth_refused")
                          else LayoutMismatchError if reply.get("layout_mismatch") else TransferError)
            raise error_type(f"receiver {channel.peer} refused the connection: {reply.get('error')}")
        if reply.get("type") != proto.HELLO_OK:
            raise TransferError(f"receiver {channel.peer} answered the handshake with "
                                f"{reply.get('type')!r}")
        await within(self.config.timeout_s, channel.after_hello_ok(reply))

    async def _handshake_reply(self, channel: Channel) -> dict:
        try:
            return await within(self.config.timeout_s, channel.recv_control())
        except asyncio.TimeoutError:
            raise TransferError(f"receiver {channel.peer} did not answer the handshake within "
                                f"{self.config.timeout_s:g} s") from None

    async def _authenticate(self, channel: Channel, hello: dict, reply: dict) -> dict:
        """Check the receiver's proof of `auth_key` and prove it back (kvtransfer/_auth.py);
        return the receiver's next answer. A refusal passes through; a receiver that does not
        prove the key, or asks for one this sender lacks, raises AuthenticationError."""
        if reply.get("type") == proto.HELLO_REJECT:
            return reply
        key = self.config.auth_key
        if key is None:
            raise AuthenticationError(f"{_auth.REFUSED}: receiver {channel.peer} requires a KV auth key "
                                      "(auth_key), this sender has none")
        nonce = reply.get("nonce")
        if (reply.get("type") != proto.HELLO_AUTH or not _auth.is_nonce(nonce) or not _auth.verify(
                _auth.proof(key, _auth.RECEIVER, hello["auth"], nonce, hello), reply.get("proof"))):
            raise AuthenticationError(f"{_auth.REFUSED}: receiver {channel.peer} did not prove the KV auth "
                                      "key (a different auth_key, or none)")
        await channel.send_control({"type": proto.HELLO_PROOF,
                                    "proof": _auth.proof(key, _auth.SENDER, hello["auth"], nonce, hello)})
        await within(self.config.timeout_s, channel.after_auth())
        return await self._handshake_reply(channel)

    async def _run_connection(self, connection: _ReceiverConnection) -> None:
        reason, auth_refused = "connection closed", False
        try:
            try:
                connection.channel = await self._establish(connection)
            except BaseException as exc:
                connection.ready.set_exception(
                    exc if isinstance(exc, Exception) else TransferError("sender closed"))
                raise
            connection.ready.set_result(connection.channel)
            writer = asyncio.ensure_future(self._write_loop(connection))
            reader = asyncio.ensure_future(self._read_loop(connection))
            try:
                done, _ = await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait([writer, reader])
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
        except (ChannelClosed, OSError) as exc:
            reason = f"lost the connection to receiver {connection.address}: {exc}"
        except TransferError as exc:
            reason, auth_refused = str(exc), isinstance(exc, AuthenticationError)
        except asyncio.CancelledError:
            reason = "sender closed"
            raise
        except Exception as exc:
            reason = f"internal error on the connection to {connection.address}: {exc!r}"
            raise
        finally:
            if self._connections.get(connection.address) is connection:
                del self._connections[connection.address]
            for transfer in list(connection.transfers.values()):
                self._fail(transfer, reason, auth_refused)
            connection.transfers.clear()
            if connection.channel is not None:
                await connection.channel.close()

    async def _write_loop(self, connection: _ReceiverConnection) -> None:
        channel = connection.channel
        while True:
            item = await connection.queue.get()
            kind, transfer = item[0], item[1]
            if kind == "ping":
                connection.ping_queued = False
                await channel.send_control({"type": proto.PING})
            elif kind == "abort":
                await channel.send_control({"type": proto.ABORT, "uid": transfer.uid,
                                            "request_id": transfer.request_id, "error": item[2]})
            elif not transfer.active:
                continue
            elif kind == "begin":
                await channel.send_control({
                    "type": proto.BEGIN, "uid": transfer.uid, "request_id": transfer.request_id,
                    "dst_block_ids": transfer.dst_block_ids, "layers": list(transfer.layers),
                    "skip_blocks": list(transfer.skip_blocks), "epoch": self.epoch})
            elif kind == "layers":
                self._plan_layers(connection, transfer, *item[2:])
            elif kind == "next_piece":
                await self._send_next_piece(connection, transfer)

    def _plan_layers(self, connection: _ReceiverConnection, transfer: _OutgoingTransfer,
                     groups: tuple[tuple[tuple[int, ...], int], ...], ready_event, block_end: int) -> None:
        """Split each (layers, first block) group of one `send_layers` into messages; the
        transfer then takes turns with the other transfers on this connection, one message
        each, so a large transfer does not hold up a small one."""
        if ready_event is not None:
            torch.cuda.current_stream(torch.device(self.layout.device)).wait_event(ready_event)
        for layers, block_start in groups:
            limit = connection.channel.max_payload_bytes or self.config.max_message_bytes
            # a few messages per group at least, so the copies of staged transports overlap
            group_bytes = len(layers) * (block_end - block_start) * self.layout.chunk_nbytes
            limit = min(limit, max(group_bytes // _MIN_MESSAGES_PER_GROUP, _MIN_SPLIT_BYTES,
                                   self.layout.chunk_nbytes))
            transfer.pending_pieces.extend(
                plan_pieces(layers, block_end, self.layout, limit, block_start))
        if not transfer.in_rotation:
            transfer.in_rotation = True
            connection.queue.put_nowait(("next_piece", transfer))

    async def _send_next_piece(self, connection: _ReceiverConnection,
                               transfer: _OutgoingTransfer) -> None:
        piece = transfer.pending_pieces.popleft()
        if transfer.pending_pieces:
            connection.queue.put_nowait(("next_piece", transfer))
        else:
            transfer.in_rotation = False
        with self._lock:
            if transfer.state is TransferState.PENDING:
                transfer.state = TransferState.TRANSFERRING
                self._changed.notify_all()
        transfer.unacked_messages += 1
        source = BlockSource(self._views, piece, transfer.src_block_ids, transfer.index,
                             lambda: transfer.active)
        await connection.channel.send_data({
            "type": proto.DATA, "uid": transfer.uid, "request_id": transfer.request_id,
            "layers": list(piece.layers), "block_start": piece.block_start,
            "block_end": piece.block_end}, source)

    async def _read_loop(self, connection: _ReceiverConnection) -> None:
        channel = connection.channel
        while True:
            message = await channel.recv_control()
            kind = message.get("type")
            if kind == proto.ACK:
                self._on_ack(connection, message)
            elif kind == proto.ERROR:
                transfer = connection.transfers.pop(str(message.get("uid")), None)
                if transfer is not None:
                    self._fail(transfer, f"receiver {connection.address}: {message.get('error')}")
            elif kind != proto.PING:
                raise ChannelClosed(f"receiver sent an unexpected {kind!r} message")

    def _on_ack(self, connection: _ReceiverConnection, message: dict) -> None:
        transfer = connection.transfers.get(str(message.get("uid")))
        if transfer is None or not transfer.active:
            return
        layers = [int(layer) for layer in message["layers"]]
        num_blocks = int(message["block_end"]) - int(message["block_start"])
        full = len(transfer.src_block_ids)
        with self._lock:
            transfer.unacked_messages -= 1
            transfer.bytes += len(layers) * num_blocks * self.layout.chunk_nbytes
            self._total_bytes += len(layers) * num_blocks * self.layout.chunk_nbytes
            for layer in layers:
                position = transfer.layer_position[layer]
                transfer.blocks_acked[position] += num_blocks
                if transfer.blocks_acked[position] == full:
                    transfer.layers_acked += 1
            if transfer.layers_acked == len(transfer.layers):
                self._end_locked(transfer, TransferState.SUCCESS, None)
                connection.transfers.pop(transfer.uid, None)
            self._changed.notify_all()

    async def _watchdog(self) -> None:
        config = self.config
        interval = min(0.25, config.timeout_s / 8)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for connection in list(self._connections.values()):
                channel = connection.channel
                if channel is None or not connection.ready.done():
                    continue
                waiting = any(t.unacked_messages > 0 for t in connection.transfers.values())
                if waiting and now - channel.last_rx > config.timeout_s:
                    reason = (f"receiver {connection.address} sent nothing for "
                              f"{config.timeout_s:g} s (dead or stalled)")
                    for transfer in list(connection.transfers.values()):
                        self._fail(transfer, reason)
                    self._tasks.spawn(channel.close())  # may wait on a blocked group op
                elif (now - channel.last_tx >= config.heartbeat_interval_s
                      and not connection.ping_queued):
                    connection.ping_queued = True
                    connection.queue.put_nowait(("ping", None))


class TransferHandle:
    """What `KVSender.start()` / `send()` return: a request id bound to its sender."""

    def __init__(self, sender: KVSender, request_id: str) -> None:
        self.sender = sender
        self.request_id = request_id

    def send_layers(self, layers: Iterable[int]) -> None:
        self.sender.send_layers(self.request_id, layers)

    def poll(self) -> TransferStatus:
        return self.sender.poll(self.request_id)

    def wait(self, timeout: float | None = None) -> TransferStatus:
        return self.sender.wait(self.request_id, timeout)

    def cancel(self) -> None:
        self.sender.cancel(self.request_id)

    def __repr__(self) -> str:
        return f"TransferHandle({self.request_id!r})"
