"""Triton kernels for the paged KV cache: store-KV, decode attention (split-KV) and prefill attention.

Cache layout: `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (see `metadata.py`). The
kernels address every cached token through its sequence's block table, so a tile of `TILE_N`
tokens may span several blocks and any power-of-two block size works.

GQA: one program handles one KV head and all `GROUP = num_heads // num_kv_heads` query heads
that read it, so each K/V tile is loaded once per program and feeds a `[rows, TILE_N]` dot.
Softmax is online, in fp32, in base 2 (`scale_log2 = scale * log2(e)`).

Importing this module defines the kernels, so `TRITON_INTERPRET=1` must be set before it is
imported for them to run on CPU (`get_attention_backend("triton")` does that without CUDA).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


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
def _paged_tile_offsets(block_table_row_ptr, tokens, token_mask, kv_head,
                        stride_cache_block, stride_cache_slot, stride_cache_head,
                        BLOCK_SIZE: tl.constexpr):
    """Element offsets (int64) of cached tokens `tokens` of one sequence, for one KV head."""
    block_ids = tl.load(block_table_row_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    return block_ids * stride_cache_block + (tokens % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head


@triton.jit
def _paged_decode_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr,
    query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2, split_len,
    stride_query_token, stride_query_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    stride_block_tables_seq,
    stride_partial_out_seq, stride_partial_out_head, stride_partial_out_split,
    stride_partial_lse_seq, stride_partial_lse_head,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_POW2: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (seq, kv_head, split): the single query token of `seq`, the GROUP query heads of
    `kv_head`, context tokens [split * split_len, (split + 1) * split_len). With one split the
    result goes straight to `out`; otherwise a normalized partial result and its log2-sum-exp
    go to the partial buffers for `_combine_splits_kernel`. Sequences whose query length is not
    1 are left to the prefill kernel."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
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
        offsets = _paged_tile_offsets(block_table_row, tokens, token_mask, kv_head, stride_cache_block,
                                      stride_cache_slot, stride_cache_head, BLOCK_SIZE)
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_cache_kv + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

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
    out_ptr, partial_out_ptr, partial_lse_ptr, seq_lens_ptr, query_start_ptr, split_len,
    stride_out_token, stride_out_head,
    stride_partial_out_seq, stride_partial_out_head, stride_partial_out_split,
    stride_partial_lse_seq, stride_partial_lse_head,
    HEAD_DIM: tl.constexpr, DIM_POW2: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Program (seq, head): merge the non-empty splits of a decode sequence, weighted by exp2(lse)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if query_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = tl.cdiv(seq_len, split_len)
    splits = tl.arange(0, NUM_SPLITS)
    split_mask = splits < num_used
    dims = tl.arange(0, DIM_POW2)
    dim_mask = dims < HEAD_DIM
    seq64 = seq.to(tl.int64)
    lse = tl.load(partial_lse_ptr + seq64 * stride_partial_lse_seq + head * stride_partial_lse_head + splits,
                  mask=split_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = tl.where(split_mask, weights, 0.0)
    parts = tl.load(partial_out_ptr + seq64 * stride_partial_out_seq + head * stride_partial_out_head
                    + splits[:, None] * stride_partial_out_split + dims[None, :],
                    mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    result = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    dst = out_ptr + query_start.to(tl.int64) * stride_out_token + head * stride_out_head + dims
    tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=dim_mask)


@triton.jit
def _paged_prefill_kernel(
    out_ptr, query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2,
    stride_query_token, stride_query_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    stride_block_tables_seq,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_POW2: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    SKIP_SINGLE_TOKEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (seq, query_tile, kv_head): BLOCK_Q query tokens of `seq` times the GROUP query
    heads of `kv_head` form the BLOCK_Q * GROUP_POW2 rows of one tile; row r is query token
    r // GROUP_POW2 of the tile and head-in-group r % GROUP_POW2. Query token i of the chunk sits
    at position context_len + i and attends to cached positions 0 ..= that position."""
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
    for tile_start in range(0, kv_end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        token_mask = tokens < kv_end
        offsets = _paged_tile_offsets(block_table_row, tokens, token_mask, kv_head, stride_cache_block,
                                      stride_cache_slot, stride_cache_head, BLOCK_SIZE)
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = token_mask[None, :] & (tokens[None, :] <= query_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_cache_kv + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

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


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float, max_seq_len: int,
                           num_splits: int, tile_n: int, num_warps: int = 4) -> None:
    """Attention of every single-token sequence of the batch, written into `out` in place.

    The context is cut into `num_splits` (a power of two) ranges of whole `tile_n` tiles; with
    more than one split, a second kernel merges the partial results. Sequences with another
    query length are skipped (the prefill kernel handles them).
    """
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    split_len = tile_n * max(1, -(-max_seq_len // (tile_n * num_splits)))
    num_splits = max(1, min(num_splits, -(-max_seq_len // split_len)))
    num_splits = _pow2(num_splits)
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out
    dim_pow2 = max(16, _pow2(head_dim))
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, partial_out, partial_lse,
        query, kv_cache, block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, split_len,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_POW2=max(16, _pow2(group)),
        HEAD_DIM=head_dim, DIM_POW2=dim_pow2, TILE_N=tile_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(query.dtype), num_warps=num_warps,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, seq_lens, query_start_loc, split_len,
            out.stride(0), out.stride(1),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            HEAD_DIM=head_dim, DIM_POW2=dim_pow2, NUM_SPLITS=num_splits, num_warps=1,
        )


def paged_prefill_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                            block_m: int, tile_n: int, skip_single_token: bool,
                            num_warps: int = 4, num_stages: int | None = None) -> None:
    """Attention of the multi-token query chunks of the batch (each causal over its cached
    prefix and itself), written into `out` in place. With `skip_single_token`, sequences of
    query length 1 are left to `paged_decode_attention`."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    group_pow2 = _pow2(group)
    block_q = max(1, block_m // group_pow2)
    group_pow2 = max(group_pow2, 16 // block_q)  # a dot needs at least 16 rows
    extra = {} if num_stages is None else {"num_stages": num_stages}
    grid = (num_seqs, -(-max_query_len // block_q), num_kv_heads)
    _paged_prefill_kernel[grid](
        out, query, kv_cache, block_tables, seq_lens, query_start_loc,
        scale * LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_POW2=group_pow2,
        HEAD_DIM=head_dim, DIM_POW2=max(16, _pow2(head_dim)), BLOCK_Q=block_q, TILE_N=tile_n,
        SKIP_SINGLE_TOKEN=skip_single_token, DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=num_warps, **extra,
    )


def kernels_interpreted() -> bool:
    """True when these kernels were defined under TRITON_INTERPRET=1 (they then take CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_paged_decode_kernel, InterpretedFunction)
