"""A worker's Stats: the engine's snapshot → the schema's WorkerStats (the worker's Stats RPC),
and that message → `WorkerStats`, what the router (router/pool.py) and the controller
(deploy/controller.py) read. Torch-free: neither of those processes loads the engine's model code."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from wire.schema import messages


@dataclass(frozen=True)
class WorkerStats:
    """One Stats answer (wire/proto/pdserve.proto WorkerStats; the schema's meaning, its zero defaults).
    Counters marked cumulative count since the worker started."""
    role: str = ""  # "prefill", "decode" or "both"
    running: int = 0
    waiting: int = 0  # requests waiting for their KV included
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    prefix_cache_queries: int = 0  # tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # of which found (cumulative)
    prefill_tokens_queued: int = 0  # prompt tokens not yet computed
    num_preemptions: int = 0  # cumulative
    kv_bytes_sent: int = 0  # cumulative
    kv_bytes_received: int = 0  # cumulative
    prompt_tokens_computed: int = 0  # cumulative
    decode_tokens: int = 0  # cumulative
    block_size: int = 0
    host_cache_blocks_total: int = 0  # host tier of the prefix cache (0: off)
    host_cache_blocks_used: int = 0
    host_cache_hits: int = 0  # prompt tokens copied back from the host tier (cumulative)
    kv_transfer_failures: dict[str, int] = field(default_factory=dict)  # by engine.kv_hooks.FAILURE_REASONS
    rss_bytes: int = 0  # the worker process's resident memory
    weight_bytes: int = 0  # of it, the model's weights
    spec_drafts: int = 0  # speculative decoding (cumulative): drafts verified, their tokens, accepted
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    prefill_chunk_tokens: int = 0  # the per-step cap on a prompt's tokens (0: none)
    # model step times by kind: {kind: (counts per bucket, sum of seconds)} (engine/step_times.py)
    step_times: dict[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found / looked up (None before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Speculative decoding: draft tokens accepted / verified (None before any draft)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None


# the plain counts and sizes: every field but these three, named as in the schema
_COUNTS = tuple(f.name for f in fields(WorkerStats) if f.name not in ("role", "kv_transfer_failures", "step_times"))


def worker_stats_to_wire(role: str, stats: Any, prefill_tokens_queued: int, block_size: int,
                         kv_bytes_sent: int = 0, kv_bytes_received: int = 0, rss_bytes: int = 0,
                         weight_bytes: int = 0) -> Any:
    """`stats` is engine.step_types.SchedulerStats; requests waiting for their KV count as waiting."""
    return messages().WorkerStats(
        role=role, running=stats.running, waiting=stats.waiting + stats.waiting_for_kv,
        kv_blocks_total=stats.kv_blocks_total, kv_blocks_free=stats.kv_blocks_free,
        kv_blocks_cached=stats.kv_blocks_cached, prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits, prefill_tokens_queued=prefill_tokens_queued,
        num_preemptions=stats.num_preemptions, kv_bytes_sent=kv_bytes_sent, kv_bytes_received=kv_bytes_received,
        prompt_tokens_computed=stats.prompt_tokens_computed, decode_tokens=stats.decode_tokens,
        block_size=block_size, host_cache_blocks_total=stats.host_cache_slots,
        host_cache_blocks_used=stats.host_cache_used, host_cache_hits=stats.host_cache_hits,
        kv_transfer_failures=stats.kv_transfer_failures, rss_bytes=rss_bytes,
        weight_bytes=weight_bytes, spec_drafts=stats.spec_drafts, spec_draft_tokens=stats.spec_draft_tokens,
        spec_accepted_tokens=stats.spec_accepted_tokens, prefill_chunk_tokens=stats.prefill_chunk_tokens,
        step_times=[messages().StepTimes(kind=kind, bucket_counts=counts, sum_seconds=total)
                    for kind, (counts, total) in stats.step_times.items()])


def worker_stats_from_wire(message: Any) -> WorkerStats:
    """A WorkerStats message (a worker's Stats answer) as the router and the controller read it."""
    return WorkerStats(
        role=message.role, **{name: int(getattr(message, name)) for name in _COUNTS},
        kv_transfer_failures={reason: int(count) for reason, count in message.kv_transfer_failures.items()},
        step_times={entry.kind: (tuple(int(c) for c in entry.bucket_counts), float(entry.sum_seconds))
                    for entry in message.step_times})
