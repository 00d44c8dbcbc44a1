"""Every model family across the P -> D hand-off: a prefill worker computes the prompt's KV (every
layer, sliding ones included), pushes it to a decode worker, which decodes on it. Greedy tokens
must equal transformers' (fp32, eager) on the same tiny random model, with every prompt block's
KV that the decode side reads received (`kv_bytes_received`; a sliding layer's blocks behind the
window do not move), the prefill done remotely and no transfer failure counted (a
fallback to local prefill would hide a broken hand-off behind correct tokens).

The families here are one of each KV layout and attention variant: full attention with q/k norms
(qwen3), alternating sliding windows with logit soft-capping (gemma2), 5:1 sliding windows
(gemma3), every layer sliding (mistral-sliding), sliding windows with attention sinks and experts
(gpt-oss), full attention beside experts (qwen3-moe), and latent attention (deepseek-v3). The
other families' caches are laid out as one of these; their forward is compared with transformers
in tests/engine/test_model_families.py.

One prefill and one decode worker per family, all started at once; prompts cross the sliding
window (tests/engine/tiny_models.py WINDOW) and end mid-block. A decode worker of a model with
sliding layers has a grouped cache (engine/kv_groups.py): it receives one transfer per layer
group and holds only the blocks each group reads.
"""
import pytest
import torch
import transformers

from engine.kv_cache import layer_windows, window_skip_blocks
from engine.kv_groups import KVGroups
from engine.model.arch import ModelArchConfig
from tests.engine.tiny_models import FAMILIES, save_family_model
from tests.helpers import wait_until
from tests.workers.harness import all_blocks_free, generate, sampling, start_workers, stop_workers

pytestmark = pytest.mark.slow

BLOCK = 4
NEW = 10
PROMPTS = [list(range(3, 41)), [5, 17, 99, 3, 64, 22, 9, 31, 40, 2, 77, 13, 6]]
LAYOUTS = ["qwen3", "gemma2", "gemma3", "mistral-sliding", "gpt-oss", "qwen3-moe", "deepseek-v3"]
assert set(LAYOUTS) <= set(FAMILIES)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    folders = {name: save_family_model(tmp_path_factory.mktemp(name), name) for name in LAYOUTS}
    engine = ["--block-size", str(BLOCK), "--num-blocks", "64", "--max-model-len", "128"]
    specs = []
    for folder in folders.values():
        specs += [("prefill", ["--model", folder, *engine]),
                  ("decode", ["--model", folder, *engine, "--local-prefill-threshold", "0"])]
    workers = start_workers(specs)
    pairs = {name: (workers[2 * i], workers[2 * i + 1]) for i, name in enumerate(folders)}
    yield {name: (folders[name], *pairs[name]) for name in folders}
    stop_workers(workers)


def _transformers_greedy(folder: str) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    outputs = []
    for prompt in PROMPTS:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("name", LAYOUTS)
def test_disaggregated_greedy_is_transformers_with_the_kv_from_the_prefill_worker(families, name):
    folder, prefill, decode = families[name]
    expected = _transformers_greedy(folder)
    arch = ModelArchConfig.from_hf_config(transformers.AutoConfig.from_pretrained(folder))
    windows = layer_windows(arch)
    bytes_per_chunk = None
    for index, prompt in enumerate(PROMPTS):
        result = generate(decode, f"{name}-{index}", prompt, prefill, params=sampling(max_tokens=NEW))
        assert result.token_ids == expected[index], f"{name}, prompt {index}"
        outcome = result.kv_outcome
        assert outcome.prefilled_remotely and outcome.num_prompt_tokens == len(prompt)
        # every (layer, block) chunk the decode side reads arrived: each block of a full-attention
        # layer, a sliding layer's from the first its window still covers
        blocks = -(-len(prompt) // BLOCK)
        skips = window_skip_blocks(windows, len(prompt), BLOCK) or [0] * arch.num_hidden_layers
        chunks = sum(blocks - skip for skip in skips)
        assert outcome.kv_bytes_received % chunks == 0
        per_chunk = outcome.kv_bytes_received // chunks
        assert bytes_per_chunk in (None, per_chunk) and per_chunk > 0
        bytes_per_chunk = per_chunk
    stats = decode.stats()
    assert sum(stats.kv_transfer_failures.values()) == 0, dict(stats.kv_transfer_failures)
    # With sliding layers the decode worker's cache is grouped: its 64 blocks' memory in blocks of
    # one group's layers (the null block not counted), each group's received in a transfer of its own.
    layers_per_block = KVGroups.from_windows(windows).num_slots if windows else arch.num_hidden_layers
    assert stats.kv_blocks_total == (64 * arch.num_hidden_layers // layers_per_block - 1 if windows else 64), name
    for worker in (prefill, decode):
        wait_until(lambda: all_blocks_free(worker), what=f"{name}'s {worker.kind} worker to free every block")

