"""Random batches for the latent-attention kernels' tests (tests/engine/test_latent_cpu_kernel.py,
test_triton_latent.py): a paged latent cache (engine/attention/latent.py's encoding) and queries."""
from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata

TINY = (32, 8)  # (value_dim = kv_lora_rank, rotated dims): the tiny DeepSeek models' latent of 40
PADDING = 2  # query rows past the batch


def make_batch(query_lens: list[int], seq_lens: list[int], heads: int, dims: tuple[int, int] = TINY,
               block_size: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32, padding: int = PADDING):
    """(query, cache, metadata, value_dim): shuffled block ids, spare blocks, a random cache (the
    new tokens' latents already in it, as the model stores them before attending)."""
    value_dim, rope = dims
    half = (value_dim + rope) // 2
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(needed) + 3, generator=generator).tolist()
    tables = [order[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(needed))]
    cache = torch.randn(sum(needed) + 3, 2, block_size, 1, half, generator=generator).to(dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
    query = torch.randn(sum(query_lens) + padding, heads, 2 * half, generator=generator).to(dtype)
    return query, cache, meta, value_dim


def make_8bit_batch(fmt_name: str, query_lens: list[int], seq_lens: list[int], half: int, heads: int = 5,
                    block_size: int = 8, seed: int = 5):
    """(query, layer, metadata, format): an 8-bit latent cache (engine/kv_quant.py, one KV head of
    `half` values) holding every position's random latent, over shuffled block ids."""
    from engine.kv_quant import KVQuantFormat

    fmt = KVQuantFormat(fmt_name, block_size, 1, half)
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(needed) + 2, generator=generator).tolist()
    tables = [order[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(needed))]
    layer = torch.zeros(sum(needed) + 2, fmt.block_bytes, dtype=torch.uint8)
    every = AttentionMetadata.build(seq_lens, seq_lens, tables, block_size, "cpu")
    latents = torch.randn(sum(seq_lens), 1, 2 * half, generator=generator)
    fmt.store(latents[..., :half], latents[..., half:], layer, every.slot_mapping)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
    query = torch.randn(sum(query_lens) + PADDING, heads, 2 * half, generator=generator)
    return query, layer, meta, fmt
