"""Triton kernels for the paged KV cache: store-KV, decode attention (split-KV) and prefill attention.

Cache layout: `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (see `metadata.py`). The
kernels address every cached token through its sequence's block table, so a tile of `TILE_N`
tokens may span several blocks and any power-of-two block size works.

The 8-bit cache (engine/kv_quant.py, `[num_blocks, block_bytes]` bytes) goes through the same
attention kernels (`QUANT`: 0 none, 1 int8, 2 fp8 e4m3): its values are addressed like the cache
above (block stride `block_bytes`) and loaded as bytes. A K tile is dequantized in registers
(value * scale + the block's bf16 K reference row) before its dot with q; a V tile is converted
unscaled and its per-(block, head) scale goes on the softmax weights `p`. No dequantized copy of
the cache is made. fp8 e4m3 bits are decoded with
integer ops (`_e4m3_as_fp16`), which run alike on any GPU and in the interpreter (which has no
fp8 arithmetic). Its store (`_store_kv_8bit_kernel`) writes the bytes `KVQuantFormat.store` writes.

GQA: one program handles one KV head and all `GROUP = num_heads // num_kv_heads` query heads
that read it, so each K/V tile is loaded once per program and feeds a `[rows, TILE_N]` dot.
Softmax is online, in fp32, in base 2 (`scale_log2 = scale * log2(e)`).

Attention variants (engine/attention/variant.py), each a constexpr-guarded feature, so the plain
kernels compile to the code they had without them: `SOFTCAP` caps each score (in log2 units, so
with `softcap_log2 = softcap * log2(e)`), `SLIDING` masks keys at or before `position - window`
and starts the loop at the tile holding the first visible key (the tiles before it are never
loaded), `SINKS` adds `exp(sink_h)` to each head's softmax denominator once, after the last tile
(with split-KV: in the combine, after merging the splits).

Importing this module defines the kernels, so `TRITON_INTERPRET=1` must be set before it is
imported for them to run on CPU (`get_attention_backend("triton")` does that without CUDA).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from engine.attention.variant import AttentionVariant
from engine.kv_quant import MIN_SCALE, KVQuantFormat

LOG2_E = 1.4426950408889634
_QUANT = {"int8": 1, "fp8_e4m3": 2}
_MIN_SCALE = tl.constexpr(MIN_SCALE)  # kernels may read only constexpr globals
_LOG2_E = tl.constexpr(LOG2_E)
_TWO_LOG2_E = tl.constexpr(2 * LOG2_E)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_POW2: tl.constexpr, DIM_POW2: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_POW2)[:, None]
    dims = tl.arange(0, DIM_POW2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_key_token + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + token64 * stride_value_token + heads * stride_value_head + dims, mask=mask)
    dst = cache_ptr + block * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head + dims
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e4m3_as_fp16(bits):
    """fp8 e4m3fn bits (uint8) -> the value / 256 as fp16, exact for every pattern but NaN (0x7F,
    0xFF read as +-480): e4m3's sign, exponent (bias 7) and mantissa moved into fp16's fields (bias
    15) are the value times 2^-8, fp16 subnormals covering e4m3's."""
    b = bits.to(tl.int32)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _fp32_to_e4m3_bits(y):
    """float32 within +-448 (or NaN) -> fp8 e4m3fn bits (uint8), rounded to nearest even exactly as
    torch converts (c10's fp8e4m3fn_from_fp32_value), in integer ops so it runs alike everywhere."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # below 2^-6, e4m3's smallest normal: adding 2^14 rounds to a multiple of 2^-9 (its subnormal
    # step) and leaves the count in the low bits
    small = (magnitude.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    normal = (magnitude + ((7 - 127) << 23) + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
    code = tl.where(magnitude < (121 << 23), small, normal)
    code = tl.where(magnitude > 0x7F800000, 0x7F, code)
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _fp32_to_bf16(x):
    """float32 (finite) -> bfloat16 rounded to nearest even, as torch converts, in integer ops (the
    interpreter's own conversion truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _quantize(x, scale, qmax, QUANT: tl.constexpr):
    """`KVQuantFormat.quantize` as torch computes it: x / scale (IEEE division), clamped to +-qmax
    (NaN kept); int8 rounded half to even, fp8 converted as torch does."""
    y = tl.clamp(tl.div_rn(x, scale), -qmax, qmax, propagate_nan=tl.PropagateNan.ALL)
    # one return per constexpr branch: a return after the `if` would be compiled for both
    # QUANTs, and the two return types differ
    if QUANT == 1:
        # |y| <= 127: adding 1.5 * 2^23 leaves no fraction bits, so the add rounds half to even
        q = ((y + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        q = _fp32_to_e4m3_bits(y)
    return q


@triton.jit
def _stored_to_f32(raw, QUANT: tl.constexpr):
    """Stored 8-bit values -> float32 as torch reads them; fp8 NaN bytes (which only an earlier
    owner's leftovers past the written positions can hold) as NaN of their sign, so re-quantizing
    them gives torch's bytes too."""
    if QUANT == 1:
        return raw.to(tl.float32)
    value = _e4m3_as_fp16(raw).to(tl.float32) * 256.0
    nan = ((raw.to(tl.int32) << 24) | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where((raw & 0x7F) == 0x7F, nan, value)


@triton.jit
def _requantize_half(half_ptr, old, scale, qmax, stride_slot, stride_head, heads, dims, mask, first,
                     QUANT: tl.constexpr):
    """One K/V half of a block, from scale `old` to `scale` (per head), where the scale grew: its
    slots before `first` (the write's first offset in the block; what it holds)."""
    mask = mask & (scale > old)[:, None]
    for offset in range(first):
        ptrs = half_ptr + offset * stride_slot + heads[:, None] * stride_head + dims[None, :]
        held = _stored_to_f32(tl.load(ptrs, mask=mask, other=0), QUANT) * old[:, None]
        tl.store(ptrs, _quantize(held, scale[:, None], qmax, QUANT), mask=mask)


@triton.jit
def _store_kv_8bit_kernel(
    key_ptr, value_ptr, values_ptr, scales_ptr, refs_ptr, sorted_slots_ptr, order_ptr, num_tokens,
    qmax, inv_qmax,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_values_block, stride_values_kv, stride_values_slot, stride_values_head,
    stride_scales_block, stride_scales_kv, stride_refs_block, stride_refs_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_POW2: tl.constexpr, DIM_POW2: tl.constexpr, QUANT: tl.constexpr,
    NEED_BY_RECIPROCAL: tl.constexpr,
):
    """`KVQuantFormat.store`, byte for byte. Program i takes the i-th token in slot order
    (`sorted_slots[i]` = `slot_mapping[order[i]]`, stable); the first of each block's tokens
    (they are contiguous in that order) does the whole block: its K reference (a write at offset
    0, which sorts first, sets it), the scale its write needs, a re-quantization of the block when
    a scale grows, the scales, then its tokens' values (K less the reference)."""
    i = tl.program_id(0)
    slot = tl.load(sorted_slots_ptr + i)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    previous = tl.load(sorted_slots_ptr + i - 1, mask=i > 0, other=-1)
    if (previous >= 0) & (previous // BLOCK_SIZE == block):
        return
    heads = tl.arange(0, HEADS_POW2)
    dims = tl.arange(0, DIM_POW2)
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    key_tile = heads[:, None] * stride_key_head + dims[None, :]
    value_tile = heads[:, None] * stride_value_head + dims[None, :]

    # a write at offset 0 (the block's smallest here) starts the block afresh, its K the reference
    fresh = slot % BLOCK_SIZE == 0
    ref_ptrs = refs_ptr + block * stride_refs_block + heads[:, None] * stride_refs_head + dims[None, :]
    if fresh:
        opener = tl.load(order_ptr + i)  # the token written at offset 0
        ref = _fp32_to_bf16(tl.load(key_ptr + opener * stride_key_token + key_tile, mask=mask, other=0.0).to(tl.float32))
        tl.store(ref_ptrs, ref, mask=mask)
    else:
        ref = tl.load(ref_ptrs, mask=mask, other=0.0)
    ref = ref.to(tl.float32)

    # the largest |x - ref| per (K/V, head) over the block's tokens (ref = 0 for V); their end in slot order
    amax_k = tl.zeros([HEADS_POW2], dtype=tl.float32)
    amax_v = tl.zeros([HEADS_POW2], dtype=tl.float32)
    end = i
    next_slot = slot
    while next_slot // BLOCK_SIZE == block:
        token = tl.load(order_ptr + end)
        k = tl.load(key_ptr + token * stride_key_token + key_tile, mask=mask, other=0.0).to(tl.float32) - ref
        v = tl.load(value_ptr + token * stride_value_token + value_tile, mask=mask, other=0.0).to(tl.float32)
        amax_k = tl.maximum(amax_k, tl.max(tl.abs(k), 1))
        amax_v = tl.maximum(amax_v, tl.max(tl.abs(v), 1))
        end += 1
        next_slot = tl.load(sorted_slots_ptr + end, mask=end < num_tokens, other=-BLOCK_SIZE)
    if NEED_BY_RECIPROCAL:  # torch on CUDA divides by a Python-float divisor as x * (1 / divisor)
        need_k = amax_k * inv_qmax
        need_v = amax_v * inv_qmax
    else:
        need_k = tl.div_rn(amax_k, qmax)
        need_v = tl.div_rn(amax_v, qmax)

    scale_ptrs = scales_ptr + block * stride_scales_block + heads
    old_k = tl.load(scale_ptrs, mask=head_mask, other=0.0)
    old_v = tl.load(scale_ptrs + stride_scales_kv, mask=head_mask, other=0.0)
    scale_k = tl.maximum(tl.maximum(need_k, tl.where(fresh, 0.0, old_k)), _MIN_SCALE)
    scale_v = tl.maximum(tl.maximum(need_v, tl.where(fresh, 0.0, old_v)), _MIN_SCALE)
    grew = tl.max((((scale_k > old_k) | (scale_v > old_v)) & head_mask).to(tl.int32), 0)
    block_ptr = values_ptr + block * stride_values_block
    if (grew > 0) & (slot % BLOCK_SIZE != 0):
        first = slot % BLOCK_SIZE  # this program's token is the block's first in slot order
        _requantize_half(block_ptr, old_k, scale_k, qmax, stride_values_slot, stride_values_head, heads, dims,
                         mask, first, QUANT)
        _requantize_half(block_ptr + stride_values_kv, old_v, scale_v, qmax, stride_values_slot,
                         stride_values_head, heads, dims, mask, first, QUANT)
        tl.debug_barrier()  # the re-quantized bytes land before this write's tokens overwrite theirs
    tl.store(scale_ptrs, scale_k, mask=head_mask)
    tl.store(scale_ptrs + stride_scales_kv, scale_v, mask=head_mask)

    for index in range(i, end):  # in slot order, stable: of two tokens for one slot the later one stays
        token = tl.load(order_ptr + index)
        dst = (block_ptr + (tl.load(sorted_slots_ptr + index) % BLOCK_SIZE) * stride_values_slot
               + heads[:, None] * stride_values_head + dims[None, :])
        k = tl.load(key_ptr + token * stride_key_token + key_tile, mask=mask, other=0.0).to(tl.float32) - ref
        v = tl.load(value_ptr + token * stride_value_token + value_tile, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, _quantize(k, scale_k[:, None], qmax, QUANT), mask=mask)
        tl.store(dst + stride_values_kv, _quantize(v, scale_v[:, None], qmax, QUANT), mask=mask)


@triton.jit
def _paged_tile_offsets(block_table_row_ptr, tokens, token_mask, kv_head,
                        stride_cache_block, stride_cache_slot, stride_cache_head,
                        BLOCK_SIZE: tl.constexpr):
    """Block ids and element offsets (int64) of cached tokens `tokens` of one sequence, for one KV head."""
    block_ids = tl.load(block_table_row_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    offsets = block_ids * stride_cache_block + (tokens % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
    return block_ids, offsets


@triton.jit
def _unscaled_8bit(raw, dtype: tl.constexpr, QUANT: tl.constexpr):
    """8-bit values as loaded -> `dtype`, before their scale: int8 as is, fp8 as value / 256
    (`_token_scales` puts the 256 back); exact in float32, float16 and bfloat16."""
    if QUANT == 1:
        return raw.to(dtype)
    return _e4m3_as_fp16(raw).to(dtype)


@triton.jit
def _token_scales(scales_ptr, block_ids, token_mask, index, stride_scales_block, QUANT: tl.constexpr):
    """Each token's scale: its block's for `index` (K/V half * stride + KV head); fp8: times 256."""
    scales = tl.load(scales_ptr + block_ids * stride_scales_block + index, mask=token_mask, other=0.0)
    if QUANT == 2:
        scales = scales * 256.0
    return scales


@triton.jit
def _tile_scores(q, k, scales_ptr, refs_ptr, block_ids, token_mask, dims, dim_mask, kv_head, stride_scales_block,
                 stride_refs_block, stride_refs_head, scale_log2, QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores of a tile of cached tokens, in log2 units: q . k (8-bit: k = value * its block's K
    scale + its block's K reference, dequantized in registers)."""
    if QUANT:
        k_scales = _token_scales(scales_ptr, block_ids, token_mask, kv_head, stride_scales_block, QUANT)
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        refs = tl.load(refs_ptr + block_ids[:, None] * stride_refs_block + kv_head * stride_refs_head + dims[None, :],
                       mask=kv_mask, other=0.0)
        k = _unscaled_8bit(k, tl.float32, QUANT) * k_scales[:, None] + refs.to(tl.float32)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
    else:
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    return scores


@triton.jit
def _tile_values(p, v, scales_ptr, block_ids, token_mask, index, stride_scales_block, dtype: tl.constexpr,
                 QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """p @ v over a tile of cached tokens (8-bit: p times each token's V scale, `index` its half
    and head)."""
    if QUANT:
        v_scales = _token_scales(scales_ptr, block_ids, token_mask, index, stride_scales_block, QUANT)
        out = tl.dot((p * v_scales[None, :]).to(dtype), _unscaled_8bit(v, dtype, QUANT), input_precision=DOT_PRECISION)
    else:
        out = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _soft_cap(scores, softcap_log2):
    """`softcap * tanh(s / softcap)` of scores s given in log2 units (`scores = s * log2(e)`,
    `softcap_log2 = softcap * log2(e)`), in the same units. tanh from one exp2 of -2|x|, so it
    cannot overflow and runs alike on any GPU and in the interpreter (which has no libdevice)."""
    x = scores / softcap_log2
    t = tl.exp2(tl.abs(x) * -_TWO_LOG2_E)
    magnitude = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -magnitude, magnitude) * softcap_log2


@triton.jit
def _add_sinks(m_i, l_i, acc, sinks_ptr, heads, row_mask):
    """Online-softmax state (running max, denominator, unnormalized output; log2 units) with each
    row's head sink (`sinks_ptr`: float32 per query head, natural-log units) joined to the
    denominator: the state after one more key whose value is zero."""
    sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0) * _LOG2_E
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _paged_decode_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr,
    query_ptr, cache_ptr, scales_ptr, refs_ptr, sinks_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2, split_len, window, softcap_log2,
    stride_query_token, stride_query_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    stride_scales_block, stride_scales_kv, stride_refs_block, stride_refs_head,
    stride_block_tables_seq,
    stride_partial_out_seq, stride_partial_out_head, stride_partial_out_split,
    stride_partial_lse_seq, stride_partial_lse_head,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_POW2: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    """Program (seq, kv_head, split): the single query token of `seq`, the GROUP query heads of
    `kv_head`, context tokens [base + split * split_len, base + (split + 1) * split_len), where
    base is 0, or with `SLIDING` the start of the tile holding the window's first key (so the
    splits share out the window, not the whole context). With one split the result goes straight
    to `out`; otherwise a normalized partial result and its log2-sum-exp go to the partial buffers
    for `_combine_splits_kernel`. Sequences whose query length is not 1 are left to the prefill
    kernel."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if query_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_begin = split * split_len
    if SLIDING:
        # the query (position seq_len - 1) sees [window_start, seq_len); every split so placed
        # holds at least one of those keys (split_len is a multiple of TILE_N)
        window_start = tl.maximum(seq_len - window, 0)
        kv_begin += window_start // TILE_N * TILE_N
    if kv_begin >= seq_len:
        return
    kv_end = tl.minimum(kv_begin + split_len, seq_len)

    group = tl.arange(0, GROUP_POW2)
    dims = tl.arange(0, DIM_POW2)
    heads = kv_head * GROUP + group
    row_mask = group < GROUP
    dim_mask = dims < HEAD_DIM
    token64 = query_start.to(tl.int64)
    q = tl.load(query_ptr + token64 * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    m_i = tl.full([GROUP_POW2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_POW2], dtype=tl.float32)
    acc = tl.zeros([GROUP_POW2, DIM_POW2], dtype=tl.float32)
    for tile_start in range(kv_begin, kv_end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        token_mask = tokens < kv_end
        if SLIDING:
            token_mask = token_mask & (tokens >= window_start)
        block_ids, offsets = _paged_tile_offsets(block_table_row, tokens, token_mask, kv_head, stride_cache_block,
                                                 stride_cache_slot, stride_cache_head, BLOCK_SIZE)
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = _tile_scores(q, k, scales_ptr, refs_ptr, block_ids, token_mask, dims, dim_mask, kv_head,
                              stride_scales_block, stride_refs_block, stride_refs_head, scale_log2, QUANT,
                              DOT_PRECISION)
        if SOFTCAP:
            scores = _soft_cap(scores, softcap_log2)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_cache_kv + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _tile_values(p, v, scales_ptr, block_ids, token_mask, stride_scales_kv + kv_head,
                                                  stride_scales_block, q.dtype, QUANT, DOT_PRECISION)
        m_i = m_new

    if SINKS:
        if NUM_SPLITS == 1:  # split: the combine adds the sink, once
            l_i, acc = _add_sinks(m_i, l_i, acc, sinks_ptr, heads, row_mask)
    result = acc / l_i[:, None]
    store_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + token64 * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        seq64 = seq.to(tl.int64)
        dst = (partial_out_ptr + seq64 * stride_partial_out_seq + heads[:, None] * stride_partial_out_head
               + split * stride_partial_out_split + dims[None, :])
        tl.store(dst, result, mask=store_mask)
        lse_dst = partial_lse_ptr + seq64 * stride_partial_lse_seq + heads * stride_partial_lse_head + split
        tl.store(lse_dst, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit
def _combine_splits_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, sinks_ptr, seq_lens_ptr, query_start_ptr, split_len, window,
    stride_out_token, stride_out_head,
    stride_partial_out_seq, stride_partial_out_head, stride_partial_out_split,
    stride_partial_lse_seq, stride_partial_lse_head,
    HEAD_DIM: tl.constexpr, DIM_POW2: tl.constexpr, NUM_SPLITS: tl.constexpr,
    TILE_N: tl.constexpr, SLIDING: tl.constexpr, SINKS: tl.constexpr,
):
    """Program (seq, head): merge the non-empty splits of a decode sequence, weighted by exp2(lse)
    (the decode kernel's splits: `SLIDING`, `TILE_N` place them as it does); with `SINKS` the head's
    sink joins the merged denominator."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if query_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    if SLIDING:
        num_used = tl.cdiv(seq_len - tl.maximum(seq_len - window, 0) // TILE_N * TILE_N, split_len)
    else:
        num_used = tl.cdiv(seq_len, split_len)
    splits = tl.arange(0, NUM_SPLITS)
    split_mask = splits < num_used
    dims = tl.arange(0, DIM_POW2)
    dim_mask = dims < HEAD_DIM
    seq64 = seq.to(tl.int64)
    lse = tl.load(partial_lse_ptr + seq64 * stride_partial_lse_seq + head * stride_partial_lse_head + splits,
                  mask=split_mask, other=float("-inf"))
    if SINKS:
        sink = tl.load(sinks_ptr + head) * _LOG2_E
        lse_max = tl.maximum(tl.max(lse, 0), sink)
    else:
        lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - lse_max)
    weights = tl.where(split_mask, weights, 0.0)
    parts = tl.load(partial_out_ptr + seq64 * stride_partial_out_seq + head * stride_partial_out_head
                    + splits[:, None] * stride_partial_out_split + dims[None, :],
                    mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    if SINKS:
        result = tl.sum(parts * weights[:, None], 0) / (tl.sum(weights, 0) + tl.exp2(sink - lse_max))
    else:
        result = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    dst = out_ptr + query_start.to(tl.int64) * stride_out_token + head * stride_out_head + dims
    tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=dim_mask)


@triton.jit
def _paged_prefill_kernel(
    out_ptr, query_ptr, cache_ptr, scales_ptr, refs_ptr, sinks_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2, window, softcap_log2,
    stride_query_token, stride_query_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    stride_scales_block, stride_scales_kv, stride_refs_block, stride_refs_head,
    stride_block_tables_seq,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_POW2: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    SKIP_SINGLE_TOKEN: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    """Program (seq, query_tile, kv_head): BLOCK_Q query tokens of `seq` times the GROUP query
    heads of `kv_head` form the BLOCK_Q * GROUP_POW2 rows of one tile; row r is query token
    r // GROUP_POW2 of the tile and head-in-group r % GROUP_POW2. Query token i of the chunk sits
    at position context_len + i and attends to cached positions 0 ..= that position (`SLIDING`:
    those after position - window; the loop starts at the tile holding the tile's first query's
    first visible key)."""
    seq = tl.program_id(0)
    query_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if SKIP_SINGLE_TOKEN and query_len == 1:
        return
    if query_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_POW2
    rows = tl.arange(0, BLOCK_M)
    query_index = query_tile * BLOCK_Q + rows // GROUP_POW2
    group = rows % GROUP_POW2
    heads = kv_head * GROUP + group
    row_mask = (query_index < query_len) & (group < GROUP)
    dims = tl.arange(0, DIM_POW2)
    dim_mask = dims < HEAD_DIM
    tokens64 = (query_start + query_index).to(tl.int64)
    q = tl.load(query_ptr + tokens64[:, None] * stride_query_token + heads[:, None] * stride_query_head
                + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    query_positions = context_len + query_index

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    kv_end = tl.minimum(seq_len, context_len + (query_tile + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_POW2], dtype=tl.float32)
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(context_len + query_tile * BLOCK_Q - window + 1, 0) // TILE_N * TILE_N
    for tile_start in range(kv_start, kv_end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        token_mask = tokens < kv_end
        block_ids, offsets = _paged_tile_offsets(block_table_row, tokens, token_mask, kv_head, stride_cache_block,
                                                 stride_cache_slot, stride_cache_head, BLOCK_SIZE)
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = _tile_scores(q, k, scales_ptr, refs_ptr, block_ids, token_mask, dims, dim_mask, kv_head,
                              stride_scales_block, stride_refs_block, stride_refs_head, scale_log2, QUANT,
                              DOT_PRECISION)
        if SOFTCAP:
            scores = _soft_cap(scores, softcap_log2)
        visible = token_mask[None, :] & (tokens[None, :] <= query_positions[:, None])
        if SLIDING:
            visible = visible & (tokens[None, :] > query_positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_cache_kv + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _tile_values(p, v, scales_ptr, block_ids, token_mask, stride_scales_kv + kv_head,
                                                  stride_scales_block, q.dtype, QUANT, DOT_PRECISION)
        m_i = m_new

    if SINKS:
        l_i, acc = _add_sinks(m_i, l_i, acc, sinks_ptr, heads, row_mask)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_i[:, None]
    dst = out_ptr + tokens64[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs get exact fp32 products (not TF32); 16-bit inputs the target's default."""
    return "ieee" if dtype == torch.float32 else None


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Triton twin of `torch_backend.store_kv`: write key/value rows at their slots, -1 skipped."""
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_dim) dimension")
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_POW2=_pow2(num_kv_heads), DIM_POW2=max(16, _pow2(head_dim)),
    )


class _PagedCache(NamedTuple):
    """What the kernels read: the values (the cache itself, or an 8-bit cache's bytes: int8, or fp8
    as uint8 bits) with their strides (block, K/V, slot, head), the 8-bit scales and K references
    with theirs (block, K/V; block, head; unread otherwise) and `QUANT`."""

    values: torch.Tensor
    scales: torch.Tensor
    refs: torch.Tensor
    value_strides: tuple[int, int, int, int]
    scale_strides: tuple[int, int]
    ref_strides: tuple[int, int]
    block_size: int
    num_kv_heads: int
    quant: int


def _paged_cache(kv_cache: torch.Tensor, kv_format: KVQuantFormat | None) -> _PagedCache:
    if kv_format is None:
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        return _PagedCache(kv_cache, kv_cache, kv_cache, kv_cache.stride()[:4], (0, 0), (0, 0), block_size,
                           num_kv_heads, 0)
    values, scales, refs = kv_format.split(kv_cache)
    if values.dtype != torch.int8:
        values = values.view(torch.uint8)
    return _PagedCache(values, scales, refs, values.stride()[:4], scales.stride()[:2], refs.stride()[:2],
                       kv_format.block_size, kv_format.num_kv_heads, _QUANT[kv_format.name])


class _VariantArgs(NamedTuple):
    """An `AttentionVariant` as the attention kernels take it: runtime values (`window`,
    `softcap_log2`, the float32 sinks; placeholders where unused) and their constexpr switches."""

    window: int
    softcap_log2: float
    sinks: torch.Tensor
    sliding: bool
    softcap: bool
    has_sinks: bool

    def switches(self) -> dict:
        return {"SLIDING": self.sliding, "SOFTCAP": self.softcap, "SINKS": self.has_sinks}


def check_variant(variant: AttentionVariant | None, num_heads: int) -> None:
    """What the kernels need of a variant beyond its own checks: one float sink per query head."""
    sinks = None if variant is None else variant.sinks
    if sinks is not None:
        if tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have shape ({num_heads},) (one per query head), got {tuple(sinks.shape)}")
        if not sinks.dtype.is_floating_point:
            raise ValueError(f"sinks must be a float tensor, got {sinks.dtype}")


def _variant_args(variant: AttentionVariant | None, query: torch.Tensor) -> _VariantArgs:
    check_variant(variant, query.shape[1])
    window = None if variant is None else variant.sliding_window
    softcap = None if variant is None else variant.softcap
    sinks = None if variant is None else variant.sinks
    if sinks is not None:
        sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
    return _VariantArgs(window or 0, 0.0 if softcap is None else softcap * LOG2_E,
                        query if sinks is None else sinks,  # unread without SINKS
                        window is not None, softcap is not None, sinks is not None)


def decode_context_span(max_seq_len: int, sliding_window: int | None, tile_n: int) -> int:
    """The most cached tokens a decode's loop visits: with a window, the tile-aligned window."""
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window + tile_n - 1)


def sort_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots in ascending order, their token indices), a stable sort: what `store_kv_8bit_triton`
    needs, the same for every layer of a forward pass."""
    return torch.sort(slot_mapping.to(torch.int64), stable=True)


def store_kv_8bit_triton(key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_format: KVQuantFormat, sorted_slots: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`kv_format.store(key, value, layer, slot_mapping)`, the same bytes, in one launch and without
    a device sync. `sorted_slots`: `sort_slots(slot_mapping)`."""
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    cache = _paged_cache(layer, kv_format)  # checks the layer's shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    slots, order = sorted_slots
    qmax = kv_format.qmax
    _store_kv_8bit_kernel[(num_tokens,)](
        key, value, cache.values, cache.scales, cache.refs, slots, order, num_tokens,
        qmax, float(np.float32(1) / np.float32(qmax)),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *cache.value_strides, *cache.scale_strides, *cache.ref_strides,
        BLOCK_SIZE=kv_format.block_size, NUM_KV_HEADS=kv_format.num_kv_heads, HEAD_DIM=kv_format.head_dim,
        HEADS_POW2=_pow2(kv_format.num_kv_heads), DIM_POW2=max(16, _pow2(kv_format.head_dim)),
        QUANT=cache.quant, NEED_BY_RECIPROCAL=layer.device.type == "cuda",
    )


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float, max_seq_len: int,
                           num_splits: int, tile_n: int, num_warps: int = 4,
                           kv_format: KVQuantFormat | None = None,
                           variant: AttentionVariant | None = None) -> None:
    """Attention of every single-token sequence of the batch, written into `out` in place.

    The context (with a sliding window: its tiles from the window's first on) is cut into
    `num_splits` (a power of two) ranges of whole `tile_n` tiles; with more than one split, a
    second kernel merges the partial results. Sequences with another query length are skipped
    (the prefill kernel handles them). `kv_format`: `kv_cache` is that 8-bit format's layer.
    `variant`: see `AttentionVariant`; sinks have one entry per query head.
    """
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    cache = _paged_cache(kv_cache, kv_format)
    group = num_heads // cache.num_kv_heads
    extras = _variant_args(variant, query)
    span = decode_context_span(max_seq_len, extras.window if extras.sliding else None, tile_n)
    split_len = tile_n * max(1, -(-span // (tile_n * num_splits)))
    num_splits = max(1, min(num_splits, -(-span // split_len)))
    num_splits = _pow2(num_splits)
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out
    dim_pow2 = max(16, _pow2(head_dim))
    _paged_decode_kernel[(num_seqs, cache.num_kv_heads, num_splits)](
        out, partial_out, partial_lse,
        query, cache.values, cache.scales, cache.refs, extras.sinks, block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, split_len, extras.window, extras.softcap_log2,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *cache.value_strides, *cache.scale_strides, *cache.ref_strides,
        block_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        BLOCK_SIZE=cache.block_size, GROUP=group, GROUP_POW2=max(16, _pow2(group)),
        HEAD_DIM=head_dim, DIM_POW2=dim_pow2, TILE_N=tile_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(query.dtype), QUANT=cache.quant,
        **extras.switches(), num_warps=num_warps,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, extras.sinks, seq_lens, query_start_loc, split_len, extras.window,
            out.stride(0), out.stride(1),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            HEAD_DIM=head_dim, DIM_POW2=dim_pow2, NUM_SPLITS=num_splits,
            TILE_N=tile_n, SLIDING=extras.sliding, SINKS=extras.has_sinks, num_warps=1,
        )


def paged_prefill_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                            block_m: int, tile_n: int, skip_single_token: bool,
                            num_warps: int = 4, num_stages: int | None = None,
                            kv_format: KVQuantFormat | None = None,
                            variant: AttentionVariant | None = None) -> None:
    """Attention of the multi-token query chunks of the batch (each causal over its cached
    prefix and itself), written into `out` in place. With `skip_single_token`, sequences of
    query length 1 are left to `paged_decode_attention`. `kv_format`, `variant`: as there."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    cache = _paged_cache(kv_cache, kv_format)
    extras = _variant_args(variant, query)
    group = num_heads // cache.num_kv_heads
    group_pow2 = _pow2(group)
    block_q = max(1, block_m // group_pow2)
    group_pow2 = max(group_pow2, 16 // block_q)  # a dot needs at least 16 rows
    extra = {} if num_stages is None else {"num_stages": num_stages}
    grid = (num_seqs, -(-max_query_len // block_q), cache.num_kv_heads)
    _paged_prefill_kernel[grid](
        out, query, cache.values, cache.scales, cache.refs, extras.sinks, block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, extras.window, extras.softcap_log2,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *cache.value_strides, *cache.scale_strides, *cache.ref_strides,
        block_tables.stride(0),
        BLOCK_SIZE=cache.block_size, GROUP=group, GROUP_POW2=group_pow2,
        HEAD_DIM=head_dim, DIM_POW2=max(16, _pow2(head_dim)), BLOCK_Q=block_q, TILE_N=tile_n,
        SKIP_SINGLE_TOKEN=skip_single_token, DOT_PRECISION=_dot_precision(query.dtype), QUANT=cache.quant,
        **extras.switches(), num_warps=num_warps, **extra,
    )


def kernels_interpreted() -> bool:
    """True when these kernels were defined under TRITON_INTERPRET=1 (they then take CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_paged_decode_kernel, InterpretedFunction)
