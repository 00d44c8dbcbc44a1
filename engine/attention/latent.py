"""Multi-head latent attention (DeepSeek's MLA) over the paged cache, in torch, with the
up-projections absorbed: every query head attends over the cached latents themselves, so a
step reads each token's latent once, not a key and a value per head.

The cache is the ordinary `[num_blocks, 2, block_size, 1, head_dim]` layer of a one-KV-head model
(engine/model/arch.py `ModelArchConfig.is_mla`): a token's latent `[c_kv (value_dim) | k_rope]`
is its K half then its V half, so `store_latent` and `gather_latents` split and join it. Keys
are whole latents; values are their first `value_dim` (c_kv) dims. The query, `[tokens, heads,
latent]`, is `[q_nope @ W_UK | q_rope]` per head, and the result `[tokens, heads, value_dim]` is
still to be multiplied by W_UV (engine/model/mla.py). `latent_attention` is the torch reference
behind every backend's `AttentionBackend.latent_attention` (engine/attention/backend.py); it runs
on every device.
"""
from __future__ import annotations

import torch

from engine.attention.backend import host_lengths
from engine.attention.metadata import AttentionMetadata
from engine.attention.paged import gather_kv, store_kv


def latent_halves(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`latent` (`[tokens, latent_dim]`) as the (K, V) pair a backend's `store_kv` writes:
    `[tokens, 1, latent_dim / 2]` each."""
    half = latent.shape[-1] // 2
    return latent[:, None, :half], latent[:, None, half:]


def store_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`latent[t]` (`[tokens, latent_dim]`) into slot `slot_mapping[t]` (-1: skipped) of a cache
    in a float dtype."""
    store_kv(*latent_halves(latent), kv_cache, slot_mapping)


def gather_latents(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The latents of the blocks `block_ids` (`[*B, n]`) as `[*B, n * block_size, latent_dim]`."""
    k_half, v_half = gather_kv(kv_cache, block_ids)
    return torch.cat([k_half[..., 0, :], v_half[..., 0, :]], dim=-1)


def latent_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     value_dim: int) -> torch.Tensor:
    """Causal attention of `query` (`[tokens, heads, latent_dim]`, the cache already holding the
    new tokens' latents) over each sequence's latents; `[tokens, heads, value_dim]`, zeros for
    rows past the batch (padding). Decodes go together in one padded, masked product; each
    multi-token chunk on its own."""
    query_lens, seq_lens = host_lengths(meta)
    num_tokens, num_heads, _ = query.shape
    out = query.new_zeros(num_tokens, num_heads, value_dim)
    block_size = kv_cache.shape[2]
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    decodes = [s for s, length in enumerate(query_lens) if length == 1]
    if decodes:
        rows = torch.tensor([starts[s] for s in decodes], device=query.device)
        seqs = torch.tensor(decodes, device=query.device)
        width = -(-max(seq_lens[s] for s in decodes) // block_size)
        latents = gather_latents(kv_cache, meta.block_tables.index_select(0, seqs)[:, :width])  # [S, P, D]
        scores = torch.einsum("shd,spd->shp", query.index_select(0, rows), latents) * scale
        lens = meta.seq_lens.index_select(0, seqs).to(device=query.device, dtype=torch.int64)
        hidden = torch.arange(latents.shape[1], device=query.device)[None, :] >= lens[:, None]
        probs = torch.softmax(scores.float().masked_fill(hidden[:, None, :], float("-inf")), dim=-1)
        out[rows] = torch.einsum("shp,spl->shl", probs.to(query.dtype), latents[..., :value_dim])
    for s, length in enumerate(query_lens):
        if length <= 1:
            continue
        seq_len, start = seq_lens[s], starts[s]
        blocks = meta.block_tables[s, : -(-seq_len // block_size)]
        latents = gather_latents(kv_cache, blocks)[:seq_len]  # [P, D]
        scores = torch.einsum("qhd,pd->hqp", query[start:start + length], latents) * scale
        # query i sits at position seq_len - length + i and sees the positions up to its own
        positions = torch.arange(seq_len, device=query.device)
        own = torch.arange(seq_len - length, seq_len, device=query.device)
        probs = torch.softmax(scores.float().masked_fill(positions[None, :] > own[:, None], float("-inf")), dim=-1)
        out[start:start + length] = torch.einsum("hqp,pl->qhl", probs.to(query.dtype), latents[:, :value_dim])
    return out
