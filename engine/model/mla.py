"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the attention of a layer whose cache holds
one latent per token (engine/model/arch.py `ModelArchConfig.is_mla`).

Per token: `c_kv = kv_a_layernorm(kv_a_proj_with_mqa(h)[:kv_lora_rank])` and a rotated key part
`k_rope` shared by every head make the latent `[c_kv | k_rope]` that is cached. Head `i`'s key
would be `[W_UK_i c_kv | k_rope]` and its value `W_UV_i c_kv` (W_UK / W_UV: `kv_b_proj`'s rows of
that head); the up-projections are absorbed instead (as vLLM and SGLang decode): the query
becomes `[W_UK_iᵀ q_nope | q_rope]` and attends over the latents themselves
(engine/attention/latent.py), and W_UV turns the attended latent into the head's output, so a
step reads each cached token once. Multi-token chunks (prefill) expand instead: their keys and
values come from the latents through W_UK / W_UV, and they attend with the ordinary causal
attention over `qk_nope + qk_rope` dims, which for a chunk's many queries costs ~3x less.

Tensor parallelism: query heads (q_b_proj / q_proj and kv_b_proj rows) split like any heads and
o_proj is row-parallel; the latent projection and its norm are replicated, so every rank holds
every token's latent (one KV "head" replicated, as engine/model/decoder.py does for GQA).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.backend import host_lengths
from engine.attention.latent import gather_latents, latent_halves
from engine.attention.metadata import AttentionMetadata, put_rows, sub_batch, take_rows
from engine.attention.torch_backend import causal_attention
from engine.model.arch import ModelArchConfig
from engine.model.layers import Linear, RMSNorm, RowParallelLinear
from engine.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from engine.model.decoder import TensorParallelShard
    from engine.parallel import TensorParallelGroup


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary dims come in interleaved pairs (x0, x1), (x2, x3)...; as (evens | odds)
    the usual rotate-half RoPE rotates each pair, in the layout transformers leaves them in."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """Modules under their Hugging Face names: `q_a_proj`, `q_a_layernorm`, `q_b_proj` (or
    `q_proj` without `q_lora_rank`), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`."""

    def __init__(self, arch: ModelArchConfig, layer_index: int, shard: TensorParallelShard,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.local_rope = False  # one RoPE table for every layer (see Attention.local_rope)
        self.num_heads = shard.num_heads
        self.nope, self.rope, self.v_dim = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        self.latent_rank = arch.kv_lora_rank
        self.scale = arch.attention_scale or (self.nope + self.rope) ** -0.5
        self.interleaved = arch.rope_interleave
        q_width = self.num_heads * (self.nope + self.rope)
        if arch.q_lora_rank is None:
            self.q_proj = Linear(arch.hidden_size, q_width, bias=False)
        else:
            self.q_a_proj = Linear(arch.hidden_size, arch.q_lora_rank, bias=arch.attention_bias)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, arch.rms_norm_eps)
            self.q_b_proj = Linear(arch.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = Linear(arch.hidden_size, self.latent_rank + self.rope, bias=arch.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent_rank, arch.rms_norm_eps)
        self.kv_b_proj = Linear(self.latent_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, arch.hidden_size, arch.o_proj_bias, tp)
        self.has_q_lora = arch.q_lora_rank is not None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: torch.Tensor, meta: AttentionMetadata, backend, rows: torch.Tensor | None = None,
                rows_meta: AttentionMetadata | None = None) -> torch.Tensor:
        """As `engine.model.decoder.Attention.forward`; the backend's `latent_attention` attends."""
        num_tokens = hidden.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if self.has_q_lora else self.q_proj(hidden)
        q = q.view(num_tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.latent_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        k_rope = k_rope.reshape(num_tokens, 1, self.rope)
        q_rope = q_rope.contiguous()
        if self.interleaved:
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope, k_rope = rotary(positions, q_rope, k_rope)
        backend.store_kv(*latent_halves(torch.cat([c_kv, k_rope[:, 0]], dim=-1)), kv_cache, meta.slot_mapping)
        if rows is not None:
            q_nope, q_rope, meta = q_nope.index_select(0, rows), q_rope.index_select(0, rows), rows_meta
        out = self._attend(q_nope, q_rope, kv_cache, meta, backend)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.v_dim))

    def _attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend) -> torch.Tensor:
        """`[rows, heads, v_head_dim]`: decodes absorbed (the backend's latent attention reads each
        cached latent once); multi-token chunks expanded, as transformers computes them: their
        context's keys and values made from the latents (kv_b_proj), then causal attention of
        `qk_nope + qk_rope` dims per head and position instead of the absorbed `2 x kv_lora_rank +
        qk_rope` (DeepSeek-V3: 192 against 1088). An 8-bit cache attends absorbed throughout."""
        query_lens, seq_lens = host_lengths(meta)
        chunks = [s for s, length in enumerate(query_lens) if length > 1]
        if not chunks or kv_cache.dim() != 5:  # no chunk, or 8-bit blocks ([num_blocks, block_bytes])
            return self._absorbed(q_nope, q_rope, kv_cache, meta, backend)
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_dim)  # zeros: batch padding rows
        decodes = [s for s, length in enumerate(query_lens) if length == 1]
        if decodes:
            rows, sub = sub_batch(meta, query_lens, seq_lens, decodes)
            put_rows(out, rows, self._absorbed(take_rows(q_nope, rows), take_rows(q_rope, rows), kv_cache, sub, backend))
        block_size = kv_cache.shape[2]
        starts = [0]
        for length in query_lens:
            starts.append(starts[-1] + length)
        for s in chunks:
            start, end, seq_len = starts[s], starts[s + 1], seq_lens[s]
            c_kv, k_rope = gather_latents(kv_cache, meta.block_tables[s, :-(-seq_len // block_size)])[:seq_len].split(
                [self.latent_rank, self.rope], dim=-1)
            k_nope, values = torch.nn.functional.linear(c_kv, self.kv_b_proj.weight).view(
                seq_len, self.num_heads, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
            keys = torch.cat([k_nope, k_rope[:, None, :].expand(seq_len, self.num_heads, self.rope)], dim=-1)
            query = torch.cat([q_nope[start:end], q_rope[start:end]], dim=-1)
            out[start:end] = causal_attention(query, keys, values, self.scale)
        return out

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                  backend) -> torch.Tensor:
        up = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent_rank)
        query = torch.cat([torch.einsum("thn,hnl->thl", q_nope, up[:, :self.nope]), q_rope], dim=-1)
        attended = backend.latent_attention(query, kv_cache, meta, self.scale, self.latent_rank)
        return torch.einsum("thl,hvl->thv", attended, up[:, self.nope:])
