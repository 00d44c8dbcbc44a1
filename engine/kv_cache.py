"""The paged KV cache tensors: one allocation, one view per layer.

Layout `[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`; layer `i`'s view is
`[num_blocks, 2, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V), so a (layer, block) pair is
one contiguous chunk (what kvtransfer moves) and the whole cache is one memory region (what a
transport registers once).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.arch import ModelArchConfig


@dataclass
class KVCache:
    data: torch.Tensor
    block_size: int

    @property
    def layers(self) -> list[torch.Tensor]:
        return list(self.data.unbind(0))

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[1])


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return arch.num_hidden_layers * 2 * block_size * arch.num_key_value_heads * arch.head_dim * itemsize


def num_blocks_for_memory(arch: ModelArchConfig, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
    blocks = memory_bytes // bytes_per_block(arch, block_size, dtype)
    if blocks < 2:
        raise ValueError(f"KV cache memory of {memory_bytes / 2**20:.1f} MiB holds fewer than 2 blocks of "
                         f"{block_size} tokens; raise kv_cache_memory_gb or set num_blocks")
    return int(blocks)


def allocate_kv_cache(arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> KVCache:
    shape = (arch.num_hidden_layers, num_blocks, 2, block_size, arch.num_key_value_heads, arch.head_dim)
    return KVCache(data=torch.zeros(shape, dtype=dtype, device=device), block_size=block_size)
