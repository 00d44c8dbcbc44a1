"""The Llama-family model through the paged cache against transformers, on tiny random models.

Covers GQA, tied embeddings, qkv bias (Qwen2) and llama3 RoPE scaling; every prompt of a batch
prefills in one flattened pass and decodes together, through shuffled block tables.
"""
import pytest
import torch
import transformers

from engine.attention.backend import get_attention_backend
from engine.model.decoder import DecoderForCausalLM
from engine.model.loader import resolve_model
from tests.engine.paged_harness import greedy_generate_paged

PROMPTS = [[5, 17, 99, 3], [42] * 23, list(range(1, 40)), [7, 8], [100, 3, 56, 77, 12, 9, 31]]


def _tiny(kind: str):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    if kind == "llama-gqa-tied":
        return transformers.LlamaConfig(tie_word_embeddings=True, rope_theta=10000.0, **common)
    if kind == "llama3-rope":
        return transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **common)
    if kind == "qwen2-bias":
        return transformers.Qwen2Config(tie_word_embeddings=True, **common)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    raise KeyError(kind)


@pytest.fixture(scope="module", params=["llama-gqa-tied", "llama3-rope", "qwen2-bias", "mistral"])
def tiny_pair(request, tmp_path_factory):
    torch.manual_seed(0)
    config = _tiny(request.param)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if config.model_type == "qwen2":  # make the qkv bias matter
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    loaded = resolve_model(str(folder))
    ours = DecoderForCausalLM(loaded.arch)
    ours.load_weights(loaded.iter_weights())
    return hf, ours.eval()


def _hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                      pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_and_logits_match_transformers(tiny_pair):
    hf, ours = tiny_pair
    backend = get_attention_backend("torch")
    outputs, first_logits = greedy_generate_paged(ours, backend, PROMPTS, 24, block_size=4, return_first_logits=True)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref_logits = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(first_logits[i], ref_logits, atol=1e-4, rtol=0)
        assert outputs[i] == _hf_greedy(hf, prompt, 24), f"prompt {i}"


def test_missing_and_misshapen_tensors_are_named(tiny_pair):
    _, ours = tiny_pair
    weights = dict(ours.state_dict())
    fresh = DecoderForCausalLM(ours.arch)
    hf_names = {k: v for k, v in _hf_named(ours).items()}
    broken = dict(hf_names)
    broken.pop("model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        fresh.load_weights(broken.items())
    wrong = dict(hf_names)
    wrong["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\).*expected"):
        fresh.load_weights(wrong.items())
    assert weights  # the original model is untouched


def _hf_named(model: DecoderForCausalLM) -> dict[str, torch.Tensor]:
    """Split our fused parameters back into Hugging Face tensors."""
    arch = model.arch
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    out = {}
    for name, tensor in model.state_dict().items():
        if ".qkv_proj." in name:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                out["model." + name.replace("qkv_proj", part)] = chunk
        elif ".gate_up_proj." in name:
            for part, chunk in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                out["model." + name.replace("gate_up_proj", part)] = chunk
        elif name.startswith("lm_head"):
            out[name] = tensor
        else:
            out["model." + name] = tensor
    return out


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_last_layer_on_sampled_rows_only_gives_the_same_logits_and_cache(tiny_pair, backend_name):
    """With `logits_meta` the last layer runs attention and the MLP only for the sampled rows; the
    logits and every stored K/V must be what the full forward gives. The batch has a middle prefill
    chunk (not sampled), a whole prompt and a decode token, through shuffled blocks."""
    from engine.attention.metadata import AttentionMetadata
    from engine.kv_cache import allocate_kv_cache

    _, ours = tiny_pair
    backend = get_attention_backend(backend_name)
    block_size = 4
    # seq 0: first 9 of a 20-token prompt (no sample); seq 1: a 7-token prompt; seq 2: a decode
    # at position 12 whose first 12 tokens' K/V are already in the cache.
    query_lens, seq_lens = [9, 7, 1], [9, 7, 13]
    tables = [[5, 2, 9, 0, 11], [7, 1], [3, 10, 6, 4]]
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, 128, (sum(query_lens),), generator=generator)
    positions = torch.tensor(list(range(9)) + list(range(7)) + [12])
    logits_indices = torch.tensor([15, 16])  # the last tokens of seqs 1 and 2
    base = allocate_kv_cache(ours.arch, 12, block_size, torch.float32, "cpu").data
    base[:, 3].normal_(generator=generator)  # seq 2's context (blocks 3, 10, 6)
    base[:, 10].normal_(generator=generator)
    base[:, 6].normal_(generator=generator)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
    rows_meta = AttentionMetadata.build([1, 1], [7, 13], [tables[1], tables[2]], block_size, "cpu")
    full_cache, rows_cache = base.clone(), base.clone()
    full = ours(input_ids, positions, list(full_cache.unbind(0)), meta, backend, logits_indices)
    rows = ours(input_ids, positions, list(rows_cache.unbind(0)), meta, backend, logits_indices, rows_meta)
    torch.testing.assert_close(rows, full, atol=1e-5, rtol=1e-5)
    assert torch.equal(rows_cache, full_cache)
    assert not torch.equal(full_cache[:, 5], base[:, 5])  # the unsampled chunk's K/V were stored


@pytest.mark.parametrize("native,widened_kernels", [(False, False), (False, True), (True, False)])
def test_bf16_on_a_cpu_without_native_bf16_warns_once_at_start(native, widened_kernels, tmp_path, monkeypatch,
                                                              caplog):
    """bf16 without AVX512-BF16/AMX and without the native kernels that compute it in fp32 goes
    through oneDNN's conversions and is slower than float32: the runner says so (with the CPU's
    features) instead of running slowly in silence. With those kernels it is fast: no warning."""
    from engine import cpu_kernels
    from engine.config import CacheConfig, EngineConfig
    from engine.model import fused_ops
    from engine.model_runner import ModelRunner
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_tiny("llama-gqa-tied")).save_pretrained(tmp_path)
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: native)
    monkeypatch.setattr(fused_ops, "bf16_computed_in_fp32", lambda: widened_kernels)
    config = EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cpu", cache=CacheConfig(num_blocks=8))
    with caplog.at_level("WARNING", logger="engine.model_runner"):
        ModelRunner(config, resolve_model(str(tmp_path)))
    warnings = [r.getMessage() for r in caplog.records if "without AVX512-BF16" in r.getMessage()]
    assert len(warnings) == (0 if native or widened_kernels else 1)
    if warnings:
        assert "bfloat16" in warnings[0] and "--dtype float32" in warnings[0]
