"""The KV cache allocation: layout, sizing, zeroing, shared memory (huge pages: test_huge_pages.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from engine.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for_memory
from engine.model.arch import ModelArchConfig


def _arch() -> ModelArchConfig:
    return ModelArchConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5})


def test_layout_sizing_and_zeroed_layers_that_share_one_allocation():
    arch = _arch()
    per_block = bytes_per_block(arch, 16, torch.bfloat16)
    assert per_block == 3 * 2 * 16 * 2 * 16 * 2
    blocks = num_blocks_for_memory(arch, 16, torch.bfloat16, 10 * per_block + per_block // 2)
    assert blocks == 10
    cache = allocate_kv_cache(arch, blocks, 16, torch.bfloat16, "cpu")
    assert cache.data.shape == (3, 10, 2, 16, 2, 16) and cache.num_blocks == 10
    assert not cache.data.any()
    layers = cache.layers
    assert len(layers) == 3 and layers[1].data_ptr() == cache.data[1].data_ptr()
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        num_blocks_for_memory(arch, 16, torch.bfloat16, per_block)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux-only")
def test_a_shared_cache_lives_in_a_memfd_that_another_mapping_sees():
    import mmap
    import os

    import numpy as np
    arch = _arch()
    cache = allocate_kv_cache(arch, 4, 16, torch.float32, "cpu", shared=True)
    nbytes = cache.data.numel() * 4
    assert cache.memory_fd is not None and not cache.data.any()
    # every page exists before anything touches it: a peer's first MAP_POPULATE mapping must not
    # be the one that allocates them (engine/kv_cache.py)
    assert os.fstat(cache.memory_fd).st_blocks * 512 >= nbytes
    assert os.fstat(cache.memory_fd).st_size == nbytes
    cache.layers[2][3, 1, 5].fill_(7.0)  # layer 2, block 3, V, token 5
    view = mmap.mmap(cache.memory_fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        seen = np.frombuffer(view, dtype=np.float32).reshape(cache.data.shape)
        assert (seen[2, 3, 1, 5] == 7.0).all() and seen.sum() == 7.0 * 2 * 16
        del seen
    finally:
        view.close()
    assert allocate_kv_cache(arch, 4, 16, torch.float32, "cpu").memory_fd is None
