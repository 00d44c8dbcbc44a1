"""Multi-head latent attention's two ways to attend (engine/model/mla.py): multi-token chunks
expanded (keys and values made from the cached latents), decodes absorbed (attention over the
latents themselves). Both compute the same attention; a batch that mixes them, with a chunk over a
cached prefix, gives what attending absorbed throughout gives."""
from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.arch import ModelArchConfig
from engine.model.decoder import TensorParallelShard
from engine.model.mla import LatentAttention
from tests.engine.tiny_models import family_config


def test_expanded_chunks_and_absorbed_decodes_attend_alike():
    torch.manual_seed(0)
    arch = ModelArchConfig.from_hf_config(family_config("deepseek-v3"))
    attention = LatentAttention(arch, 0, TensorParallelShard.of(arch))
    with torch.no_grad():
        for param in attention.parameters():
            param.normal_(0.0, 0.3)
    block_size, heads = 4, attention.num_heads
    cache = torch.randn(16, 2, block_size, 1, arch.head_dim)  # every slot holds some latent
    # a decode over 9 cached positions, a 5-token chunk after a 7-token prefix, a fresh 6-token chunk
    query_lens, seq_lens = [1, 5, 6], [10, 12, 6]
    tables = [[3, 0, 7], [1, 9, 4], [12, 2]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
    rows = sum(query_lens) + 2  # two rows of batch padding
    q_nope, q_rope = torch.randn(rows, heads, arch.qk_nope_head_dim), torch.randn(rows, heads, arch.qk_rope_head_dim)
    backend = TorchAttentionBackend()
    with torch.no_grad():
        mixed = attention._attend(q_nope, q_rope, cache, meta, backend)
        absorbed = attention._absorbed(q_nope, q_rope, cache, meta, backend)
    assert mixed.shape == (rows, heads, arch.v_head_dim)
    torch.testing.assert_close(mixed, absorbed, rtol=1e-5, atol=1e-5)
    assert not mixed[-2:].any() and mixed[:-2].abs().sum(dim=(1, 2)).min() > 0
