"""A grouped KV cache through the whole engine (engine/kv_groups.py, engine/block_groups.py).

Tiny random models with sliding-window layers (tests/engine/tiny_models.py, window 8): the default
layout (`kv_layout="auto"`) gives a sliding layer's blocks behind its window back to the pool. Its
greedy tokens must equal the uniform layout's (every layer's blocks kept), which
tests/engine/test_model_families.py holds to transformers' (chunks crossing the window, prefix
hits); here also under preemption, with an 8-bit cache, and with the memory it holds measured.
"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.block_groups import GroupedBlockManager
from engine.block_manager import BlockManager
from engine.kv_cache import bytes_per_block
from tests.engine.tiny_models import WINDOW, save_family_model

BS = 4
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # several windows past the prompt
PROMPTS = [list(range(2, 40)), [5, 17, 99, 3, 64, 22, 9, 31, 40, 2, 77, 13, 6], [42, 7] * 12, list(range(60, 110))]


@pytest.fixture(scope="module", params=["gemma3", "mistral-sliding"])
def model(request, tmp_path_factory):
    return request.param, save_family_model(tmp_path_factory.mktemp(request.param), request.param)


def _run(folder, prompts=PROMPTS, **options):
    with LLM(folder, block_size=BS, **options) as llm:
        outputs = [o.token_ids for o in llm.generate(prompts, LONG, use_tqdm=False)]
        scheduler = llm.engine.scheduler
        scheduler.check_integrity()
        return outputs, scheduler.block_manager, scheduler.stats()


def test_grouped_gives_the_uniform_layouts_tokens_even_when_blocks_run_short(model):
    name, folder = model
    expected, uniform, _ = _run(folder, num_blocks=256, kv_layout="uniform")
    assert type(uniform) is BlockManager
    got, grouped, _ = _run(folder, num_blocks=256)
    assert type(grouped) is GroupedBlockManager and got == expected, name
    # Few blocks: the memory of 24 blocks of every layer, room for one sequence of 90 tokens in
    # each group. Gemma 3's full-attention group runs short and requests are preempted
    # (recompute), coming back through the prefix cache; Mistral's layers all slide, so its
    # requests hold a window's blocks each and all fit.
    short, _, stats = _run(folder, num_blocks=24, max_num_batched_tokens=16)
    assert short == expected, name
    assert (stats.num_preemptions > 0) == (name == "gemma3"), name


@pytest.mark.parametrize("kv_cache_dtype", ["int8"])
def test_grouped_with_an_8bit_cache_gives_the_uniform_8bit_tokens(model, kv_cache_dtype):
    name, folder = model
    expected, _, _ = _run(folder, num_blocks=256, kv_layout="uniform", kv_cache_dtype=kv_cache_dtype)
    got, _, _ = _run(folder, num_blocks=256, kv_cache_dtype=kv_cache_dtype)
    assert got == expected, name


def test_a_long_request_holds_its_sliding_layers_window_only(model):
    """Bytes held by one request at 96 tokens of context, against keeping every layer's blocks."""
    name, folder = model
    prompt = list(range(2, 98))
    with LLM(folder, block_size=BS, num_blocks=256, max_num_batched_tokens=32) as llm:
        engine = llm.engine
        engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), request_id="r")
        while engine.scheduler.get_request("r").num_computed_tokens < len(prompt):
            engine.step()
        request = engine.scheduler.get_request("r")
        runner, groups = engine.runner, engine.runner.kv_groups
        held = sum(1 for table in request.block_tables for b in table if b)
        held_bytes = held * bytes_per_block(runner.arch, BS, runner.dtype, groups=groups)
        every_layer = -(-len(prompt) // BS) * bytes_per_block(runner.arch, BS, runner.dtype)
        sliding_layers = sum(1 for g in groups.layer_group if groups.windows[g])
        full_layers = runner.arch.num_hidden_layers - sliding_layers
        # full layers keep every block; sliding ones at most the window's blocks and one more
        bound = (full_layers * 24 + sliding_layers * (WINDOW // BS + 1)) / (runner.arch.num_hidden_layers * 24)
        assert held_bytes <= bound * every_layer, (name, held_bytes / every_layer)
        assert held_bytes < 0.5 * every_layer, name
        while engine.scheduler.has_unfinished():
            engine.step()
        engine.scheduler.check_integrity()
        blocks = engine.scheduler.block_manager
        assert blocks.num_free_blocks == blocks.num_blocks - 1  # all but the null block
        assert blocks.num_blocks == 256 * runner.arch.num_hidden_layers // groups.num_slots  # the same memory


def test_grouped_is_refused_naming_what_needs_every_layers_blocks(model):
    _, folder = model
    with pytest.raises(ValueError, match="does not work with host_cache_gb yet"):
        LLM(folder, block_size=BS, num_blocks=64, kv_layout="grouped", host_cache_gb=0.01)
    with pytest.raises(ValueError, match="does not work with preemption_mode 'swap' yet"):
        LLM(folder, block_size=BS, num_blocks=64, kv_layout="grouped", preemption_mode="swap", swap_space_gb=0.01)
    # auto keeps every layer's blocks there instead
    with LLM(folder, block_size=BS, num_blocks=64, host_cache_gb=0.01) as llm:
        assert type(llm.engine.scheduler.block_manager) is BlockManager


def test_speculative_decoding_on_a_grouped_cache_gives_the_same_tokens(model):
    """n-gram drafts take slots ahead of the window in every group; a rejected draft's blocks go
    back (free_tail) and the window's blocks stay. Prompts that repeat themselves get drafts."""
    name, folder = model
    prompts = [[42, 7, 9] * 8, list(range(2, 20)) * 2]
    expected, _, _ = _run(folder, prompts, num_blocks=256, kv_layout="uniform")
    got, grouped, stats = _run(folder, prompts, num_blocks=256, speculative_method="ngram", num_speculative_tokens=4)
    assert type(grouped) is GroupedBlockManager and stats.spec_draft_tokens > 0, name
    assert got == expected, name
