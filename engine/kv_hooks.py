"""The small contract between the scheduler and the KV connector (engine/kv_connector.py).

Prefill role:  WAITING -> RUNNING (layers pushed as computed) -> SENDING_KV -> FINISHED
    a request with a `kv_destination` gets all its prompt blocks at admission; after its first
    token `request_finished(request)` says whether its blocks wait for the send (SENDING_KV,
    pinned) until `Scheduler.finish_sending(request_id, error)`.

Decode role:   WAITING_FOR_KV -> RUNNING -> FINISHED
    `Scheduler.add_imported_request(request) -> ImportPlan` allocates the prompt's blocks after the
    decode worker's own prefix-cache match; the transfer writes `blocks_to_fill`; then
    `finish_import(request_id, first_token)` or `fail_import(request_id, fallback_to_local_prefill)`.

Either role: `request_ended(request)` runs before the blocks of a request that ends early (abort,
error) are freed, so that no transfer reads or writes them afterwards.

`FAILURE_REASONS`: why the connector counts a transfer as failed (its `failures`; the router
exports them per worker; "auth": a KV handshake refused for want of the shared key,
`AUTH_REFUSED`), `KVConnectorConfig`, the connector's settings, and the plain values that cross
the seam (what the connector's `poll()` returns, the producer's report, how a send or an import
ended: `StreamDelta` and the wire carry them): here so that their readers (wire, the router, the
CLI, the controller) need neither torch nor the connector.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.request import Request
from engine.step_types import SampledToken

FAILURE_REASONS = ("transfer", "timeout", "producer", "short", "epoch", "block_hash", "checksum", "lease", "auth")
# How a prefill-role send error starts when its KV handshake was refused for want of the shared key
# (the transport's status says `auth_refused`): counted as "auth" there, and by the decode side,
# which finds it in the producer's error.
AUTH_REFUSED = "KV transfer refused at the handshake (auth)"
MAC_KEY_BYTES = 32  # KVConnectorConfig.mac_key: a raw 256-bit key


class SchedulerConnector(Protocol):
    def request_finished(self, request: Request) -> bool:
        """A prefill-role request sampled its first token: True if its blocks must stay pinned
        for a send (the request becomes SENDING_KV)."""

    def request_ended(self, request: Request) -> None:
        """The request ends before its transfer did: stop it (synchronously) before its blocks
        are freed. Unknown requests are ignored."""


# What a decode worker does after a failed load: prefill the prompt itself, or fail the request.
ON_TRANSFER_FAILURE = ("fallback", "fail")
FAULTS = ("drop_layer_group", "flip_byte")  # testing only: see KVConnectorConfig.inject_fault


@dataclass(frozen=True)
class KVConnectorConfig:
    """lease_s: prefill; longest a finished prompt's blocks stay pinned for its send without
        progress (after the hold, when testing with one): renewed while bytes are acknowledged.
    transfer_timeout_s: decode; longest wait for a remote prefill's progress: for its first KV
        (the prefill worker's queue and first chunk), then for more KV (each chunk is pushed as it
        is computed, so a long prompt is not cut off by its length), then for the report.
    local_prefill_threshold: decode; fewer uncached prompt tokens than this are prefilled here.
    on_transfer_failure: decode; "fallback" (local prefill) or "fail" (end with the error).
    layerwise: prefill; push each layer group as it is computed (False: after the whole prompt).
    layer_group_size: prefill; layers per push (0: a quarter of the model's, at least 1).
    hold_send_s / inject_fault: testing only. hold: push nothing until this long after the first
    token. Faults: "drop_layer_group" (prefill: one group is never pushed), "flip_byte" (decode:
    one received byte is flipped before verification).
    mac_key: both; MAC_KEY_BYTES bytes keying the transfer checksum (`kv_checksum`), so that only a
    holder of the key can make a report that verifies; None: an unkeyed checksum. Both sides must
    have the same (else every load fails "checksum"). Not in `repr`."""
    lease_s: float = 60.0
    transfer_timeout_s: float = 60.0
    local_prefill_threshold: int = 64
    on_transfer_failure: str = "fallback"
    layerwise: bool = True
    layer_group_size: int = 0
    hold_send_s: float = 0.0
    inject_fault: str | None = None
    mac_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("lease_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}")
        if self.on_transfer_failure not in ON_TRANSFER_FAILURE:
            raise ValueError(f"on_transfer_failure must be one of {', '.join(ON_TRANSFER_FAILURE)}, "
                             f"got {self.on_transfer_failure!r}")
        if self.layer_group_size < 0 or self.hold_send_s < 0:
            raise ValueError("layer_group_size and hold_send_s must be >= 0")
        if self.inject_fault is not None and self.inject_fault not in FAULTS:
            raise ValueError(f"inject_fault must be one of {', '.join(FAULTS)}, got {self.inject_fault!r}")
        if self.mac_key is not None and (not isinstance(self.mac_key, bytes) or len(self.mac_key) != MAC_KEY_BYTES):
            got = f"{len(self.mac_key)} bytes" if isinstance(self.mac_key, bytes) else type(self.mac_key).__name__
            raise ValueError(f"mac_key must be None or {MAC_KEY_BYTES} bytes, got {got}")  # never the key itself


@dataclass(frozen=True)
class KVDestinationGroup:
    """One layer group of a grouped decode cache (engine/kv_groups.py): its layers' blocks of the
    prompt's last `len(block_ids)` blocks go to these ids (a sliding group's start at its window)."""
    layers: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVDestination:
    """Where a prefill-role request's KV goes: the decode worker's receiver and the blocks that
    hold prompt blocks [first_block_index, first_block_index + len(block_ids)). `groups`: a
    grouped decode cache's, one transfer each (`block_ids` is then empty)."""
    address: str
    block_ids: tuple[int, ...]
    first_block_index: int
    groups: tuple[KVDestinationGroup, ...] = ()


@dataclass
class ImportPlan:
    request_id: str
    block_ids: list[int]  # the request's blocks, covering every prompt position
    num_cached_tokens: int  # prompt tokens already in this worker's prefix cache (block-aligned)
    blocks_to_fill: list[tuple[int, int]]  # (block index in the prompt, block id) the transfer must write
    # A grouped cache (engine/kv_groups.py): what each layer group's transfer writes, the prompt's
    # last blocks from the group's window on (`blocks_to_fill` is then empty).
    groups: list[KVDestinationGroup] = field(default_factory=list)

    def destination(self, address: str, block_size: int) -> KVDestination:
        """Where the prefill worker writes this plan's blocks: this worker's receiver at `address`."""
        return KVDestination(address, tuple(block_id for _, block_id in self.blocks_to_fill),
                             self.num_cached_tokens // block_size, tuple(self.groups))


class KVCacheFullError(RuntimeError):
    """Not enough free KV blocks right now to import a request's prompt (retry or prefill locally)."""


# ---- what crosses the seam: plain values (the wire carries them; no torch) ----------------

@dataclass(frozen=True)
class ProducerReport:
    """The prefill worker's answer for one request (decode side)."""
    first_token: SampledToken
    epoch: int
    checksum: int
    block_hashes: tuple[bytes, ...]  # chained hashes of every full prompt block
    num_cached_tokens: int = 0  # the prefill worker's prefix-cache hit
    bytes_sent: int = 0


@dataclass(frozen=True)
class KVSendResult:
    """How a prefill-role request's send ended (its final output carries it)."""
    error: str | None
    bytes_sent: int
    epoch: int
    checksum: int = 0
    block_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class KVImportOutcome:
    """How a decode-role request got its KV (its first output carries it). `failure_reason`: why
    a remote prefill failed (one of `FAILURE_REASONS`; the request was then prefilled here or
    ended), "" when it did not."""
    prefilled_remotely: bool
    bytes_received: int
    seconds: float
    num_cached_tokens: int = 0
    failure_reason: str = ""


@dataclass(frozen=True)
class SendDone:
    request_id: str
    result: KVSendResult


@dataclass(frozen=True)
class LoadDone:
    request_id: str
    first_token: SampledToken | None  # None when the load failed before its first token was streamed
    error: str | None
    fallback: bool  # on failure: prefill locally (else end the request with `error`)
    first_token_streamed: bool = False  # the caller has `first_token` (`stream_first_token`)
    # On success with sliding-window layers: the request's blocks from this index on lack some
    # layer's KV (blocks behind that layer's window did not move), so they must not be shared.
    complete_blocks: int | None = None
