"""The attention-backend interface and the factory that picks one by name.

The model calls `backend.forward(...)` once per layer per forward pass. Importing this module
never imports Triton: the Triton backend is loaded only when it is asked for by name.
"""
from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.variant import AttentionVariant
from engine.config import BACKEND_NAMES
from engine.kv_quant import KVQuantFormat


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged attention over a flattened batch of sequences.

    `forward` first stores `key`/`value` (the new tokens only) into `kv_cache` at
    `meta.slot_mapping` (slot -1: not stored), then computes attention: query token `i` of
    sequence `s` attends causally to that sequence's whole context, i.e. the cached prefix plus
    the new tokens up to and including itself (see `AttentionMetadata`). GQA: query head `h`
    reads KV head `h // (num_heads // num_kv_heads)`.

    Shapes: query `[num_tokens, num_heads, head_dim]`; key, value
    `[num_tokens, num_kv_heads, head_dim]`; kv_cache
    `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (8-bit: its format's
    `[num_blocks, block_bytes]` bytes, engine/kv_quant.py); result like `query`. Rows of
    `query` past `meta.query_start_loc[-1]` (batch padding) come back as zeros.

    `variant` (engine/attention/variant.py): the layer's sliding window, logit soft-cap and
    attention sinks; None is plain causal attention. A backend that cannot run a variant raises
    ValueError saying which backend can.
    """

    name: str

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                variant: AttentionVariant | None = None) -> torch.Tensor:
        ...

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Only the store half of `forward`: `key[t]`/`value[t]` into slot `slot_mapping[t]`."""
        ...

    def latent_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, value_dim: int) -> torch.Tensor:
        """Multi-head latent attention (DeepSeek's MLA) of `query` `[tokens, heads, latent_dim]`
        over each sequence's cached latents, which the caller has stored; `[tokens, heads,
        value_dim]`. engine/attention/latent.py holds the cache's encoding and the torch
        reference (`latent_attention`) every backend's kernels are tested against."""
        ...


def get_attention_backend(name: str, kv_format: KVQuantFormat | None = None) -> AttentionBackend:
    """Return a fresh backend: "cpu" (CPU default: torch plus a native decode kernel), "torch"
    (plain torch on any device; the reference) or "triton" (CUDA default). `kv_format`: the
    8-bit KV cache format (engine/kv_quant.py), None for a cache in the model's dtype.

    On a machine without CUDA, asking for "triton" turns on Triton's interpreter
    (`TRITON_INTERPRET=1`, unless already set) before the kernels are defined, so the same
    kernels run, slowly, on CPU tensors.
    """
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(kv_format)
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend(kv_format)
    if name == "triton":
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from engine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(kv_format=kv_format)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def default_backend_name(device: str | torch.device) -> str:
    """The backend an engine uses when configured with "auto": triton on CUDA (an 8-bit KV cache
    too: the Triton kernels read it in place), cpu elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "cpu"


def host_lengths(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """Per-sequence query lengths and context lengths as Python lists.

    Uses the host copies in `meta` when present, so planning a batch costs no device sync.
    """
    query_lens = meta.query_lens_cpu
    if query_lens is None:
        query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
    seq_lens = meta.seq_lens_cpu
    if seq_lens is None:
        seq_lens = meta.seq_lens.tolist()
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"metadata describes {len(query_lens)} query lengths but "
                         f"{len(seq_lens)} sequence lengths")
    return query_lens, seq_lens


def check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Raise a ValueError naming the mismatch when the inputs break the interface's shapes."""
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"query/key/value must be 3-D [tokens, heads, head_dim], got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    _, _, _, num_kv_heads, cache_head_dim = kv_cache.shape
    if key.shape != value.shape or key.shape[0] != num_tokens:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                         f"[{num_tokens}, num_kv_heads, head_dim] to match query {tuple(query.shape)}")
    if key.shape[1] != num_kv_heads or key.shape[2] != head_dim or cache_head_dim != head_dim:
        raise ValueError(f"key {tuple(key.shape)} and kv_cache {tuple(kv_cache.shape)} disagree "
                         f"with query {tuple(query.shape)} on num_kv_heads/head_dim")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if meta.slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for "
                         f"{num_tokens} tokens")
