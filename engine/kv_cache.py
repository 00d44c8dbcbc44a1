"""The paged KV cache tensors: one allocation, one view per layer.

Layout `[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`; layer `i`'s view is
`[num_blocks, 2, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V), so a (layer, block) pair is
one contiguous chunk (what kvtransfer moves) and the whole cache is one memory region (what a
transport registers once).

With tensor parallelism each rank's cache holds only that rank's KV heads: callers pass
`num_kv_heads` (the model's `shard.num_kv_heads`); the default is all of the model's.

An 8-bit cache (`kv_format`, engine/kv_quant.py) is `[num_layers, num_blocks, block_bytes]`
uint8: each (layer, block) chunk holds its 8-bit values and their scales, still one contiguous
chunk per pair and one region for the whole cache.

Each layer's kind: `layer_windows[i]` is layer i's sliding window in tokens (0: it attends to
every position; `()`: every layer does). A sliding layer never reads a block again once it is
behind the window of the next token (`window_skip_blocks`): a P->D transfer leaves those blocks
out for that layer (their bytes on the decode side are stale and never read).

A grouped cache (`groups`, engine/kv_groups.py) is `[layers per group, num_blocks, ...]`: layer i's
view is `data[groups.layer_slot[i]]`, and each group's layers use the blocks of their group's
tables, so a block holds one group's layers; the views of layers in the same slot alias.
"""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.huge_pages import advise_huge_pages
from engine.kv_groups import KVGroups
from engine.kv_quant import KVQuantFormat
from engine.model.arch import ModelArchConfig


@dataclass
class KVCache:
    data: torch.Tensor
    block_size: int
    # Shared allocation only: the memfd holding `data` (mapped at data.data_ptr()) and its
    # mapping, kept alive with the cache. A same-host KV sender hands the fd to its receivers.
    memory_fd: int | None = None
    _mapping: object = None
    kv_format: KVQuantFormat | None = None  # 8-bit: the block layout; None: values in data.dtype
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window (0 = full); () = all full
    groups: KVGroups | None = None  # grouped: each layer's slot; None: data's first dim is the layer

    @property
    def layers(self) -> list[torch.Tensor]:
        """Each layer's view of the cache."""
        slots = self.data.unbind(0)
        return list(slots) if self.groups is None else [slots[s] for s in self.groups.layer_slot]

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[1])


def layer_windows(arch: ModelArchConfig) -> tuple[int, ...]:
    """Each layer's sliding window in tokens, 0 for full attention; () when no layer slides."""
    windows = tuple(arch.sliding_window if arch.is_sliding(layer) else 0 for layer in range(arch.num_hidden_layers))
    return windows if any(windows) else ()


def window_skip_blocks(windows: Sequence[int], num_tokens: int, block_size: int,
                       first_block: int = 0) -> list[int] | None:
    """Per layer, how many leading blocks of `[first_block, ceil(num_tokens / block_size))` the
    next token (position `num_tokens`) no longer reads: a sliding layer of window w reads
    positions > num_tokens - w. At most all but the last block; 0 for full attention. None when
    no layer slides."""
    if not windows:
        return None
    num_blocks = -(-num_tokens // block_size) - first_block
    if num_blocks < 1:
        raise ValueError(f"{num_tokens} tokens in blocks of {block_size} end before block {first_block}")
    return [min(num_blocks - 1, max(0, (num_tokens - window + 1) // block_size - first_block)) if window else 0
            for window in windows]


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype,
                    num_kv_heads: int | None = None, kv_format: KVQuantFormat | None = None,
                    groups: KVGroups | None = None) -> int:
    """The bytes of one block: every layer's, or with `groups` one group's."""
    layers = arch.num_hidden_layers if groups is None else groups.num_slots
    if kv_format is not None:
        return layers * kv_format.block_bytes
    itemsize = torch.empty((), dtype=dtype).element_size()
    heads = arch.num_key_value_heads if num_kv_heads is None else num_kv_heads
    return layers * 2 * block_size * heads * arch.head_dim * itemsize


def num_blocks_for_memory(arch: ModelArchConfig, block_size: int, dtype: torch.dtype, memory_bytes: int,
                          num_kv_heads: int | None = None, kv_format: KVQuantFormat | None = None,
                          groups: KVGroups | None = None) -> int:
    blocks = memory_bytes // bytes_per_block(arch, block_size, dtype, num_kv_heads, kv_format, groups)
    if blocks < 2:
        raise ValueError(f"KV cache memory of {memory_bytes / 2**20:.1f} MiB holds fewer than 2 blocks of "
                         f"{block_size} tokens; raise kv_cache_memory_gb or set num_blocks")
    return int(blocks)


def allocate_kv_cache(arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str, shared: bool = False, num_kv_heads: int | None = None,
                      kv_format: KVQuantFormat | None = None, groups: KVGroups | None = None) -> KVCache:
    """A zeroed cache (`groups`: a grouped one, see the module docstring). `shared` (CPU, Linux): allocate it in a memfd, so that a same-host peer
    given the descriptor can map it (kvtransfer's shm mapped path); such memory is in 4 KiB
    pages (shmem), otherwise the CPU cache is advised into transparent huge pages. `kv_format`:
    an 8-bit cache in that format (`dtype` is then the model's, not the cache's)."""
    heads = arch.num_key_value_heads if num_kv_heads is None else num_kv_heads
    windows = layer_windows(arch)
    layers = arch.num_hidden_layers if groups is None else groups.num_slots
    shape = (layers, num_blocks, 2, block_size, heads, arch.head_dim)
    if kv_format is not None:
        if (kv_format.block_size, kv_format.num_kv_heads, kv_format.head_dim) != (block_size, heads, arch.head_dim):
            raise ValueError(f"kv_format is for blocks of {kv_format.block_size} tokens x {kv_format.num_kv_heads} "
                             f"heads x {kv_format.head_dim}, the cache's are {block_size} x {heads} x {arch.head_dim}")
        shape, dtype = (layers, num_blocks, kv_format.block_bytes), torch.uint8
    if shared and torch.device(device).type == "cpu" and hasattr(os, "memfd_create"):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        fd = os.memfd_create("pdserve-kv-cache", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)  # a fresh memfd reads as zeros
            # MAP_POPULATE allocates every page now (~0.2 s per 512 MiB, before the worker is
            # ready). Left untouched, they would be allocated by the first same-host peer's own
            # MAP_POPULATE mapping of this file: ~1.4 s per 512 MiB instead of ~30 ms, in the
            # first transfer, holding that worker's GIL (its engine thread stalls).
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        data = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
        return KVCache(data=data, block_size=block_size, memory_fd=fd, _mapping=mapping, kv_format=kv_format,
                       layer_windows=windows, groups=groups)
    data = torch.empty(shape, dtype=dtype, device=device)
    if data.device.type == "cpu":
        advise_huge_pages(data)  # before the first touch, so the zeroing below faults in huge pages
    data.zero_()
    return KVCache(data=data, block_size=block_size, kv_format=kv_format, layer_windows=windows, groups=groups)
