"""Conversions between the wire schema (wire/proto/pdserve.proto) and engine objects for both worker
kinds (the decode worker is the prefill service's client). What routers read, a worker's Stats
and KV events, is in the torch-free wire/stats.py and wire/kv_events.py."""
from __future__ import annotations

from typing import Any

from engine.kv_hooks import KVSendResult, ProducerReport
from engine.kv_hooks import ImportPlan, KVDestination, KVDestinationGroup
from engine.outputs import StreamDelta
from engine.step_types import SampledToken
from kvtransfer.status import dtype_description, windows_description
from wire.schema import cache_salt_to_wire, messages, sampling_to_wire


def token_logprob_to_wire(token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> Any:
    pb = messages()
    return pb.TokenLogprob(token_id=token_id, logprob=logprob or 0.0,
                           top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in (top or [])])


def sampled_token_from_wire(message: Any, want_logprobs: bool) -> SampledToken:
    """The prefill worker's first token, as the decode worker's scheduler takes it."""
    if not want_logprobs:
        return SampledToken(int(message.token_id))
    return SampledToken(int(message.token_id), float(message.logprob),
                        [(int(t.token_id), float(t.logprob)) for t in message.top])


def chunk_from_delta(delta: StreamDelta, want_logprobs: bool) -> Any:
    """A decode worker's TokenChunk; the one from the delta with `kv_import` says how the request
    got its KV (the first token's, or the one after a first token streamed early)."""
    pb = messages()
    chunk = pb.TokenChunk(token_ids=delta.new_token_ids, finish_reason=delta.finish_reason or "",
                          num_cached_tokens=delta.num_cached_tokens, num_prompt_tokens=delta.num_prompt_tokens,
                          error=delta.error or "")
    if want_logprobs:
        chunk.logprobs.extend(token_logprob_to_wire(lp.token_id, lp.logprob, lp.top_logprobs)
                              for lp in delta.new_logprobs)
    if delta.prompt_logprobs is not None:
        chunk.prompt_logprobs.extend(token_logprob_to_wire(lp.token_id, lp.logprob, lp.top_logprobs)
                                     for lp in delta.prompt_logprobs[1:])
    outcome = delta.kv_import
    if outcome is not None:
        chunk.kv_bytes_received = outcome.bytes_received
        chunk.kv_transfer_seconds = outcome.seconds
        chunk.prefilled_remotely = outcome.prefilled_remotely
        chunk.kv_failure_reason = outcome.failure_reason
        if outcome.prefilled_remotely:
            chunk.num_cached_tokens = outcome.num_cached_tokens
    return chunk


def layout_to_wire(layout: Any) -> Any:
    """A kvtransfer.KVLayout as the schema's KVLayout (sliding windows included)."""
    return messages().KVLayout(num_layers=layout.num_layers, block_size=layout.block_size,
                               num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                               dtype=str(layout.dtype).removeprefix("torch."), kv_format=layout.kv_format,
                               layer_windows=list(layout.layer_windows))


def describe_wire_layout(message: Any) -> str:
    values = dtype_description(message.kv_format, message.dtype)
    windows = f" windows=[{windows_description(message.layer_windows)}]" if any(message.layer_windows) else ""
    return (f"layers={message.num_layers} block_size={message.block_size} kv_heads={message.num_kv_heads} "
            f"head_dim={message.head_dim} dtype={values}{windows}")


def same_layout(a: Any, b: Any) -> bool:
    """Whether two schema KVLayouts can exchange blocks: every field, sliding windows included
    (all zeros is the same as none: every layer full)."""
    fields = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "kv_format")
    return all(getattr(a, name) == getattr(b, name) for name in fields) and (
        _windows(a.layer_windows) == _windows(b.layer_windows))


def _windows(layer_windows: Any) -> tuple[int, ...]:
    """A schema KVLayout's windows as KVLayout stores them: () when every layer is full."""
    windows = tuple(int(w) for w in layer_windows)
    return windows if any(windows) else ()


def prefill_request_to_wire(request: Any, plan: ImportPlan, address: str, layout: Any) -> Any:
    """The decode worker's Prefill call for an engine request: its tokens (with a resumed
    request's outputs), its sampling and priority, and where to write the blocks `plan` fills (the
    receiver at `address`, whose caches have the kvtransfer `layout`). The prefill worker reads it
    back with `serving.request_from_wire`."""
    pb = messages()
    target = plan.destination(address, layout.block_size)
    destination = pb.KVDestination(transport=address.split("://", 1)[0], address=address,
                                   layout=layout_to_wire(layout), block_ids=target.block_ids,
                                   first_block_index=target.first_block_index,
                                   groups=[pb.KVDestinationGroup(layers=group.layers, block_ids=group.block_ids)
                                           for group in target.groups])
    return pb.PrefillRequest(request_id=request.request_id, prompt_token_ids=request.all_token_ids,
                             sampling=sampling_to_wire(request.sampling_params), destination=destination,
                             num_resumed_tokens=request.num_resumed_tokens, priority=request.priority,
                             **cache_salt_to_wire(request.cache_salt))


def destination_from_wire(message: Any) -> KVDestination:
    if not message.address:
        raise ValueError("destination.address is empty: name the decode worker's KV receiver")
    groups = tuple(KVDestinationGroup(tuple(int(layer) for layer in group.layers), tuple(int(b) for b in group.block_ids))
                   for group in message.groups)
    if not message.block_ids and not groups:
        raise ValueError("destination.block_ids is empty")
    return KVDestination(message.address, tuple(int(b) for b in message.block_ids), int(message.first_block_index),
                         groups)


def prefill_response(delta: StreamDelta, first: StreamDelta | None) -> Any:
    """The PrefillResponse for a prefill-role request's answering delta (`StreamDelta.answers_prefill`:
    the first token's with the send's report, or the final one; `first`: the one with its first
    token, if it got that far)."""
    pb = messages()
    response = pb.PrefillResponse(num_cached_tokens=delta.num_cached_tokens)
    if first is not None and first.new_token_ids:
        lp = first.new_logprobs[0] if first.new_logprobs else None
        response.first_token.CopyFrom(token_logprob_to_wire(first.new_token_ids[0], lp.logprob if lp else None,
                                                            lp.top_logprobs if lp else None))
    result: KVSendResult | None = delta.kv_send
    if result is not None:
        response.kv_bytes_sent = result.bytes_sent
        response.producer_epoch = result.epoch
        response.kv_checksum = result.checksum
        response.block_hashes.extend(result.block_hashes)
    ended_badly = delta.finished and delta.finish_reason != "prefill_done"
    if ended_badly or result is None or result.error is not None:
        response.finish_reason = delta.finish_reason if ended_badly else "error"
        response.error = delta.error or (result.error if result is not None else "the request finished without a KV send") or ""
    return response


def producer_report_from_wire(response: Any, want_logprobs: bool) -> ProducerReport:
    return ProducerReport(sampled_token_from_wire(response.first_token, want_logprobs), int(response.producer_epoch),
                          int(response.kv_checksum), tuple(bytes(h) for h in response.block_hashes),
                          int(response.num_cached_tokens), int(response.kv_bytes_sent))

