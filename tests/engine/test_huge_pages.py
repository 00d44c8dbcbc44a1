"""Transparent huge pages for the big CPU tensors (engine/huge_pages.py): the KV cache and the
model's weights are advised before they are first touched, and moving weights keeps their values."""
from __future__ import annotations

import pytest
import torch

from engine.huge_pages import HUGE_PAGE, HUGE_PAGES_ENV, place_parameters_in_huge_pages
from engine.kv_cache import allocate_kv_cache, num_blocks_for_memory
from engine.model.arch import ModelArchConfig

from ..memory_maps import THP_ON, mapping_at


@pytest.fixture(autouse=True)
def huge_pages_on(monkeypatch):
    monkeypatch.setenv(HUGE_PAGES_ENV, "1")  # (tests/conftest.py turns them off for the rest of the suite)


@pytest.mark.skipif(not THP_ON, reason="needs Linux transparent huge pages in always/madvise mode")
def test_a_large_cpu_cache_is_backed_by_huge_pages():
    arch = ModelArchConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5})
    blocks = num_blocks_for_memory(arch, 16, torch.float32, 64 * 2**20)
    cache = allocate_kv_cache(arch, blocks, 16, torch.float32, "cpu")
    # The kernel marks an madvise(MADV_HUGEPAGE)d region "hg"; whether it finds free huge pages
    # at fault time depends on the machine's memory fragmentation, so that is not asserted.
    mapping = mapping_at(cache.data.data_ptr() + 32 * 2**20)
    assert "hg" in mapping["VmFlags"].split(), mapping


def test_parameters_move_into_one_arena_with_their_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 1000),
                                torch.nn.Linear(1000, 7, bias=False)).to(torch.bfloat16)
    x = torch.randn(5, 1024).to(torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        expected = model(x)
    advised = place_parameters_in_huge_pages(model)
    params = dict(model.named_parameters())
    storages = {p.untyped_storage().data_ptr() for p in params.values()}
    assert len(storages) == 1, "every parameter must be a view of the one arena"
    for name, p in params.items():
        assert torch.equal(p, before[name]), name
        assert p.data_ptr() % 64 == 0, f"{name} is not cache-line aligned"
        assert isinstance(p, torch.nn.Parameter)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    first = min(p.data_ptr() for p in params.values())
    assert first % HUGE_PAGE == 0, "the arena starts on a huge-page boundary"
    if THP_ON:
        assert advised
        assert "hg" in mapping_at(first)["VmFlags"].split()
