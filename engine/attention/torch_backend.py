"""Attention in plain torch on any device: the reference the Triton kernels are tested against, and
the paths the "cpu" backend (the CPU default, `backend.default_backend_name`) takes where its
native kernels do not apply or could not be built.

Vectorized where it counts on CPU: all single-token queries (decodes) of a batch are attended
in one `scaled_dot_product_attention` call over K/V gathered through their block tables; only
multi-token prefill chunks take a Python loop, one sequence at a time.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.attention.backend import check_shapes, host_lengths
from engine.attention.latent import latent_attention
from engine.attention.metadata import AttentionMetadata
from engine.attention.paged import gather_kv, sequence_kv, store_kv
from engine.attention.variant import AttentionVariant, is_plain
from engine.kv_quant import KVQuantFormat


class TorchAttentionBackend:
    """`AttentionBackend` in torch; works on any device and dtype torch supports.

    With an 8-bit KV cache (`kv_format`, engine/kv_quant.py) each layer's cache is that format's
    `[num_blocks, block_bytes]` bytes: the new keys and values are quantized into it, then the
    blocks the batch reads are dequantized into a dense float cache and attended over as usual
    (the new tokens too, so a prompt attends to exactly what a later step or a prefix-cache hit
    will read). This is the reference the 8-bit kernels are tested against."""

    name = "torch"

    def __init__(self, kv_format: KVQuantFormat | None = None) -> None:
        self.kv_format = kv_format
        self._plan_meta: AttentionMetadata | None = None  # 8-bit: the metadata `_plan` is for
        self._plan: tuple = ()

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if self.kv_format is not None:
            return self.kv_format.store(key, value, kv_cache, slot_mapping)
        store_kv(key, value, kv_cache, slot_mapping)

    def latent_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, value_dim: int) -> torch.Tensor:
        if self.kv_format is not None:  # over a float copy of the blocks the batch reads
            used, meta, _, _ = self._dense_plan(meta)
            kv_cache = self.kv_format.dequantize(kv_cache, used, query.dtype)
        return latent_attention(query, kv_cache, meta, scale, value_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                variant: AttentionVariant | None = None) -> torch.Tensor:
        if self.kv_format is not None:
            return self._forward_8bit(query, key, value, kv_cache, meta, scale, variant)
        check_shapes(query, key, value, kv_cache, meta)
        self.store_kv(key, value, kv_cache, meta.slot_mapping)
        return self._attend(query, key, value, kv_cache, meta, scale, variant)

    def _forward_8bit(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      variant: AttentionVariant | None = None) -> torch.Tensor:
        fmt = self.kv_format
        self.store_kv(key, value, kv_cache, meta.slot_mapping)
        used, dense_meta, dense_slots, skipped = self._dense_plan(meta)
        dense = fmt.dequantize(kv_cache, used, query.dtype)  # [used, 2, block_size, heads, dim]
        # the new tokens' keys and values as stored (slot -1, batch padding: zeros)
        stored_key = dense[:, 0].reshape(-1, fmt.num_kv_heads, fmt.head_dim).index_select(0, dense_slots)
        stored_value = dense[:, 1].reshape(-1, fmt.num_kv_heads, fmt.head_dim).index_select(0, dense_slots)
        stored_key = stored_key.masked_fill(skipped, 0)
        stored_value = stored_value.masked_fill(skipped, 0)
        check_shapes(query, stored_key, stored_value, dense, dense_meta)
        return self._attend(query, stored_key, stored_value, dense, dense_meta, scale, variant)

    def _dense_plan(self, meta: AttentionMetadata):
        """The blocks the batch reads (sorted), its metadata over the dense copy of them, and its
        new tokens' slots there (with the skipped ones). The same for every layer of a forward
        pass, so computed once per metadata."""
        if self._plan_meta is meta:
            return self._plan
        block_size = self.kv_format.block_size
        _, seq_lens = host_lengths(meta)
        width = max(1, -(-max(seq_lens, default=1) // block_size))
        used, local_tables = torch.unique(meta.block_tables[:len(seq_lens), :width].to(torch.int64),
                                          return_inverse=True)
        slots = meta.slot_mapping.to(torch.int64)
        position = torch.searchsorted(used, slots.clamp(min=0) // block_size)
        dense_slots = position.clamp(max=used.numel() - 1) * block_size + slots.clamp(min=0) % block_size
        self._plan_meta = meta
        self._plan = (used, dataclasses.replace(meta, block_tables=local_tables.to(torch.int32)), dense_slots,
                      (slots < 0)[:, None, None])
        return self._plan

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                variant: AttentionVariant | None = None) -> torch.Tensor:
        """Attention over a cache that already holds the new keys and values."""
        query_lens, seq_lens = host_lengths(meta)
        num_tokens = query.shape[0]
        num_seqs = len(query_lens)
        batch_tokens = sum(query_lens)
        if batch_tokens > num_tokens:
            raise ValueError(f"metadata covers {batch_tokens} query tokens but query has {num_tokens}")

        decode_seqs = [s for s in range(num_seqs) if query_lens[s] == 1]
        if len(decode_seqs) == num_seqs == num_tokens:
            return self._decode(query, kv_cache, meta.block_tables, meta.seq_lens, seq_lens, scale, variant)

        out = query.new_zeros(query.shape) if batch_tokens < num_tokens else torch.empty_like(query)
        starts = [0] * (num_seqs + 1)
        for s in range(num_seqs):
            starts[s + 1] = starts[s] + query_lens[s]
        if decode_seqs:
            seq_index = torch.tensor(decode_seqs, device=query.device)
            token_index = torch.tensor([starts[s] for s in decode_seqs], device=query.device)
            out[token_index] = self._decode(
                query.index_select(0, token_index), kv_cache,
                meta.block_tables.index_select(0, seq_index), meta.seq_lens.index_select(0, seq_index),
                [seq_lens[s] for s in decode_seqs], scale, variant)
        for s in range(num_seqs):
            if query_lens[s] > 1:
                start, end = starts[s], starts[s + 1]
                out[start:end] = self._prefill(query[start:end], key[start:end], value[start:end],
                                               kv_cache, meta.block_tables[s], seq_lens[s], scale, variant)
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, seq_lens_host: list[int], scale: float,
                variant: AttentionVariant | None = None) -> torch.Tensor:
        """One query token per sequence, all sequences in one padded, masked SDPA call."""
        num_seqs, num_heads, head_dim = query.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        max_len = max(seq_lens_host)
        num_blocks = -(-max_len // block_size)
        keys, values = gather_kv(kv_cache, block_tables[:, :num_blocks])
        padded_len = num_blocks * block_size
        mask = None
        window = None if variant is None else variant.sliding_window
        if min(seq_lens_host) < padded_len or (window is not None and window < max_len):
            positions = torch.arange(padded_len, device=query.device)
            lens = seq_lens[:, None].to(positions.device)
            visible = positions[None, :] < lens
            if window is not None:
                visible &= positions[None, :] >= lens - window
            mask = visible[:, None, None, :]
        grouped_query = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if is_plain(variant) or (variant.softcap is None and variant.sinks is None):
            out = F.scaled_dot_product_attention(grouped_query, keys.transpose(1, 2),
                                                 values.transpose(1, 2), attn_mask=mask, scale=scale)
        else:  # heads as [kv head, group], the query rows a length-1 axis
            out = explicit_attention(grouped_query.reshape(num_seqs, num_heads, 1, head_dim),
                                     keys.transpose(1, 2), values.transpose(1, 2),
                                     mask, scale, variant)
        return out.reshape(num_seqs, num_heads, head_dim)

    @staticmethod
    def _prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                 scale: float, variant: AttentionVariant | None = None) -> torch.Tensor:
        """A chunk of `query_len` tokens of one sequence: causal over its cached prefix + itself."""
        if seq_len == query.shape[0]:  # no cached prefix: this chunk's own K/V
            return causal_attention(query, key, value, scale, variant)
        keys, values = sequence_kv(kv_cache, block_table, seq_len)
        return causal_attention(query, keys, values, scale, variant)


def explicit_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, variant: AttentionVariant) -> torch.Tensor:
    """Attention with every `AttentionVariant` step written out, as transformers' eager attention
    computes it (scores in the inputs' dtype, soft-cap, mask, sinks, softmax in float32).

    query `[B, Hq, Tq, D]`, keys / values `[B, Hk, Tk, D]` (GQA: query head h reads KV head
    h // (Hq / Hk)), mask `[B, 1, Tq, Tk]` bool (True: visible) or None; result `[B, Hq, Tq, D]`."""
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if variant.sinks is not None:
        sinks = variant.sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(values.dtype), values)


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     variant: AttentionVariant | None = None) -> torch.Tensor:
    """The last `query_len` positions of a sequence whose K/V are `keys`/`values` ([seq_len,
    heads, dim]) attend causally to it; GQA by head groups."""
    query_len, seq_len = query.shape[0], keys.shape[0]
    context_len = seq_len - query_len
    if not is_plain(variant):
        return _variant_causal_attention(query, keys, values, scale, variant)
    # Inputs are 4-D ([1, heads, tokens, dim]): torch's CPU flash-attention kernel (which
    # supports GQA) takes only 4-D inputs; 3-D ones fall back to the far slower math path.
    if context_len == 0:
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    key_positions = torch.arange(seq_len, device=query.device)
    query_positions = torch.arange(context_len, seq_len, device=query.device)
    mask = key_positions[None, :] <= query_positions[:, None]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _variant_causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                              variant: AttentionVariant) -> torch.Tensor:
    """`causal_attention` with a sliding window, soft-cap or sinks (`AttentionVariant`)."""
    query_len, seq_len = query.shape[0], keys.shape[0]
    key_positions = torch.arange(seq_len, device=query.device)
    query_positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
    mask = key_positions[None, :] <= query_positions[:, None]
    if variant.sliding_window is not None:
        mask &= key_positions[None, :] > query_positions[:, None] - variant.sliding_window
    q, k, v = (x.transpose(0, 1)[None] for x in (query, keys, values))
    if variant.softcap is None and variant.sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        out = explicit_attention(q, k, v, mask[None, None], scale, variant)
    return out[0].transpose(0, 1)
