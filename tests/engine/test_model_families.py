"""Every model family (engine/model/families/) against transformers, on tiny random models.

Each family's tiny model randomizes what initialization leaves constant (norm weights, which
Gemma initializes to 0 and the others to 1; soft-caps set low enough to bite), so a skipped or
misplaced detail changes the tokens. Greedy token ids must equal transformers' (fp32, eager
attention) offline through the whole engine: with chunked prefill whose chunks cross the sliding
window, after a prefix-cache hit, on the torch reference backend and the cpu default, and at
tensor-parallel size 2, where the heads split. The P/D hand-off is in
tests/workers/test_model_families_disagg.py.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.model.families import SUPPORTED_ARCHITECTURES
from engine.model.loader import resolve_model
from tests.engine.tiny_models import FAMILIES, VOCAB, family_config, save_family_model, save_tiny_model

PROMPTS = [[5, 17, 99, 3, 64, 22, 9, 31, 40, 2, 77, 13, 6], list(range(2, 40)), [42, 7] * 9, [100, 3, 56]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CHUNKED = dict(block_size=4, num_blocks=256, max_num_batched_tokens=12)  # chunks of <= 12 tokens cross the window


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = save_family_model(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, min_new_tokens=GREEDY.max_tokens,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    assert len({tuple(e) for e in expected}) == len(PROMPTS), "the tiny model must not just repeat itself"
    return request.param, folder, expected


def _generate(folder: str, prompts=PROMPTS, **options) -> list[list[int]]:
    with LLM(folder, **options) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_match_transformers_with_chunks_crossing_the_window(family, backend):
    name, folder, expected = family
    assert _generate(folder, attention_backend=backend, **CHUNKED) == expected, name


def test_a_prefix_cache_hit_gives_transformers_tokens(family):
    """The second request's prompt extends the first's: its first blocks come from the prefix
    cache (counted), and what it generates is still transformers' continuation."""
    name, folder, expected = family
    with LLM(folder, block_size=4, num_blocks=256) as llm:
        first = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]
        assert first.token_ids == expected[1]
        again = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens >= len(PROMPTS[1]) - 4, name
        assert again.token_ids == expected[1], name


@pytest.mark.usefixtures("one_torch_thread")
def test_tensor_parallel_2_gives_transformers_tokens(family):
    name, folder, expected = family
    assert _generate(folder, tensor_parallel_size=2, **CHUNKED) == expected, name


def test_every_family_is_a_supported_architecture(tmp_path):
    for name in FAMILIES:
        architecture = family_config(name).architectures
        arch = resolve_model(save_family_model(tmp_path / name, name)).arch
        assert arch.architecture in SUPPORTED_ARCHITECTURES and (architecture is None or arch.architecture in architecture)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB)
    folder = save_tiny_model(tmp_path, config)
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'; pdserve runs .*Gemma3ForCausalLM"):
        resolve_model(folder)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_a_latent_attention_cache_holds_one_latent_per_token_and_layer(tmp_path, name):
    """The cache of an MLA model is sized, allocated and sent per block as (kv_lora_rank +
    qk_rope_head_dim) values per token and layer (576 at DeepSeek-V3's sizes), not as keys and
    values per head; in 8-bit blocks one byte per latent value plus the block's scales and K
    reference, read back through the backend: the first token, whose prefill attends over the
    stored (quantized) latents, is the float cache's."""
    from engine.kv_cache import allocate_kv_cache, bytes_per_block
    from engine.model.arch import ModelArchConfig
    arch = ModelArchConfig.from_hf_config(family_config(name))
    latent = arch.kv_lora_rank + arch.qk_rope_head_dim
    assert arch.is_mla and latent == 40
    assert bytes_per_block(arch, 16, torch.bfloat16) == arch.num_hidden_layers * 16 * latent * 2
    cache = allocate_kv_cache(arch, 3, 16, torch.float32, "cpu")
    assert cache.layers[0][0].numel() == 16 * latent
    full = ModelArchConfig.from_hf_config(transformers.DeepseekV3Config())  # DeepSeek-V3's own sizes
    assert full.kv_lora_rank + full.qk_rope_head_dim == 576 and full.head_dim == 288 and full.num_key_value_heads == 1
    from engine.kv_quant import kv_quant_format
    fmt = kv_quant_format("int8", 16, 1, arch.head_dim)
    assert bytes_per_block(arch, 16, torch.float32, kv_format=fmt) == arch.num_hidden_layers * fmt.block_bytes
    assert fmt.values_bytes == 16 * latent
    folder = save_family_model(tmp_path, name)
    prompts = [[3 + (7 * i + j) % 60 for j in range(21)] for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = {}
    for kv_cache_dtype in ("auto", "int8", "fp8_e4m3"):
        with LLM(folder, kv_cache_dtype=kv_cache_dtype, num_blocks=64, block_size=4) as llm:
            assert (llm.engine.runner.kv_cache.kv_format is None) == (kv_cache_dtype == "auto")
            first[kv_cache_dtype] = [out.token_ids[0] for out in llm.generate(prompts, params, use_tqdm=False)]
    assert first["int8"] == first["auto"] and first["fp8_e4m3"] == first["auto"]
