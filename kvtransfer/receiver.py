"""The receiving side (decode worker): registers its caches, listens, and writes the blocks
that senders push into the destinations it was told to expect.

Lifecycle of one expected transfer (request id):
    expect()                -> PENDING       blocks reserved by the caller, nothing written yet
    sender's `begin`        -> TRANSFERRING  bound to that sender's connection
    every layer written     -> SUCCESS
    peer dead / silent for timeout_s, sender abort, bad request,
    no sender within pending_timeout_s, close()  -> FAILED (error says why)
    cancel()                -> forgotten     no byte is written into its blocks after it returns

`on_transfer_end(request_id)` (constructor) is called on the I/O thread whenever an expected
transfer ends (SUCCESS or FAILED), so an engine loop can sleep until then instead of polling.
`poll()` reports the `epoch` the sender announced (`TransferStatus.producer_epoch`).

Sliding windows: `expect(..., skip_blocks=s)` names, per cache layer, the leading blocks the
sender will not move (kvtransfer/sender.py); they count as arrived from the start, so
`layers_ready`, `wait_layer` and completion see only the moved blocks, which are all that is
written or counted in `bytes_transferred`.

Authentication (`TransferConfig.auth_key`): a keyed receiver serves a connection only once its
sender proved the same key at the handshake (kvtransfer/_auth.py); any other is refused and closed
before a `begin` or a byte of data is read from it, and counted in `refused_connections`.

Threading: the public methods are called from the engine thread and never wait on the
network. All I/O, and every write into the caches, runs on one event-loop thread owned by the
receiver; `cancel()` runs on that thread too, which orders it against every write.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable, Sequence

import torch

from . import _auth, _protocol as proto
from ._common import BoundedSet, check_block_ids, check_request_id, check_skip_blocks, normalize_layers, within
from ._endpoint import TransferEndpoint
from ._payload import BlockSink, DataPiece, DiscardSink
from .addresses import join_address
from .config import TransferConfig
from .layout import KVLayout, PackedBlocks, check_layouts
from .status import AuthenticationError, LayoutMismatchError, TransferError, TransferState, TransferStatus
from .transports.base import Channel, ChannelClosed, Listener, Transport, TransportContext

log = logging.getLogger(__name__)

# A connection with no transfer bound is closed after this much silence at least (4 x timeout_s
# when longer): far beyond any sender's heartbeat, so only a dead peer's half-open one goes.
IDLE_SILENCE_S = 60.0


class _ExpectedTransfer:
    def __init__(self, request_id: str, dst_block_ids: list[int], layers: tuple[int, ...],
                 skip_blocks: tuple[int, ...], device: str) -> None:
        self.request_id = request_id
        self.dst_block_ids = dst_block_ids
        self.layers = layers
        self.skip_blocks = skip_blocks  # per cache layer
        self.layer_position = {layer: position for position, layer in enumerate(layers)}
        self.index = torch.tensor(dst_block_ids, dtype=torch.int64, device=device)
        self.blocks_done = [skip_blocks[layer] for layer in layers]  # skipped blocks count as arrived
        self.layers_complete = 0
        self.leading_layers_complete = 0
        self.state = TransferState.PENDING
        self.error: str | None = None
        self.bytes = 0
        self.created = time.monotonic()
        self.active = True  # False once ended or cancelled; read and written on the loop thread
        self.uid: str | None = None
        self.connection: _SenderConnection | None = None
        self.producer_epoch = 0

    def status(self) -> TransferStatus:
        return TransferStatus(self.request_id, self.state, self.error, self.bytes,
                              self.layers_complete, len(self.layers), self.producer_epoch)

    def layer_done(self, layer: int) -> bool:
        position = self.layer_position.get(layer)
        return position is not None and self.blocks_done[position] == len(self.dst_block_ids)


class _SenderConnection:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.transfers: dict[str, _ExpectedTransfer] = {}  # uid -> bound transfer
        self.ended_uids = BoundedSet()
        self.ping_pending = False  # one heartbeat at a time, even while a send is stuck


class KVReceiver(TransferEndpoint):
    """Receives KV blocks into `layer_caches`. Create with `kvtransfer.create_receiver`."""

    side = "receiver"
    unknown_hint = "never expected, or cancelled"

    def __init__(self, transports: Sequence[Transport], layer_caches: Sequence[torch.Tensor],
                 config: TransferConfig | None = None,
                 on_transfer_end: Callable[[str], None] | None = None, packed: PackedBlocks | None = None,
                 layer_windows: Sequence[int] = ()) -> None:
        super().__init__(transports, layer_caches, config, on_transfer_end, packed, layer_windows=layer_windows)
        self._transfers: dict[str, _ExpectedTransfer]
        self._cancelled = BoundedSet()
        self._connections: set[_SenderConnection] = set()
        self._listeners: list[Listener] = []
        self._refused_connections = 0
        self._run_start(max(30.0, self.config.timeout_s))
        self.address = join_address([listener.endpoint for listener in self._listeners])

    # ---- public API (engine thread) -------------------------------------------------------

    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               layers: Iterable[int] | None = None, skip_blocks: Sequence[int] | None = None) -> None:
        """Announce a transfer: `dst_block_ids` (one per source block, in order) will receive
        `layers` (default: all), except the leading `skip_blocks[layer]` blocks of each layer
        (one per cache layer, as the sender's `start()` takes them; None: all 0). The blocks
        must stay reserved until the transfer ends."""
        check_request_id(request_id)
        ids = check_block_ids(dst_block_ids, self.layout.num_blocks, "dst_block_ids")
        layer_tuple = normalize_layers(layers, self.layout.num_layers)
        skips = check_skip_blocks(skip_blocks, self.layout, len(ids))
        record = _ExpectedTransfer(request_id, ids, layer_tuple, skips, self.layout.device)
        self._check_open()
        with self._lock:
            if request_id in self._transfers:
                raise ValueError(f"request {request_id!r} is already expected; cancel it first")
            self._transfers[request_id] = record
        self._loop_thread.call_soon(self._cancelled.discard, request_id)

    def layers_ready(self, request_id: str) -> int:
        """How many of the expected layers, counted in expected order from the first, have
        fully arrived: layer `layers[i]` may be read once this exceeds i."""
        with self._lock:
            return self._get(request_id).leading_layers_complete

    def wait_layer(self, request_id: str, layer: int, timeout: float | None = None) -> bool:
        """Block until `layer` has arrived (True), or the transfer ended without it, was
        cancelled, or `timeout` passed (False). For a decode step that overlaps arrival."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                record = self._transfers.get(request_id)
                if record is None or record.state is TransferState.FAILED:
                    return False
                if record.layer_done(layer):
                    return True
                if record.state is TransferState.SUCCESS:
                    return False  # ended without that layer: it was not expected
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(remaining)

    @property
    def total_bytes_received(self) -> int:
        with self._lock:
            return self._total_bytes

    @property
    def refused_connections(self) -> int:
        """Connections refused at the handshake for want of the shared key (`auth_key`): a
        sender that did not prove it (none, a wrong one, or none in time), or that asks for one
        this receiver lacks. Closed at once; nothing they sent was written anywhere."""
        with self._lock:
            return self._refused_connections

    def __repr__(self) -> str:
        return f"KVReceiver({self.transport}, {self.address!r}, {self.layout.describe()})"

    # ---- helpers ------------------------------------------------------------------------

    def _unbind_locked(self, record: _ExpectedTransfer) -> None:
        if record.connection is not None and record.uid is not None:
            record.connection.transfers.pop(record.uid, None)
            record.connection.ended_uids.add(record.uid)

    def _fail(self, record: _ExpectedTransfer, reason: str, tell_sender: bool) -> None:
        with self._lock:
            ended = self._end_locked(record, TransferState.FAILED, reason)
        if ended and tell_sender and record.connection is not None and record.uid is not None:
            self._send_error(record.connection, record.uid, reason)

    def _send_error(self, connection: _SenderConnection, uid: str, reason: str) -> None:
        message = {"type": proto.ERROR, "uid": uid, "error": reason}
        self._tasks.spawn(self._send_quietly(connection, message))

    async def _ping(self, connection: _SenderConnection) -> None:
        try:
            await self._send_quietly(connection, {"type": proto.PING})
        finally:
            connection.ping_pending = False

    @classmethod
    async def _send_quietly(cls, connection: _SenderConnection, message: dict) -> None:
        await cls._send_quietly_on(connection.channel, message)

    @staticmethod
    async def _send_quietly_on(channel: Channel, message: dict) -> None:
        try:
            await channel.send_control(message)
        except (ChannelClosed, OSError):
            pass  # the connection's own reader reports its end

    # ---- loop thread ----------------------------------------------------------------------

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        ctx = TransportContext(self.config, self.layout, loop, "receiver",
                               self._views.cache_addresses())
        try:
            for transport in self._transports:
                self._listeners.append(await transport.listen(ctx, self._on_channel))
        except BaseException:
            for listener in self._listeners:
                await listener.close()
            raise
        self._tasks.spawn(self._watchdog())

    async def _shutdown(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await listener.close()
        for connection in list(self._connections):
            await connection.channel.close()
        await self._tasks.cancel_all()

    def _on_channel(self, channel: Channel) -> None:
        if self._closed:
            self._tasks.spawn(channel.close())
            return
        self._tasks.spawn(self._serve(channel))

    def _cancel_on_loop(self, request_id: str) -> None:
        self._cancelled.add(request_id)
        with self._lock:
            record = self._transfers.pop(request_id, None)
            if record is None:
                return
            ended = self._end_locked(record, TransferState.FAILED, "cancelled by the receiver")
        if ended and record.connection is not None and record.uid is not None:
            self._send_error(record.connection, record.uid, "cancelled by the receiver")

    async def _serve(self, channel: Channel) -> None:
        connection = _SenderConnection(channel)
        reason = "connection closed"
        try:
            if not await self._handshake(channel):
                return
            self._connections.add(connection)
            while True:
                message = await channel.recv_control()
                kind = message.get("type")
                if kind == proto.DATA:
                    await self._on_data(connection, message)
                elif kind == proto.BEGIN:
                    self._on_begin(connection, message)
                elif kind == proto.ABORT:
                    self._on_abort(connection, message)
                elif kind != proto.PING:
                    raise ChannelClosed(f"{channel.peer} sent an unexpected {kind!r} message")
        except ChannelClosed as exc:
            reason = str(exc)
        except asyncio.TimeoutError:
            reason = f"no handshake from {channel.peer} within {self.config.timeout_s} s"
        except asyncio.CancelledError:
            reason = "receiver closed"
            raise
        except Exception as exc:
            reason = f"internal error: {exc!r}"
            raise
        finally:
            self._connections.discard(connection)
            for record in list(connection.transfers.values()):
                self._fail(record, f"lost the connection to sender {channel.peer}: {reason}", False)
            await channel.close()

    async def _handshake(self, channel: Channel) -> bool:
        """The hello exchange (kvtransfer/_protocol.py); False: refused, the sender was told why.
        Nothing after the hello is read before the sender authenticated (`_authenticate`)."""
        hello = await within(self.config.timeout_s, channel.recv_control())
        if hello.get("type") != proto.HELLO:
            raise ChannelClosed(f"{channel.peer} did not start with a hello")
        try:
            if hello.get("version") != proto.PROTOCOL_VERSION:
                raise TransferError(f"protocol version {hello.get('version')} from the sender, "
                                    f"{proto.PROTOCOL_VERSION} here")
            await self._authenticate(channel, hello)
            check_layouts(KVLayout.from_wire(hello["layout"]), self.layout)
            extra = await channel.accept_hello(hello)
        except AuthenticationError as exc:
            with self._lock:
                self._refused_connections += 1
            log.warning("kvtransfer receiver: refused the connection from %s: %s", channel.peer, exc)
            await self._send_quietly_on(channel, {"type": proto.HELLO_REJECT, "error": str(exc),
                                                  "auth_refused": True})
            return False
        except (TransferError, ValueError, KeyError) as exc:
            await channel.send_control({"type": proto.HELLO_REJECT, "error": str(exc),
                                        "layout_mismatch": isinstance(exc, LayoutMismatchError)})
            return False
        await channel.send_control(dict(extra, type=proto.HELLO_OK))
        await within(self.config.timeout_s, channel.after_hello_ok(hello))
        return True

    async def _authenticate(self, channel: Channel, hello: dict) -> None:
        """Mutual proof of `auth_key` (kvtransfer/_auth.py), or AuthenticationError; nothing
        happens without a key, unless the sender asks for it."""
        key = self.config.auth_key
        sender_nonce = hello.get("auth")
        if key is None:
            if sender_nonce is not None:
                raise AuthenticationError(f"{_auth.REFUSED}: the sender authenticates with a KV auth key "
                                          "(auth_key), this receiver has none")
            return
        if not _auth.is_nonce(sender_nonce):
            why = "it has no auth_key" if sender_nonce is None else "a malformed nonce"
            raise AuthenticationError(f"{_auth.REFUSED}: the sender did not prove the KV auth key ({why})")
        nonce = _auth.new_nonce()
        try:
            await channel.send_control({"type": proto.HELLO_AUTH, "nonce": nonce,
                                        "proof": _auth.proof(key, _auth.RECEIVER, sender_nonce, nonce, hello)})
            reply = await within(self.config.timeout_s, channel.recv_control())
        except (ChannelClosed, OSError, asyncio.TimeoutError):
            raise AuthenticationError(f"{_auth.REFUSED}: the sender did not prove the KV auth key (it left "
                                      "or went silent at the challenge: a different auth_key?)") from None
        expected = _auth.proof(key, _auth.SENDER, sender_nonce, nonce, hello)
        if reply.get("type") != proto.HELLO_PROOF or not _auth.verify(expected, reply.get("proof")):
            raise AuthenticationError(f"{_auth.REFUSED}: the sender did not prove the KV auth key "
                                      "(a different auth_key)")
        await within(self.config.timeout_s, channel.after_auth())

    def _why_unknown(self, request_id: str) -> str:
        if request_id in self._cancelled:
            return f"request {request_id!r} was cancelled by the receiver"
        return f"request {request_id!r} is not expected by the receiver"

    def _on_begin(self, connection: _SenderConnection, message: dict) -> None:
        uid, request_id = str(message["uid"]), str(message["request_id"])
        refusal, fail_record = None, False
        with self._lock:
            record = self._transfers.get(request_id)
            if record is None:
                refusal = self._why_unknown(request_id)
            elif record.state.is_terminal:
                refusal = f"request {request_id!r} already ended ({record.state.value})"
            elif record.uid is not None:
                refusal = f"request {request_id!r} is already being received from another sender"
            elif [int(b) for b in message["dst_block_ids"]] != record.dst_block_ids:
                refusal, fail_record = (f"dst_block_ids differ: sender sends to "
                                        f"{message['dst_block_ids']}, receiver expects "
                                        f"{record.dst_block_ids}"), True
            elif sorted(int(layer) for layer in message["layers"]) != sorted(record.layers):
                refusal, fail_record = (f"layers differ: sender sends {message['layers']}, "
                                        f"receiver expects {list(record.layers)}"), True
            elif not self._same_skips(record, message["skip_blocks"]):
                refusal, fail_record = (f"skip_blocks differ: sender skips {message['skip_blocks']}, "
                                        f"receiver expects {list(record.skip_blocks)}"), True
            else:
                record.uid, record.connection = uid, connection
                record.producer_epoch = int(message.get("epoch", 0))
                record.state = TransferState.TRANSFERRING
                connection.transfers[uid] = record
                self._changed.notify_all()
        if fail_record:
            self._fail(record, refusal, False)
        if refusal is not None:
            connection.ended_uids.add(uid)
            self._send_error(connection, uid, refusal)

    def _same_skips(self, record: _ExpectedTransfer, sent: list) -> bool:
        """Whether a `begin`'s skip_blocks (one per cache layer) agree with the expected ones on
        the transfer's layers (the only ones a transfer moves)."""
        return len(sent) == self.layout.num_layers and all(
            int(sent[layer]) == record.skip_blocks[layer] for layer in record.layers)

    def _on_abort(self, connection: _SenderConnection, message: dict) -> None:
        """The sender gave up: fail its transfer, also one it never began (still PENDING)."""
        uid = str(message.get("uid"))
        record = connection.transfers.get(uid)
        if record is None and uid not in connection.ended_uids:
            with self._lock:
                candidate = self._transfers.get(str(message.get("request_id")))
            if candidate is not None and candidate.uid is None:
                record = candidate
        if record is not None:
            self._fail(record, f"sender gave up: {message.get('error')}", False)

    def _sink_for(self, connection: _SenderConnection, message: dict,
                  piece: DataPiece, nbytes: int) -> tuple[BlockSink | DiscardSink, _ExpectedTransfer | None]:
        uid = str(message["uid"])
        record = connection.transfers.get(uid)
        if record is None:
            if uid not in connection.ended_uids:
                connection.ended_uids.add(uid)
                self._send_error(connection, uid, "data for a transfer that never began")
            return DiscardSink(nbytes), None
        problem = None
        if any(layer not in record.layer_position for layer in piece.layers):
            problem = f"data for layers {list(piece.layers)} outside the expected {list(record.layers)}"
        elif not 0 <= piece.block_start < piece.block_end <= len(record.dst_block_ids):
            problem = f"data for blocks [{piece.block_start}, {piece.block_end}) out of range"
        elif nbytes != piece.nbytes(self.layout):
            problem = f"data message announces {nbytes} bytes, its blocks hold {piece.nbytes(self.layout)}"
        elif any(piece.block_start < record.skip_blocks[layer] for layer in piece.layers):
            problem = (f"data for blocks [{piece.block_start}, {piece.block_end}) of layers {list(piece.layers)}, "
                       f"below a layer's skip ({[record.skip_blocks[layer] for layer in piece.layers]})")
        elif any(record.blocks_done[record.layer_position[layer]] + piece.num_blocks
                 > len(record.dst_block_ids) for layer in piece.layers):
            problem = "duplicate data for a layer"
        if problem is not None:
            self._fail(record, problem, True)
            return DiscardSink(nbytes), None
        return BlockSink(self._views, piece, record.dst_block_ids, record.index,
                         lambda: record.active), record

    async def _on_data(self, connection: _SenderConnection, message: dict) -> None:
        piece = DataPiece(tuple(int(layer) for layer in message["layers"]),
                          int(message["block_start"]), int(message["block_end"]))
        nbytes = int(message["nbytes"])
        sink, record = self._sink_for(connection, message, piece, nbytes)
        landed = await connection.channel.recv_data(message, sink)
        if isinstance(landed, asyncio.Future):  # the transport confirms it later
            landed.add_done_callback(lambda verdict: self._landed(
                connection, record, piece, nbytes, message["uid"],
                not verdict.cancelled() and verdict.result()))
        else:
            self._landed(connection, record, piece, nbytes, message["uid"], landed)

    def _landed(self, connection: _SenderConnection, record: _ExpectedTransfer | None,
                piece: DataPiece, nbytes: int, uid: str, landed: bool) -> None:
        """Count a data message whose bytes are in the blocks, and acknowledge it."""
        if record is None or not record.active:
            return
        if not landed:
            self._fail(record, "a data message arrived incomplete (sender cancelled midway)", False)
            return
        with self._lock:
            record.bytes += nbytes
            self._total_bytes += nbytes
            full = len(record.dst_block_ids)
            for layer in piece.layers:
                position = record.layer_position[layer]
                record.blocks_done[position] += piece.num_blocks
                if record.blocks_done[position] == full:
                    record.layers_complete += 1
            while (record.leading_layers_complete < len(record.layers)
                   and record.blocks_done[record.leading_layers_complete] == full):
                record.leading_layers_complete += 1
            if record.layers_complete == len(record.layers):
                self._end_locked(record, TransferState.SUCCESS, None)
            self._changed.notify_all()
        self._tasks.spawn(self._send_quietly(connection, {
            "type": proto.ACK, "uid": uid, "layers": list(piece.layers),
            "block_start": piece.block_start, "block_end": piece.block_end}))

    async def _watchdog(self) -> None:
        config = self.config
        interval = min(0.25, config.timeout_s / 8)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for connection in list(self._connections):
                channel = connection.channel
                # Senders heartbeat idle connections too (every timeout_s / 4 of their own config):
                # an idle one silent far longer is half-open (a dead peer), holding its buffers.
                limit = config.timeout_s if connection.transfers else max(4 * config.timeout_s, IDLE_SILENCE_S)
                if now - channel.last_rx > limit:
                    reason = (f"sender {channel.peer} sent nothing for {config.timeout_s:g} s "
                              "(dead or stalled)")
                    for record in list(connection.transfers.values()):
                        self._fail(record, reason, False)
                    self._connections.discard(connection)  # closed once
                    self._tasks.spawn(channel.close())  # may wait on a blocked group op
                elif now - channel.last_tx >= config.heartbeat_interval_s and not connection.ping_pending:
                    connection.ping_pending = True
                    self._tasks.spawn(self._ping(connection))
            if config.pending_timeout_s is not None:
                with self._lock:
                    stale = [record for record in self._transfers.values()
                             if record.state is TransferState.PENDING
                             and now - record.created > config.pending_timeout_s]
                    for record in stale:
                        self._end_locked(record, TransferState.FAILED,
                                         f"no sender started the transfer within "
                                         f"{config.pending_timeout_s:g} s")
