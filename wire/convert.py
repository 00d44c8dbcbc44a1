"""Conversions between the wire schema (proto/pdserve.proto) and engine objects, shared by both
worker kinds (the decode worker is the prefill service's client)."""
from __future__ import annotations

from typing import Any

from engine import wire
from engine.outputs import StreamDelta
from engine.scheduler import SampledToken


def token_logprob_to_wire(token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> Any:
    pb = wire.messages()
    return pb.TokenLogprob(token_id=token_id, logprob=logprob or 0.0,
                           top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in (top or [])])


def sampled_token_from_wire(message: Any, want_logprobs: bool) -> SampledToken:
    """The prefill worker's first token, as the decode worker's scheduler takes it."""
    if not want_logprobs:
        return SampledToken(int(message.token_id))
    return SampledToken(int(message.token_id), float(message.logprob),
                        [(int(t.token_id), float(t.logprob)) for t in message.top])


def chunk_from_delta(delta: StreamDelta, want_logprobs: bool) -> Any:
    pb = wire.messages()
    chunk = pb.TokenChunk(token_ids=delta.new_token_ids, finish_reason=delta.finish_reason or "",
                          num_cached_tokens=delta.num_cached_tokens, num_prompt_tokens=delta.num_prompt_tokens,
                          error=delta.error or "")
    if want_logprobs:
        chunk.logprobs.extend(token_logprob_to_wire(lp.token_id, lp.logprob, lp.top_logprobs)
                              for lp in delta.new_logprobs)
    return chunk


def layout_to_wire(layout: Any) -> Any:
    """A kvtransfer.KVLayout as the schema's KVLayout."""
    return wire.messages().KVLayout(num_layers=layout.num_layers, block_size=layout.block_size,
                                    num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                                    dtype=str(layout.dtype).removeprefix("torch."))


def describe_wire_layout(message: Any) -> str:
    return (f"layers={message.num_layers} block_size={message.block_size} kv_heads={message.num_kv_heads} "
            f"head_dim={message.head_dim} dtype={message.dtype}")


def worker_stats_to_wire(role: str, stats: Any, prefill_tokens_queued: int, block_size: int,
                         kv_bytes_sent: int = 0, kv_bytes_received: int = 0) -> Any:
    """`stats` is engine.scheduler.SchedulerStats; requests waiting for their KV count as waiting."""
    return wire.messages().WorkerStats(
        role=role, running=stats.running, waiting=stats.waiting + stats.waiting_for_kv,
        kv_blocks_total=stats.kv_blocks_total, kv_blocks_free=stats.kv_blocks_free,
        kv_blocks_cached=stats.kv_blocks_cached, prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits, prefill_tokens_queued=prefill_tokens_queued,
        num_preemptions=stats.num_preemptions, kv_bytes_sent=kv_bytes_sent, kv_bytes_received=kv_bytes_received,
        prompt_tokens_computed=stats.prompt_tokens_computed, decode_tokens=stats.decode_tokens,
        block_size=block_size, host_cache_blocks_total=stats.host_cache_slots,
        host_cache_blocks_used=stats.host_cache_used, host_cache_hits=stats.host_cache_hits)
