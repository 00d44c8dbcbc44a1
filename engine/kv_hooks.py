"""The small interfaces between the scheduler and KV transfer (kvtransfer fills them in).

Prefill role:  WAITING -> PREFILLING (RUNNING) -> SENDING_KV (exported, blocks pinned) -> DONE
    after its first sampled token a request finishes ("prefill_done") and the scheduler calls
    `KVExporter.export(request, block_ids)`; the blocks stay referenced until
    `Scheduler.release_export(request_id)` (transfer ended or its lease expired) or an abort.

Decode role:   ALLOCATED -> WAITING_FOR_KV -> RUNNING -> FINISHED
    `Scheduler.add_imported_request(request) -> ImportPlan` allocates the prompt's blocks after the
    decode worker's own prefix-cache match; the transfer writes `blocks_to_fill`; then
    `finish_import(request_id, first_token)` or `fail_import(request_id, fallback_to_local_prefill)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.request import Request


class KVExporter(Protocol):
    def export(self, request: Request, block_ids: list[int]) -> None:
        """Start sending the KV of `block_ids` (the request's whole prompt, in order). Must not
        block; call `Scheduler.release_export(request.request_id)` when the transfer ends."""


@dataclass
class ImportPlan:
    request_id: str
    block_ids: list[int]  # the request's blocks, covering every prompt position
    num_cached_tokens: int  # prompt tokens already in this worker's prefix cache (block-aligned)
    blocks_to_fill: list[tuple[int, int]]  # (block index in the prompt, block id) the transfer must write


class KVCacheFullError(RuntimeError):
    """Not enough free KV blocks right now to import a request's prompt (retry or prefill locally)."""
