"""Triton kernel for multi-head latent attention (DeepSeek's MLA) decode over the paged cache.

The cache and the query are engine/attention/latent.py's: a layer `[num_blocks, 2, block_size,
1, half]` whose token holds its latent `[c_kv (value_dim) | k_rope]` (2 * half values) as its K
half then its V half; a query `[tokens, heads, 2 * half]` (`[W_UK^T q_nope | q_rope]`). Scores
are query . latent * scale over the sequence's positions; the output `[tokens, heads, value_dim]`
is the softmax-weighted sum of the latents' first `value_dim` values (c_kv).

All query heads of a sequence read one latent stream (multi-query attention with one KV head), so
a program takes BLOCK_H heads of one sequence (one KV split) and loads each tile of TILE_N latents
once for all of them: scores `q [BLOCK_H, latent] @ latents^T [latent, TILE_N]`, then
`p [BLOCK_H, TILE_N] @ c_kv [TILE_N, value_dim]`. The latent is loaded as two tiles split where
the value ends rather than where the cache's halves meet: `c_kv` (value_dim wide, padded to a
power of two: 512 at DeepSeek-V3's sizes, exactly) and `k_rope` (the rest: 64 there), each
gathered from the K and V halves by two masked, contiguous loads (`_latent_slice`), so the
value tile is also the p @ V operand and no tile carries padding at DeepSeek's sizes. Softmax is
online, in fp32, in base 2; long contexts split into ranges of whole tiles whose normalized
partial results the paged decode's `_combine_splits_kernel` (triton_kernels.py) merges (its
layout: `[seqs, heads, splits, value_dim]` and a log2-sum-exp per split). Sequences whose query
length is not 1 are skipped on the device (the backend runs multi-token chunks in torch).

Tiles and warps (chosen from compiled sm_80 / sm_90 statistics with a launch's divisibility
hints, not from GPU timings): at DeepSeek-V3's sizes (16 heads, latent 576, value 512) the
compiler keeps 3 stages of the latent tiles in shared memory; 32 tokens per tile in 16-bit
dtypes take 122 KB per block (sm_80 allows 163 KB, sm_90 227 KB), 84 KB over an 8-bit cache; 16
tokens in float32 take 140 KB. 8 warps spread the `[16, 512]` fp32 accumulator: ~225 registers a
thread and no spills in 16-bit (8-bit: a few hundred bytes spilled; fp32's dots run on FMA units
and spill ~5 KB). `latent_tile_n`, `latent_num_warps`; tests/engine/triton_compile_check.py
records the launches and fails one past the shared memory.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_kernels import (LOG2_E, _combine_splits_kernel, _dot_precision, _paged_cache,
                                             _paged_tile_offsets, _pow2, _token_scales, _unscaled_8bit)
from engine.kv_quant import KVQuantFormat

BLOCK_H = 16  # query heads per program: a dot needs at least 16 rows; DeepSeek-V3 at TP 8 has 16 per GPU


def latent_tile_n(dtype: torch.dtype) -> int:
    """Cached latents per inner-loop step: 32 for 16-bit dtypes, 16 for float32 (shared memory)."""
    return 16 if dtype == torch.float32 else 32


def latent_num_warps(value_dim: int) -> int:
    """8 warps for a value as wide as DeepSeek's (512: its fp32 accumulator), 4 below 256."""
    return 8 if value_dim >= 256 else 4


def head_blocks(num_heads: int, block_h: int = BLOCK_H) -> int:
    """Programs per sequence and split: the query heads in blocks of `block_h`."""
    return -(-num_heads // block_h)


@triton.jit
def _latent_half(ptrs, mask, block_ids, token_mask, ref_dims, scales_ptr, refs_ptr, stride_scales_block,
                 stride_scales_kv, stride_refs_block, dtype: tl.constexpr, KV: tl.constexpr, QUANT: tl.constexpr):
    """Values of one cache half (`KV`: 0 the K half, 1 the V half) at `ptrs` as `dtype`; 8-bit:
    dequantized in registers (times the token's block scale for that half; the K half plus its
    block's K reference at `ref_dims`), in fp32 then rounded once, as `KVQuantFormat.dequantize`."""
    raw = tl.load(ptrs, mask=mask, other=0)
    if QUANT:
        scales = _token_scales(scales_ptr, block_ids, token_mask, KV * stride_scales_kv, stride_scales_block, QUANT)
        x = _unscaled_8bit(raw, tl.float32, QUANT) * scales[:, None]
        if KV == 0:
            refs = tl.load(refs_ptr + block_ids[:, None] * stride_refs_block + ref_dims[None, :], mask=mask, other=0.0)
            x = x + refs.to(tl.float32)
        tile = x.to(dtype)
    else:
        tile = raw
    return tile


@triton.jit
def _latent_slice(rows, token_mask, block_ids, scales_ptr, refs_ptr, stride_cache_kv, stride_scales_block,
                  stride_scales_kv, stride_refs_block, dtype: tl.constexpr, FIRST: tl.constexpr,
                  COUNT: tl.constexpr, WIDTH: tl.constexpr, HALF: tl.constexpr, QUANT: tl.constexpr):
    """Latent values [FIRST, FIRST + COUNT) of a tile of cached tokens as `[TILE_N, WIDTH]` in
    `dtype` (zeros past COUNT and for masked tokens); `rows` points at each token's K half, its V
    half is `stride_cache_kv` further and holds the values from HALF on. A slice across both
    halves is two masked loads, each contiguous along the values."""
    dims = tl.arange(0, WIDTH)
    mask = token_mask[:, None] & (dims < COUNT)[None, :]
    k_dims = FIRST + dims
    v_dims = FIRST - HALF + dims
    if FIRST + COUNT <= HALF:
        tile = _latent_half(rows[:, None] + k_dims[None, :], mask, block_ids, token_mask, k_dims, scales_ptr,
                            refs_ptr, stride_scales_block, stride_scales_kv, stride_refs_block, dtype, 0, QUANT)
    elif FIRST >= HALF:
        tile = _latent_half(rows[:, None] + stride_cache_kv + v_dims[None, :], mask, block_ids, token_mask, v_dims,
                            scales_ptr, refs_ptr, stride_scales_block, stride_scales_kv, stride_refs_block, dtype, 1,
                            QUANT)
    else:
        in_k = (k_dims < HALF)[None, :]
        from_k = _latent_half(rows[:, None] + k_dims[None, :], mask & in_k, block_ids, token_mask, k_dims,
                              scales_ptr, refs_ptr, stride_scales_block, stride_scales_kv, stride_refs_block, dtype,
                              0, QUANT)
        from_v = _latent_half(rows[:, None] + stride_cache_kv + v_dims[None, :], mask & ~in_k, block_ids,
                              token_mask, v_dims, scales_ptr, refs_ptr, stride_scales_block, stride_scales_kv,
                              stride_refs_block, dtype, 1, QUANT)
        tile = tl.where(in_k, from_k, from_v)
    return tile


@triton.jit
def _latent_decode_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr,
    query_ptr, cache_ptr, scales_ptr, refs_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2, split_len,
    stride_query_token, stride_query_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_kv, stride_cache_slot,
    stride_scales_block, stride_scales_kv, stride_refs_block,
    stride_block_tables_seq,
    stride_partial_out_seq, stride_partial_out_head, stride_partial_out_split,
    stride_partial_lse_seq, stride_partial_lse_head,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr,
    VALUE_DIM: tl.constexpr, VALUE_POW2: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_POW2: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    """Program (seq, head_block, split): the single query token of `seq`, query heads
    [head_block * BLOCK_H, + BLOCK_H), cached latents [split * split_len, (split + 1) * split_len).
    The query's first VALUE_DIM values meet the c_kv tile, the other ROPE_DIM the k_rope tile. With
    one split the result goes straight to `out`; otherwise a normalized partial result and its
    log2-sum-exp go to the partial buffers for `_combine_splits_kernel`. `QUANT` (0 none, 1 int8, 2
    fp8 e4m3): the cache is an 8-bit layer's values, dequantized tile by tile in registers (the
    same tile feeds both dots)."""
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if query_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_begin = split * split_len
    if kv_begin >= seq_len:
        return
    kv_end = tl.minimum(kv_begin + split_len, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < NUM_HEADS
    value_dims = tl.arange(0, VALUE_POW2)
    rope_dims = tl.arange(0, ROPE_POW2)
    token64 = query_start.to(tl.int64)
    q_rows = query_ptr + token64 * stride_query_token + heads[:, None] * stride_query_head
    q_value = tl.load(q_rows + value_dims[None, :], mask=head_mask[:, None] & (value_dims < VALUE_DIM)[None, :],
                      other=0.0)
    q_rope = tl.load(q_rows + VALUE_DIM + rope_dims[None, :],
                     mask=head_mask[:, None] & (rope_dims < ROPE_DIM)[None, :], other=0.0)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, VALUE_POW2], dtype=tl.float32)
    for tile_start in range(kv_begin, kv_end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        token_mask = tokens < kv_end
        block_ids, offsets = _paged_tile_offsets(block_table_row, tokens, token_mask, 0, stride_cache_block,
                                                 stride_cache_slot, 0, BLOCK_SIZE)
        rows = cache_ptr + offsets
        c_kv = _latent_slice(rows, token_mask, block_ids, scales_ptr, refs_ptr, stride_cache_kv, stride_scales_block,
                             stride_scales_kv, stride_refs_block, q_value.dtype, 0, VALUE_DIM, VALUE_POW2, HALF, QUANT)
        k_rope = _latent_slice(rows, token_mask, block_ids, scales_ptr, refs_ptr, stride_cache_kv, stride_scales_block,
                               stride_scales_kv, stride_refs_block, q_value.dtype, VALUE_DIM, ROPE_DIM, ROPE_POW2, HALF,
                               QUANT)
        scores = tl.dot(q_value, tl.trans(c_kv), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        scores = tl.where(token_mask[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision=DOT_PRECISION)
        m_i = m_new

    result = acc / l_i[:, None]
    store_mask = head_mask[:, None] & (value_dims < VALUE_DIM)[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + token64 * stride_out_token + heads[:, None] * stride_out_head + value_dims[None, :]
        tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        seq64 = seq.to(tl.int64)
        dst = (partial_out_ptr + seq64 * stride_partial_out_seq + heads[:, None] * stride_partial_out_head
               + split * stride_partial_out_split + value_dims[None, :])
        tl.store(dst, result, mask=store_mask)
        lse_dst = partial_lse_ptr + seq64 * stride_partial_lse_seq + heads * stride_partial_lse_head + split
        tl.store(lse_dst, m_i + tl.log2(l_i), mask=head_mask)


def check_latent_inputs(query: torch.Tensor, kv_cache: torch.Tensor, value_dim: int,
                        kv_format: KVQuantFormat | None = None) -> None:
    """Raise a ValueError naming what breaks latent.py's contract: query `[tokens, heads, 2 * half]`,
    a one-head cache `[num_blocks, 2, block_size, 1, half]` of the query's dtype (or, with
    `kv_format`, that one-head 8-bit format's layer), value_dim within the latent."""
    if query.dim() != 3:
        raise ValueError(f"query must be 3-D [tokens, heads, latent_dim], got {tuple(query.shape)}")
    if kv_format is not None:
        kv_format.split(kv_cache)  # checks the layer
        if kv_format.num_kv_heads != 1:
            raise ValueError(f"a latent cache has one KV head, the 8-bit format has {kv_format.num_kv_heads}")
        half = kv_format.head_dim
    else:
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[3] != 1:
            raise ValueError(f"a latent cache must be [num_blocks, 2, block_size, 1, half], got "
                             f"{tuple(kv_cache.shape)}")
        if kv_cache.dtype != query.dtype:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from query dtype {query.dtype}")
        if kv_cache.stride(-1) != 1:
            raise ValueError("kv_cache must be contiguous in its last dimension")
        half = kv_cache.shape[4]
    if 2 * half != query.shape[2]:
        raise ValueError(f"query's latent_dim {query.shape[2]} must be twice the cache's half {half}")
    if not 0 < value_dim < query.shape[2]:
        raise ValueError(f"value_dim must be in [1, {query.shape[2]}), got {value_dim}")


def latent_decode_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, value_dim: int, max_seq_len: int, num_splits: int,
                            kv_format: KVQuantFormat | None = None, tile_n: int | None = None,
                            block_h: int = BLOCK_H, num_warps: int | None = None,
                            num_stages: int | None = None) -> None:
    """Latent attention of every single-token sequence of the batch, written into `out`
    (`[tokens, heads, value_dim]`) in place; other sequences are skipped on the device.

    `max_seq_len`: the longest such sequence's context (host-side). Its context is cut into
    `num_splits` (a power of two) ranges of whole `tile_n` tiles (None: `latent_tile_n`); with
    more than one split, `_combine_splits_kernel` merges the partial results. `kv_format`:
    `kv_cache` is that (one-head) 8-bit format's layer. `num_warps` None: `latent_num_warps`."""
    check_latent_inputs(query, kv_cache, value_dim, kv_format)
    query = query if query.stride(-1) == 1 else query.contiguous()
    cache = _paged_cache(kv_cache, kv_format)
    num_seqs = seq_lens.shape[0]
    _, num_heads, latent_dim = query.shape
    rope_dim = latent_dim - value_dim
    tile_n = tile_n or latent_tile_n(query.dtype)
    split_len = tile_n * max(1, -(-max_seq_len // (tile_n * num_splits)))
    num_splits = _pow2(max(1, min(num_splits, -(-max_seq_len // split_len))))
    value_pow2 = max(16, _pow2(value_dim))
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, value_dim, dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _latent_decode_kernel[(num_seqs, head_blocks(num_heads, block_h), num_splits)](
        out, partial_out, partial_lse,
        query, cache.values, cache.scales, cache.refs, block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, split_len,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *cache.value_strides[:3], *cache.scale_strides, cache.ref_strides[0],
        block_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        NUM_HEADS=num_heads, BLOCK_H=block_h, BLOCK_SIZE=cache.block_size, HALF=latent_dim // 2,
        VALUE_DIM=value_dim, VALUE_POW2=value_pow2, ROPE_DIM=rope_dim, ROPE_POW2=max(16, _pow2(rope_dim)),
        TILE_N=tile_n, NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(query.dtype), QUANT=cache.quant,
        num_warps=num_warps or latent_num_warps(value_dim), **extra,
    )
    if num_splits > 1:
        # the paged decode's merge: no sliding window, no sinks (`sinks_ptr` unread)
        _combine_splits_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, partial_lse, seq_lens, query_start_loc, split_len, 0,
            out.stride(0), out.stride(1),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            HEAD_DIM=value_dim, DIM_POW2=value_pow2, NUM_SPLITS=num_splits,
            TILE_N=tile_n, SLIDING=False, SINKS=False, num_warps=4 if value_pow2 >= 256 else 1,
        )


def dequantized_batch(kv_cache: torch.Tensor, kv_format: KVQuantFormat, meta: AttentionMetadata,
                      dtype: torch.dtype) -> tuple[torch.Tensor, AttentionMetadata]:
    """The blocks `meta`'s sequences read, dequantized into a float cache of their own (one copy per
    table entry: no device sync to deduplicate them), and `meta` over it."""
    width = max(1, -(-meta.max_seq_len // kv_format.block_size))
    tables = meta.block_tables[:, :width]
    dense = kv_format.dequantize(kv_cache, tables.reshape(-1), dtype)
    local = torch.arange(tables.numel(), dtype=torch.int32, device=tables.device).view(tables.shape)
    return dense, dataclasses.replace(meta, block_tables=local)
