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
exports them per worker), here so that readers need neither torch nor the connector.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.request import Request

FAILURE_REASONS = ("transfer", "timeout", "producer", "short", "epoch", "block_hash", "checksum", "lease")


class SchedulerConnector(Protocol):
    def request_finished(self, request: Request) -> bool:
        """A prefill-role request sampled its first token: True if its blocks must stay pinned
        for a send (the request becomes SENDING_KV)."""

    def request_ended(self, request: Request) -> None:
        """The request ends before its transfer did: stop it (synchronously) before its blocks
        are freed. Unknown requests are ignored."""


@dataclass(frozen=True)
class KVDestination:
    """Where a prefill-role request's KV goes: the decode worker's receiver and the blocks that
    hold prompt blocks [first_block_index, first_block_index + len(block_ids))."""
    address: str
    block_ids: tuple[int, ...]
    first_block_index: int


@dataclass
class ImportPlan:
    request_id: str
    block_ids: list[int]  # the request's blocks, covering every prompt position
    num_cached_tokens: int  # prompt tokens already in this worker's prefix cache (block-aligned)
    blocks_to_fill: list[tuple[int, int]]  # (block index in the prompt, block id) the transfer must write


class KVCacheFullError(RuntimeError):
    """Not enough free KV blocks right now to import a request's prompt (retry or prefill locally)."""
