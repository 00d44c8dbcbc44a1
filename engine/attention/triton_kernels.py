"""Triton kernels for attention over the paged KV cache: decode (split-KV) and prefill.

Cache layout: `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (see `metadata.py`). The
kernels address every cached token through its sequence's block table, so a tile of `TILE_N`
tokens may span several blocks and any power-of-two block size works.

The 8-bit cache (engine/kv_quant.py, `[num_blocks, block_bytes]` bytes) goes through the same
attention kernels (`QUANT`: 0 none, 1 int8, 2 fp8 e4m3): its values are addressed like the cache
above (block stride `block_bytes`) and loaded as bytes. A K tile is dequantized in registers
(value * scale + the block's bf16 K reference row) before its dot with q; a V tile is converted
unscaled and its per-(block, head) scale goes on the softmax weights `p`. No dequantized copy of
the cache is made. fp8 e4m3 bits are decoded with integer ops (`_e4m3_as_fp16`), which run alike
on any GPU and in the interpreter (which has no fp8 arithmetic). The kernels that write the
cache, plain and 8-bit, are triton_store.py's; it and triton_latent.py share this module's cache
addressing (`_paged_cache`) and 8-bit decoding.

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

import torch
import triton
import triton.language as tl

from engine.attention.variant import AttentionVariant
from engine.kv_quant import KVQuantFormat

LOG2_E = 1.4426950408889634
_QUANT = {"int8": 1, "fp8_e4m3": 2}
_LOG2_E = tl.constexpr(LOG2_E)  # kernels may read only constexpr globals
_TWO_LOG2_E = tl.constexpr(2 * LOG2_E)


@triton.jit
def _e4m3_as_fp16(bits):
    """fp8 e4m3fn bits (uint8) -> the value / 256 as fp16, exact for every pattern but NaN (0x7F,
    0xFF read as +-480): e4m3's sign, exponent (bias 7) and mantissa moved into fp16's fields (bias
    15) are the value times 2^-8, fp16 subnormals covering e4m3's."""
    b = bits.to(tl.int32)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)


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
