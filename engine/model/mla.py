"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the attention of a layer whose cache holds
one latent per token (engine/model/arch.py `ModelArchConfig.is_mla`).

Per token: `c_kv = kv_a_layernorm(kv_a_proj_with_mqa(h)[:kv_lora_rank])` and a rotated key part
`k_rope` shared by every head make the latent `[c_kv | k_rope]` that is cached. Head `i`'s key
would be `[W_UK_i c_kv | k_rope]` and its value `W_UV_i c_kv` (W_UK / W_UV: `kv_b_proj`'s rows of
that head); the up-projections are absorbed instead (as vLLM and SGLang decode): the query
becomes `[W_UK_iᵀ q_nope | q_rope]` and attends over the latents themselves
(engine/attention/latent.py), and W_UV turns the attended latent into the head's output, so a
step reads each cached token once. Prefill absorbs too (it could expand; not needed on CPU).

Tensor parallelism: query heads (q_b_proj / q_proj and kv_b_proj rows) split like any heads and
o_proj is row-parallel; the latent projection and its norm are replicated, so every rank holds
every token's latent (one KV "head" replicated, as engine/model/decoder.py does for GQA).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.latent import latent_halves
from engine.attention.metadata import AttentionMetadata
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
        up = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent_rank)
        query = torch.cat([torch.einsum("thn,hnl->thl", q_nope, up[:, :self.nope]), q_rope], dim=-1)
        attended = backend.latent_attention(query, kv_cache, meta, self.scale, self.latent_rank)
        out = torch.einsum("thl,hvl->thv", attended, up[:, self.nope:])
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.v_dim))
