"""KVConnector: disaggregation inside the engine step, with the transport injected.

One connector per engine, prefill or decode role, no threads of its own. Its two sides:

- scheduler side (`engine/kv_hooks.py`): `request_finished` pins a prefill-role request's blocks
  for its send (SENDING_KV); `request_ended` stops a transfer before early-freed blocks go back.
- engine side, the six members `LLMEngine` calls: `add_send` (prefill: a request with a
  destination), `start_load` (decode: expect the blocks an ImportPlan must fill, unless the
  prompt is short enough to prefill here), `layer_hook(seqs)` (prefill: before each forward, the
  callback the model runner calls after each layer's K/V store; every layer group is pushed as
  soon as it is written, for each chunk of a prompt the blocks that chunk completed: layer-wise
  push), `send_report` (prefill: the answer once every layer group is pushed), `poll()`, once
  per step, which returns the sends and loads that ended, and `close()`.
- caller side (`AsyncEngine`, for the decode worker's server): `report_producer` (the prefill
  worker's answer), `stream_first_token`, `next_deadline` and the `failures` counters.

The transport (a kvtransfer sender or receiver) calls `on_transfer_end` from its I/O thread when
a transfer ends; the connector records the id and rings the engine's wakeup, so `poll()` looks
only at transfers that ended, reports that arrived and deadlines that passed: its cost per step
does not grow with the requests in flight.

Verified hand-off. The producer reports, with its first token, its epoch (the sender's, new per
process), the chained hashes of the prompt's blocks (`sent_token_hashes`: the full blocks, and
a last one over a trailing partial block's tokens) and a checksum of every byte it sends
(`kv_checksum`, layer-major over the sent blocks; keyed by `KVConnectorConfig.mac_key` when both
sides have one, so that a report made without the key, or foreign bytes, do not verify). It
reports once every layer group is pushed (`send_report`: the bytes may still be in flight), so
the answer does not wait for an engine step to see the send end; a send that fails after that reaches the receiver as the sender's abort or a dead
connection. Before a decode-role request runs, its connector has the report and checks: its
first token is in the vocabulary; the transfer ended SUCCESS over every layer of every block; the epoch in the transfer's `begin`
equals the report's; the block hashes equal its own for the same tokens; the checksum of the
bytes in its blocks equals the report's. Anything else is a failed load, by reason
(`FAILURE_REASONS`, engine/kv_hooks.py; counted in `failures`), which falls back to local
prefill or fails the request (`on_transfer_failure`): never wrong tokens. A transport handshake
refused for want of the shared key (kvtransfer's `auth_key`; the status says `auth_refused`) is
"auth" on both sides: the prefill side's send error then starts with `AUTH_REFUSED`, which the
decode side finds in the producer's error. A refusal that comes after the report went out (a short
prompt's: pushed in the step that answered, while the handshake is in flight) reaches the decode
side only as its transfer timeout, as any send that fails before its `begin`: a receiver cannot
tell which transfer a refused sender meant.

The first token goes out before those checks. The report's first token is right whatever becomes
of the bytes once the report's block hashes equal this prompt's (it was sampled from this prompt),
so `stream_first_token` lets the caller stream it as the answer arrives (`AsyncEngine`), not at the
engine thread's next step boundary, up to a decode step later. From then on the load keeps it: a
verified load admits the request with it, a failed one falls back to a local prefill of the prompt
and that token (or fails the request), and `LoadDone.first_token_streamed` tells the engine that
the caller has it.

Sliding-window layers (`layer_windows`, engine/kv_cache.py): a send leaves out, per layer, the
leading blocks the next token no longer reads (`window_skip_blocks`; both sides compute them from
the same tokens, and the checksum covers what moved). With one block table for every layer on
the decode side, those blocks lack some layers' KV there, so a verified load says from which
block on the request's KV must not be shared (`LoadDone.complete_blocks`): the decode worker's
prefix cache never hands them out. A grouped decode cache (engine/kv_groups.py) instead names a
destination per layer group (`KVDestination.groups`): one transfer each (`_Part`, ids
`<request>#kv<group>`), a sliding group's from its window on, into blocks that then hold every
layer of their group; the checksum covers the same (layer, block) chunks in the same order.
"""
from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, Union, cast

import torch

from engine.block_hash import CacheSalt, block_key, hash_block, hash_full_blocks
from engine.config import KV_ROLES
from engine.kv_cache import window_skip_blocks
from engine.kv_hooks import (AUTH_REFUSED, FAULTS, ON_TRANSFER_FAILURE, ImportPlan,  # noqa: F401 (re-exported)
                             KVConnectorConfig, KVDestination, KVImportOutcome, KVSendResult, LoadDone,
                             ProducerReport, SendDone)
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)



class KVSenderTransport(Protocol):
    """What the prefill side needs of a kvtransfer KVSender."""
    epoch: int

    def start(self, request_id: str, dst_address: str, src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int], *, skip_blocks: Sequence[int] | None = None,
              layers: Sequence[int] | None = None) -> Any: ...

    def send_layers(self, request_id: str, layers: Sequence[int], num_blocks: int | None = None) -> None: ...

    def poll(self, request_id: str) -> Any: ...  # TransferStatus

    def cancel(self, request_id: str) -> None: ...

    def close(self) -> None: ...  # its I/O thread and connections (whoever made it closes it)


class KVShards(Protocol):
    """A tensor-parallel worker's KV heads, spread over its ranks (engine/model_runner.py): the
    connector's `kv_layers` are rank 0's transfer cache, with every head. Both calls are
    collectives of the whole group, made between steps."""

    def gather_kv(self, layers: Sequence[int], block_ids: Sequence[int]) -> None: ...

    def scatter_kv(self, block_ids: Sequence[int]) -> None: ...


class KVReceiverTransport(Protocol):
    """What the decode side needs of a kvtransfer KVReceiver."""

    def expect(self, request_id: str, dst_block_ids: Sequence[int], *,
               skip_blocks: Sequence[int] | None = None, layers: Sequence[int] | None = None) -> None: ...

    def poll(self, request_id: str) -> Any: ...  # TransferStatus

    def cancel(self, request_id: str) -> None: ...

    def close(self) -> None: ...  # its I/O thread, listening socket and connections


# A connector's transport: a sender for the prefill role, a receiver for the decode role.
KVTransport = Union[KVSenderTransport, KVReceiverTransport]


def sent_token_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | CacheSalt | None,
                      algorithm: str) -> tuple[bytes, ...]:
    """What both sides of a hand-off compare to prove the KV is this prompt's: the chained hashes
    of its full blocks, then one over the trailing partial block's tokens (a prompt shorter than
    a block, or its last few tokens, would otherwise go unchecked)."""
    hashes = hash_full_blocks(token_ids, block_size, cache_salt, algorithm)
    tail = token_ids[len(hashes) * block_size:]
    if tail:
        hashes.append(hash_block(hashes[-1] if hashes else None, tail, block_key(cache_salt, len(hashes), block_size),
                                 algorithm))
    return tuple(hashes)


def kv_checksum(layers: Sequence[torch.Tensor], layer_block_ids: Sequence[Sequence[int]],
                key: bytes | None = None) -> int:
    """A 64-bit digest of the bytes of `layer_block_ids[i]` in each layer i, layer-major, block by
    block: the same on both sides whatever each cache's block ids are (each side lists the blocks
    that moved, in prompt order: a sliding layer's start at its window). Without `key`, xxh3-64
    (integrity); with one (`KVConnectorConfig.mac_key`), HMAC-SHA256 under it, truncated to 64 bits
    (origin too: no report made without the key, nor any other bytes, verifies; SHA-256 as the
    fastest keyed hash of the standard library where the CPU has SHA extensions, about 12x
    xxh3's time). Host caches are hashed in place, a run of consecutive blocks per update; device
    caches are gathered to the host per layer."""
    if key is None:
        import xxhash
        hasher: Any = xxhash.xxh3_64()
    else:
        hasher = hmac.new(key, digestmod=hashlib.sha256)
    for layer, ids in zip(layers, layer_block_ids):
        if layer.device.type == "cpu":
            rows = layer.view(layer.shape[0], -1).view(torch.uint8).numpy()
            for start, end in _runs(ids):
                hasher.update(rows[start:end].data)
        else:
            index = torch.tensor(list(ids), dtype=torch.int64, device=layer.device)
            hasher.update(layer.index_select(0, index).cpu().view(torch.uint8).numpy().data)
    return hasher.intdigest() if key is None else int.from_bytes(hasher.digest()[:8], "big")


def _runs(block_ids: Sequence[int]) -> list[list[int]]:
    """Consecutive block ids as [start, end) runs, in order."""
    runs: list[list[int]] = []
    for block_id in block_ids:
        if runs and runs[-1][1] == block_id:
            runs[-1][1] += 1
        else:
            runs.append([block_id, block_id + 1])
    return runs


@dataclass(frozen=True)
class _Part:
    """One kvtransfer transfer of a request's KV: all of it, or one layer group's of a grouped
    decode cache (engine/kv_groups.py), whose blocks start at its window."""
    transfer_id: str
    layers: tuple[int, ...]
    first_block: int  # the prompt block its blocks start at
    block_ids: tuple[int, ...]  # this side's ids of them (source or destination)
    skip_blocks: tuple[int, ...] | None = None  # one transfer of every layer: window_skip_blocks


def _part_id(request_id: str, group: int, num_groups: int) -> str:
    return request_id if num_groups == 1 else f"{request_id}#kv{group}"


def _layer_blocks(parts: Sequence[_Part], num_layers: int) -> list[Sequence[int]]:
    """Per cache layer, the blocks that move for it, in prompt order (kv_checksum's argument)."""
    blocks: list[Sequence[int]] = [()] * num_layers
    for part in parts:
        for layer in part.layers:
            blocks[layer] = part.block_ids[part.skip_blocks[layer]:] if part.skip_blocks else part.block_ids
    return blocks


@dataclass(frozen=True)
class _Combined:
    """The transfers of one request seen as one: done once all are (or one failed), ok if all are."""
    done: bool
    ok: bool
    error: str | None
    bytes_transferred: int
    layers_done: int
    num_layers: int
    producer_epoch: int
    auth_refused: bool = False  # the failed one's handshake was refused for want of the shared key


@dataclass
class _Send:
    request: Request
    destination: KVDestination
    num_tokens: int  # the tokens whose KV it sends (the prompt, and a resumed request's outputs)
    src_block_ids: list[int] = field(default_factory=list)  # prompt blocks [first, end): what pushes count
    parts: list[_Part] = field(default_factory=list)  # the transfers opened
    opened: bool = False
    pushed: list[int] = field(default_factory=list)  # per layer group: blocks pushed so far
    finished_at: float = 0.0  # when the prompt was done: request_finished, then SENDING_KV (monotonic)
    checksum: int = 0
    block_hashes: tuple[bytes, ...] = ()
    error: str | None = None
    # The lease runs from the end of the prompt; at its deadline it is renewed if bytes were
    # acknowledged since the last one (a long prompt's KV still draining over a slow link).
    lease_due: float = 0.0
    bytes_at_renewal: int = 0


@dataclass
class _Load:
    request: Request
    plan: ImportPlan
    started: float
    report: ProducerReport | None = None
    producer_error: str | None = None
    # At each deadline the wait is extended if KV arrived since the last one, so a load fails
    # after transfer_timeout_s to 2x that without progress, however long the prompt takes.
    checked: float = 0.0
    bytes_seen: int = 0
    block_hashes: tuple[bytes, ...] = ()  # of every full block of its tokens (the report must match)
    parts: list[_Part] = field(default_factory=list)  # the transfers expected


@dataclass
class _EarlyToken:
    block_hashes: tuple[bytes, ...]
    token: Any = None  # the first token, once streamed


class KVConnector:
    """`role` "prefill" (the transport is a sender) or "decode" (a receiver). `make_transport`
    builds it with the connector's `on_transfer_end`; `wakeup` rings the engine thread.

    `shards` (tensor parallelism): `kv_layers` then hold every KV head only once gathered. A
    prefill gathers each layer group's blocks just before pushing it, after the whole prompt (a
    gather is a collective, which cannot run inside the ranks' forward); a load scatters its
    blocks to the ranks once verified."""

    def __init__(self, role: str, config: KVConnectorConfig, kv_layers: Sequence[torch.Tensor], block_size: int,
                 hash_algorithm: str, vocab_size: int,
                 make_transport: Callable[[Callable[[str], None]], KVTransport],
                 wakeup: Callable[[], None] = lambda: None, shards: KVShards | None = None,
                 layer_windows: Sequence[int] = ()) -> None:
        if role not in KV_ROLES:
            raise ValueError(f"a KV connector's role is one of {', '.join(KV_ROLES)}, got {role!r}")
        self.role = role
        self.config = config
        self.kv_layers = list(kv_layers)
        self.block_size = block_size
        self.hash_algorithm = hash_algorithm
        self.vocab_size = vocab_size  # a producer's first token must be below it
        self.shards = shards
        self.layer_windows = tuple(layer_windows)
        self._wakeup = wakeup
        self._lock = threading.Lock()
        self._ended: set[str] = set()  # transfers that ended (I/O thread) or need a look (engine thread)
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries are skipped
        self._sends: dict[str, _Send] = {}
        self._loads: dict[str, _Load] = {}
        # Under _lock: the loads whose first token may be streamed early (`stream_first_token`).
        # An entry lives exactly as long as its `_loads` one, and is taken out with it.
        self._early: dict[str, _EarlyToken] = {}
        self._pushes: list[tuple[_Send, int]] = []  # this step's (send, blocks after it)
        self._owners: dict[str, str] = {}  # a layer group's transfer id -> its request id (grouped)
        self.failures: Counter[str] = Counter()
        self.polls = 0
        num_layers = len(self.kv_layers)
        size = config.layer_group_size or max(1, num_layers // 4)
        self.layer_groups = [range(start, min(num_layers, start + size)) for start in range(0, num_layers, size)]
        self._group_ending_at = {group[-1]: index for index, group in enumerate(self.layer_groups)}
        self.transport: KVTransport = make_transport(self._on_transfer_end)

    def close(self) -> None:
        """Close the transport (its I/O thread, sockets and fds): only for an engine whose
        construction failed; a running worker's server closes the transport it built."""
        self.transport.close()

    @property
    def _sender(self) -> KVSenderTransport:
        """The transport of a prefill-role connector (only sends call this)."""
        return cast(KVSenderTransport, self.transport)

    @property
    def _receiver(self) -> KVReceiverTransport:
        """The transport of a decode-role connector (only loads call this)."""
        return cast(KVReceiverTransport, self.transport)

    # ---- transport side (I/O thread) ------------------------------------------------------

    def _on_transfer_end(self, transfer_id: str) -> None:
        with self._lock:
            self._ended.add(self._owners.get(transfer_id, transfer_id))
        self._wakeup()

    def _look_again(self, request_id: str) -> None:
        with self._lock:
            self._ended.add(request_id)

    # ---- scheduler side -------------------------------------------------------------------

    def request_finished(self, request: Request) -> bool:
        send = self._sends.get(request.request_id)
        if send is None:
            return False
        now = time.monotonic()
        send.finished_at = now  # the scheduler makes the request SENDING_KV once this returns True
        try:
            if not send.opened and send.error is None:
                self._open(send)  # push-after-prefill or a hold: nothing was opened yet
            if not self.config.hold_send_s:
                self._push_rest(send)  # push-after-prefill; with layer-wise push, nothing is left
            elif self.shards is not None and send.error is None:  # gathered now: the checksum reads it
                self.shards.gather_kv(range(len(self.kv_layers)), send.src_block_ids)
            send.checksum = kv_checksum(self.kv_layers, _layer_blocks(send.parts, len(self.kv_layers)),
                                        self.config.mac_key)
            # the tokens whose KV was sent: not the first token, sampled just now
            sent_tokens = request.all_token_ids[:request.num_computed_tokens]
            send.block_hashes = sent_token_hashes(sent_tokens, self.block_size, request.cache_salt,
                                                  self.hash_algorithm)
        except Exception as exc:  # the send fails (poll() ends it), never the engine step
            logger.exception("finishing the KV send of %s failed", request.request_id)
            send.error = send.error or f"KV send failed: {exc}"
        if self.config.hold_send_s:
            heapq.heappush(self._deadlines, (now + self.config.hold_send_s, request.request_id))
        send.lease_due = now + self.config.hold_send_s + self.config.lease_s
        heapq.heappush(self._deadlines, (send.lease_due, request.request_id))
        self._look_again(request.request_id)  # it may have ended already (a failure mid-prefill)
        return True

    def send_report(self, request_id: str) -> KVSendResult | None:
        """The report a prefill worker answers with as soon as its request is SENDING_KV, when
        every layer group is pushed (the bytes may still be in flight: the decode side's receiver
        sees them land, or the sender's abort, and verifies them against this report), so the
        answer does not wait for the next engine step to see the send end. None while something
        is held back or failed: the answer then waits for the send's end (the final delta)."""
        send = self._sends.get(request_id)
        if (send is None or send.error is not None or not send.opened
                or any(pushed < len(send.src_block_ids) for pushed in send.pushed)):
            return None
        try:
            sent = self._poll_parts(send.parts).bytes_transferred
        except KeyError:  # the transfer ended meanwhile: the final delta says how
            return None
        return KVSendResult(None, sent, self._sender.epoch, send.checksum, send.block_hashes)

    def request_ended(self, request: Request) -> None:
        request_id = request.request_id
        send = self._sends.pop(request_id, None)
        if send is not None:
            self._cancel_parts(send.parts)
        load, _ = self._end_load(request_id)
        if load is not None:
            self._cancel_parts(load.parts)

    # ---- prefill side ---------------------------------------------------------------------

    def add_send(self, request: Request) -> None:
        """Engine thread, when a prefill-role request with a destination is added (ValueError
        for a decode-role connector, a second send of the request, or a wrong destination)."""
        if self.role != "prefill":
            raise ValueError("this engine sends no KV: its KV connector has the decode role")
        destination = request.kv_destination
        if request.request_id in self._sends:
            raise ValueError(f"request id {request.request_id!r} already has a KV send")
        num_blocks = -(-request.num_tokens // self.block_size)
        end = destination.first_block_index + len(destination.block_ids)
        if destination.groups:
            bad = [g for g in destination.groups
                   if not 0 < len(g.block_ids) <= num_blocks - destination.first_block_index or not g.layers]
            if bad or sorted(layer for g in destination.groups for layer in g.layers) != list(range(len(self.kv_layers))):
                raise ValueError(f"the destination's layer groups do not cover this model's {len(self.kv_layers)} layers "
                                 f"once, each with 1 to {num_blocks - destination.first_block_index} blocks")
        elif end != num_blocks or not destination.block_ids:
            raise ValueError(f"the destination covers prompt blocks [{destination.first_block_index}, {end}) but "
                             f"the prompt of {request.num_tokens} tokens has {num_blocks} blocks")
        self._sends[request.request_id] = _Send(request, destination, request.num_tokens,
                                                pushed=[0] * len(self.layer_groups))

    def layer_hook(self, seqs: Sequence[Any]) -> Callable[[int], None] | None:
        """Before a forward: what each send may push after it (`seqs`: the batch's ScheduledSeqs).
        Returns the per-layer callback for the model runner, or None when nothing is pushed."""
        self._pushes = []
        if not self._sends or not self.config.layerwise or self.config.hold_send_s or self.shards is not None:
            return None
        for seq in seqs:
            send = self._sends.get(seq.request.request_id)
            if send is None or send.error is not None:
                continue
            if not send.opened and not self._open(send):
                continue
            first = send.destination.first_block_index
            done_tokens = seq.start + seq.num_new_tokens
            full = len(send.request.block_ids) if seq.sample else done_tokens // self.block_size
            blocks = max(0, min(full - first, len(send.src_block_ids)))
            if blocks > send.pushed[0]:
                self._pushes.append((send, blocks))
        return self._layer_stored if self._pushes else None

    def _layer_stored(self, layer: int) -> None:
        """Model runner, after layer `layer` stored its K/V: push a group that is complete."""
        group_index = self._group_ending_at.get(layer)
        if group_index is None:
            return
        for send, blocks in self._pushes:
            if send.error is None:
                self._push(send, group_index, blocks)

    def _push(self, send: _Send, group_index: int, blocks: int) -> None:
        if self.config.inject_fault == "drop_layer_group" and group_index == len(self.layer_groups) // 2:
            send.pushed[group_index] = blocks  # "sent": the receiver never gets it
            return
        try:
            if self.shards is not None:
                self.shards.gather_kv(self.layer_groups[group_index], send.src_block_ids[:blocks])
            done = send.destination.first_block_index + blocks  # prompt blocks [0, done) are written
            for part in send.parts:
                layers = [layer for layer in self.layer_groups[group_index] if layer in part.layers]
                part_blocks = min(done - part.first_block, len(part.block_ids))
                if layers and part_blocks >= 1:
                    self._sender.send_layers(part.transfer_id, layers, part_blocks)
            send.pushed[group_index] = blocks
        except (KeyError, ValueError) as exc:  # the transfer ended meanwhile (poll() reports it)
            send.error = send.error or f"KV push failed: {exc}"
            self._look_again(send.request.request_id)

    def _open(self, send: _Send) -> bool:
        request, destination = send.request, send.destination
        first, end = destination.first_block_index, -(-send.num_tokens // self.block_size)
        send.src_block_ids = list(request.block_ids[first:end])
        try:
            if destination.groups:  # a grouped decode cache: one transfer per layer group
                for index, group in enumerate(destination.groups):
                    start = end - len(group.block_ids)
                    part = _Part(_part_id(request.request_id, index, len(destination.groups)), tuple(group.layers),
                                 start, tuple(request.block_ids[start:end]))
                    self._owners[part.transfer_id] = request.request_id
                    self._sender.start(part.transfer_id, destination.address, list(part.block_ids),
                                       list(group.block_ids), layers=list(part.layers))
                    send.parts.append(part)
            else:
                skip = window_skip_blocks(self.layer_windows, send.num_tokens, self.block_size, first)
                part = _Part(request.request_id, tuple(range(len(self.kv_layers))), first, tuple(send.src_block_ids),
                             None if skip is None else tuple(skip))
                self._sender.start(request.request_id, destination.address, send.src_block_ids,
                                   list(destination.block_ids), skip_blocks=skip)
                send.parts.append(part)
        except Exception as exc:  # e.g. no transport in common with the destination
            send.error = f"KV send failed to start: {exc}"
            self._look_again(request.request_id)
            return False
        send.opened = True
        return True

    def _push_rest(self, send: _Send) -> None:
        if send.error is not None or (not send.opened and not self._open(send)):
            return
        for group_index in range(len(self.layer_groups)):
            if send.pushed[group_index] < len(send.src_block_ids):
                self._push(send, group_index, len(send.src_block_ids))

    def _poll_send(self, request_id: str, now: float) -> SendDone | None:
        send = self._sends.get(request_id)
        if send is None:
            return None
        sending = send.request.status is RequestStatus.SENDING_KV  # the prompt is done
        if sending and now >= send.finished_at + self.config.hold_send_s:
            self._push_rest(send)  # after a hold (testing); a no-op once every group is pushed
        status = None
        if send.opened:
            try:
                status = self._poll_parts(send.parts)
            except KeyError:
                pass
        sent = status.bytes_transferred if status is not None else 0
        error, reason = send.error, "transfer"
        if error is None and status is not None and status.done and not status.ok:
            if status.auth_refused:
                error, reason = f"{AUTH_REFUSED}: {status.error}", "auth"
            else:
                error = f"KV transfer failed: {status.error}"
        if error is not None:
            self.failures[reason] += 1
            return self._end_send(send, error, sent)
        if not sending:
            return None
        if status is not None and status.ok:
            return self._end_send(send, None, sent)
        if now >= send.lease_due:
            if sent > send.bytes_at_renewal:  # still draining: the lease runs on from here
                send.bytes_at_renewal, send.lease_due = sent, now + self.config.lease_s
                heapq.heappush(self._deadlines, (send.lease_due, request_id))
                return None
            self.failures["lease"] += 1
            return self._end_send(send, f"KV transfer lease of {self.config.lease_s:g} s expired", sent)
        return None

    def _end_send(self, send: _Send, error: str | None, bytes_sent: int) -> SendDone:
        request_id = send.request.request_id
        del self._sends[request_id]
        self._cancel_parts(send.parts)  # stop them, or drop the records of finished ones
        return SendDone(request_id, KVSendResult(error, bytes_sent, self._sender.epoch,
                                                 send.checksum, send.block_hashes))

    # ---- decode side ----------------------------------------------------------------------

    def start_load(self, request: Request, plan: ImportPlan, streamable: bool = True) -> bool:
        """Engine thread, after the scheduler allocated the blocks the transfer must fill: expect
        them, or return False (nothing to fill, or fewer uncached tokens than the local-prefill
        threshold: prefill here). `streamable`: its first token may go out before the checks
        (`stream_first_token`); not for a request the engine detokenizes (an early token would
        have no text)."""
        if ((not plan.blocks_to_fill and not plan.groups)
                or request.num_tokens - plan.num_cached_tokens < self.config.local_prefill_threshold):
            return False
        # Its tokens (a resumed request's include its outputs) do not change while it loads. Hashed
        # before the receiver expects it: past `expect`, nothing may fail and leave its record.
        hashes = sent_token_hashes(request.all_token_ids, self.block_size, request.cache_salt, self.hash_algorithm)
        end = -(-request.num_tokens // self.block_size)
        if plan.groups:  # a grouped cache: one transfer per layer group
            parts = [_Part(_part_id(request.request_id, index, len(plan.groups)), tuple(group.layers),
                           end - len(group.block_ids), tuple(group.block_ids))
                     for index, group in enumerate(plan.groups)]
        else:
            first = plan.blocks_to_fill[0][0]
            skip = window_skip_blocks(self.layer_windows, request.num_tokens, self.block_size, first)
            parts = [_Part(request.request_id, tuple(range(len(self.kv_layers))), first,
                           tuple(block_id for _, block_id in plan.blocks_to_fill), None if skip is None else tuple(skip))]
        expected: list[_Part] = []
        try:
            for part in parts:
                self._owners[part.transfer_id] = request.request_id
                if plan.groups:
                    self._receiver.expect(part.transfer_id, list(part.block_ids), layers=list(part.layers))
                else:
                    self._receiver.expect(part.transfer_id, list(part.block_ids), skip_blocks=part.skip_blocks)
                expected.append(part)
        except BaseException:
            self._cancel_parts(expected)
            raise
        now = time.monotonic()
        self._loads[request.request_id] = _Load(request, plan, now, checked=now, block_hashes=hashes, parts=parts)
        if streamable:
            with self._lock:
                self._early[request.request_id] = _EarlyToken(hashes)
        heapq.heappush(self._deadlines, (now + self.config.transfer_timeout_s, request.request_id))
        return True

    def stream_first_token(self, request_id: str, report: ProducerReport, deliver: Callable[[], None]) -> bool:
        """Any thread, when the prefill worker's report arrives: send its first token to the
        caller now (`deliver`)? Yes, once per load, if the load still waits and may stream, the
        report's block hashes equal this prompt's and the token is in the vocabulary; the load then
        keeps that token whatever becomes of the bytes (see the module docstring). No: the engine's
        checks decide when it takes the report, as without this call.

        `deliver` runs under the connector's lock. The load ends (`_end_load`) under that lock
        before the engine emits anything more for the request, so whatever the engine emits comes
        after the token (given `deliver` and the engine queue outputs in one order, e.g. onto the
        same event loop)."""
        if not self._in_vocabulary(report):
            return False
        with self._lock:
            early = self._early.get(request_id)
            if early is None or early.token is not None or report.block_hashes != early.block_hashes:
                return False
            early.token = report.first_token
            deliver()
            return True

    def _in_vocabulary(self, report: ProducerReport) -> bool:
        return 0 <= report.first_token.token_id < self.vocab_size

    def _end_load(self, request_id: str) -> tuple[_Load | None, Any]:
        """Forget a load (engine thread): (its record, its first token if `stream_first_token`
        sent it). From then on its first token can no longer be streamed."""
        with self._lock:
            early = self._early.pop(request_id, None)
        return self._loads.pop(request_id, None), early.token if early is not None else None

    def report_producer(self, request_id: str, report: ProducerReport | None, error: str | None = None) -> bool:
        """Engine thread: the prefill worker answered (a report, or why it failed). False if the
        request is no longer loading."""
        load = self._loads.get(request_id)
        if load is None:
            return False
        if report is not None and not self._in_vocabulary(report):
            report, error = None, f"first token {report.first_token.token_id} is outside the vocabulary"
        load.report, load.producer_error = report, error
        self._look_again(request_id)
        return True

    def _poll_load(self, request_id: str, now: float) -> LoadDone | None:
        load = self._loads.get(request_id)
        if load is None:
            return None
        if load.producer_error is not None:
            reason = "auth" if AUTH_REFUSED in load.producer_error else "producer"
            return self._fail_load(load, reason, load.producer_error)
        try:
            status = self._poll_parts(load.parts)
        except KeyError:  # its record is gone (the receiver closed)
            return self._fail_load(load, "transfer", "the receiver no longer knows the transfer")
        if status.done and not status.ok:  # never "auth": a receiver cannot tell what a refused sender sent for
            return self._fail_load(load, "transfer", f"KV transfer failed: {status.error}")
        # The producer answers once every layer is pushed, not received: wait for both.
        if load.report is None or not status.done:
            timeout = self.config.transfer_timeout_s
            if now - load.checked < timeout:
                return None
            if status.bytes_transferred > load.bytes_seen:  # still arriving: wait another stretch
                load.checked, load.bytes_seen = now, status.bytes_transferred
                heapq.heappush(self._deadlines, (now + timeout, request_id))
                return None
            if load.report is None:
                return self._fail_load(load, "timeout", f"no KV arrived for {timeout:g} s")
            return self._fail_load(load, "short", f"the prefill worker pushed every layer, but only "
                                                  f"{status.layers_done} of {status.num_layers} arrived "
                                                  f"(nothing more for {timeout:g} s)")
        problem = self._verify(load, status)
        if problem is not None:
            return self._fail_load(load, *problem)
        if self.shards is not None:
            self.shards.scatter_kv([block_id for _, block_id in load.plan.blocks_to_fill])
        _, streamed = self._end_load(request_id)
        self._cancel_parts(load.parts)  # drops the finished records
        load.request.kv_import = KVImportOutcome(True, status.bytes_transferred, now - load.started,
                                                 load.report.num_cached_tokens)
        # One transfer of every layer, some skipping blocks behind their window: from the first
        # block it wrote on, those layers' KV is missing. (A grouped cache holds no such block.)
        complete = None
        skip = load.parts[0].skip_blocks
        if not load.plan.groups and skip is not None and max(skip):
            complete = load.plan.blocks_to_fill[0][0]
        return LoadDone(request_id, load.report.first_token, None, False, streamed is not None, complete)

    def _verify(self, load: _Load, status: Any) -> tuple[str, str] | None:
        report = load.report
        if status.producer_epoch != report.epoch:
            return "epoch", (f"the KV was written by producer epoch {status.producer_epoch:x}, but the report "
                             f"comes from epoch {report.epoch:x} (the prefill worker restarted)")
        if report.block_hashes != load.block_hashes:
            return "block_hash", "the prefill worker's block hashes differ from this prompt's (a different prompt)"
        blocks = _layer_blocks(load.parts, len(self.kv_layers))
        if self.config.inject_fault == "flip_byte":
            self.kv_layers[0][blocks[0][0]].view(-1).view(torch.uint8)[7] ^= 0x10
        if kv_checksum(self.kv_layers, blocks, self.config.mac_key) != report.checksum:
            return "checksum", "the received KV bytes do not match the prefill worker's checksum"
        return None

    def _fail_load(self, load: _Load, reason: str, message: str) -> LoadDone:
        request_id = load.request.request_id
        _, streamed = self._end_load(request_id)
        try:
            received = self._poll_parts(load.parts).bytes_transferred
        except KeyError:
            received = 0
        self._cancel_parts(load.parts)  # no byte lands in its blocks after this
        self.failures[reason] += 1
        load.request.kv_import = KVImportOutcome(False, received, time.monotonic() - load.started,
                                                 failure_reason=reason)
        return LoadDone(request_id, streamed, f"remote prefill failed ({reason}): {message}",
                        self.config.on_transfer_failure == "fallback", streamed is not None)

    # ---- once per step --------------------------------------------------------------------

    def poll(self) -> list[SendDone | LoadDone]:
        """The sends and loads that ended since the last call (engine thread). An internal
        failure ends that one transfer, never the others or the step."""
        self.polls += 1
        with self._lock:
            ids, self._ended = self._ended, set()
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            ids.add(heapq.heappop(self._deadlines)[1])
        results = []
        for request_id in ids:
            try:
                done = self._poll_send(request_id, now) if self.role == "prefill" else self._poll_load(request_id, now)
            except Exception as exc:
                logger.exception("KV transfer of %s: internal error", request_id)
                done = self._fail_internal(request_id, f"internal error: {exc}")
            if done is not None:
                results.append(done)
        return results

    def _fail_internal(self, request_id: str, message: str) -> SendDone | LoadDone | None:
        send, load = self._sends.get(request_id), self._loads.get(request_id)
        if send is not None:
            self.failures["transfer"] += 1
            return self._end_send(send, message, 0)
        if load is not None:
            return self._fail_load(load, "transfer", message)
        return None

    def _poll_parts(self, parts: Sequence[_Part]) -> _Combined:
        """The request's transfers as one (KeyError if the transport no longer knows one)."""
        statuses = [self.transport.poll(part.transfer_id) for part in parts]
        failed = next((s for s in statuses if s.done and not s.ok), None)
        epochs = {s.producer_epoch for s in statuses}
        return _Combined(done=failed is not None or all(s.done for s in statuses), ok=all(s.ok for s in statuses),
                         error=failed.error if failed is not None else None,
                         bytes_transferred=sum(s.bytes_transferred for s in statuses),
                         layers_done=sum(s.layers_done for s in statuses), num_layers=sum(s.num_layers for s in statuses),
                         producer_epoch=epochs.pop() if len(epochs) == 1 else -1,
                         auth_refused=failed is not None and failed.auth_refused)

    def _cancel_parts(self, parts: Sequence[_Part]) -> None:
        for part in parts:
            self._owners.pop(part.transfer_id, None)
            self._cancel_transfer(part.transfer_id)

    def _cancel_transfer(self, request_id: str) -> None:
        """Stop a transfer, or drop a finished one's record. A transport closed meanwhile (the
        worker is stopping) has nothing left to stop: the request still ends here, never stuck
        in SENDING_KV or WAITING_FOR_KV because its cancel raised."""
        try:
            self.transport.cancel(request_id)
        except RuntimeError as exc:
            logger.debug("KV transfer %s: not cancelled: %s", request_id, exc)

    def next_deadline(self) -> float | None:
        """When `poll()` must run next even if no transfer ends (monotonic seconds); None when
        nothing is in flight. Entries of requests that already ended are dropped here."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][1] not in self._sends and deadlines[0][1] not in self._loads:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None
