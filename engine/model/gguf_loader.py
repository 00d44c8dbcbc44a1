"""Convert a GGUF file once into a cached Hugging Face folder.

The folder holds `config.json` (built from the GGUF metadata), the weights dequantized to
float32 with Hugging Face names and layout (`model.safetensors`, sharded above 2 GiB),
the tokenizer built by transformers from the GGUF (chat template kept) and
`generation_config.json`. It is written into a temporary folder that is renamed into
place when complete, so a crash never leaves a half-written cache, and a later run reuses
it without reading the GGUF.

The weights equal what transformers' own GGUF loader
(`transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`) produces from the same file,
which undoes two llama.cpp conventions:
- the rows of the Q and K projections of `llama` models are permuted
  (`reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2)`, for its interleaved RoPE);
  the inverse is applied here. `qwen2`, `qwen3` and `gemma*` GGUFs are not permuted.
- Gemma stores every RMSNorm weight as (1 + w) (Gemma's norm multiplies by 1 + w, llama.cpp's
  by w); 1 is subtracted again, in float32, as transformers does.
The config follows llama.cpp's reading of the metadata where transformers' GGUF loader leaves
a value at its config default (Gemma 3's layer pattern, local RoPE base and
query_pre_attn_scalar; Qwen3's head_dim); for real checkpoints both agree.
Llama 3.1-style `rope_freqs.weight` (not a Hugging Face tensor) is turned back into the
`llama3` rope_scaling it was computed from, or refused when no such config reproduces it.
Qwen3-MoE's experts, which llama.cpp stacks per layer and projection (`ffn_{gate,up,down}_exps`,
[experts, rows, cols]), become transformers 5's fused `mlp.experts.gate_up_proj` (gate rows then
up rows) and `mlp.experts.down_proj`, as transformers loads them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import paths
from engine.model.arch import ModelArchConfig, check_weights

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1
CACHE_DIR_ENV = paths.CACHE_DIR_ENV
MAX_SHARD_BYTES = 2 << 30
STALE_TEMP_SECONDS = 3600
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# transformers' model_type where it differs from the GGUF architecture name (a gemma3 GGUF
# holds only the text model).
_HF_MODEL_TYPE = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
PERMUTED_QK_ARCHITECTURES = ("llama",)
_GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# llama.cpp's converter computes rope_freqs with original_max_position_embeddings read from the
# top level of config.json, where Llama 3.x configs do not have it: always its default 8192.
_LLAMA_CPP_ROPE_ORIGINAL_CONTEXT = 8192

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the *pre*-feedforward norm there, and
# Hugging Face's post_attention_layernorm is applied to the attention output (not before the MLP).
_GEMMA_NORM_TENSORS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_TENSORS_BY_ARCH = {
    "llama": _BLOCK_TENSORS,
    "qwen2": _BLOCK_TENSORS,
    "qwen3": {**_BLOCK_TENSORS, **_QK_NORM_TENSORS},
    "qwen3moe": {**_BLOCK_TENSORS, **_QK_NORM_TENSORS, "ffn_gate_inp": "mlp.gate"},
    "gemma2": {**_BLOCK_TENSORS, **_GEMMA_NORM_TENSORS},
    "gemma3": {**_BLOCK_TENSORS, **_GEMMA_NORM_TENSORS, **_QK_NORM_TENSORS},
}
# llama.cpp stacks each layer's experts, [experts, rows, cols] per projection; they become
# transformers 5's fused tensors (gate rows, then up rows, in one): (name, part of it).
_STACKED_EXPERTS = {"ffn_gate_exps": ("mlp.experts.gate_up_proj", 0), "ffn_up_exps": ("mlp.experts.gate_up_proj", 1),
                    "ffn_down_exps": ("mlp.experts.down_proj", 0)}
_MOE_ARCHITECTURES = ("qwen3moe",)
# Tensors llama.cpp adds that are config, not weights (read into config.json instead).
_CONFIG_TENSORS = ("rope_freqs.weight",)
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def cache_root(cache_dir: str | None = None) -> str:
    """Where converted models live: `cache_dir`, else `models/` in pdserve's cache root
    ($PDSERVE_CACHE_DIR/models, default ~/.cache/pdserve/models; engine/paths.py)."""
    return os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else str(paths.models_dir())


def converted_dir(gguf_path: str, cache_dir: str | None = None) -> str:
    """The cache folder for this GGUF: `<root>/<file stem>-<key>`, the key hashing the
    file's path, size and mtime and the converter version (no read of the file)."""
    path = os.path.realpath(gguf_path)
    stat = os.stat(path)
    key_text = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERTER_VERSION}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:12]
    stem = os.path.basename(path).removesuffix(".gguf")
    return os.path.join(cache_root(cache_dir), f"{stem}-{key}")


def is_complete_conversion(folder: str) -> bool:
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return False
    return (os.path.isfile(os.path.join(folder, "model.safetensors"))
            or os.path.isfile(os.path.join(folder, "model.safetensors.index.json")))


def convert_gguf(gguf_path: str, cache_dir: str | None = None, progress: bool = True) -> str:
    """Return a Hugging Face folder holding this GGUF's model, converting it on first use."""
    if not os.path.isfile(gguf_path):
        raise ValueError(f"GGUF file {gguf_path} not found")
    final = converted_dir(gguf_path, cache_dir)
    if is_complete_conversion(final):
        return final
    root = os.path.dirname(final)
    try:
        os.makedirs(root, exist_ok=True)
        _remove_stale_temp_dirs(final)
        if os.path.isdir(final):
            shutil.rmtree(final)  # an incomplete folder someone left by hand; rebuild it
        temp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=root)
    except OSError as exc:
        raise ValueError(
            f"cannot write the model cache in {root} ({exc}); set ${CACHE_DIR_ENV} or pass "
            "cache_dir to a writable folder") from exc
    try:
        _convert_into(gguf_path, temp, progress)
        try:
            os.rename(temp, final)
        except OSError:
            if not is_complete_conversion(final):
                raise
            shutil.rmtree(temp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    logger.info("converted %s into %s", gguf_path, final)
    return final


def _remove_stale_temp_dirs(final: str) -> None:
    prefix = f".{os.path.basename(final)}.tmp-"
    root = os.path.dirname(final)
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(prefix) and time.time() - os.path.getmtime(path) > STALE_TEMP_SECONDS:
            shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class _GGUFModel:
    path: str
    gguf_architecture: str
    # keyword arguments of transformers' config class for `model_type` (what config.json holds)
    hf_config: dict
    arch: ModelArchConfig  # validated before any tensor is dequantized
    pad_token_id: int | None


def open_reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:
        raise ValueError(
            f"{path} is not a valid GGUF file ({type(exc).__name__}: {exc}); the file may be "
            "truncated or not a GGUF model: download or convert it again") from exc


def read_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    if hasattr(field, "contents"):
        return field.contents()
    values = []
    for index in field.data:  # older gguf: decode the parts by hand
        part = field.parts[index]
        values.append(bytes(part).decode("utf-8") if part.dtype == np.uint8 else part.tolist()[0])
    return values[0] if len(values) == 1 else values


def _float32_decimal(value: float) -> float:
    """GGUF stores floats as float32; use the shortest decimal that rounds to the same
    float32 (9.999999747e-06 -> 1e-05), as the original config.json had it."""
    return float(str(np.float32(value)))


def _read_model(path: str, reader: Any) -> _GGUFModel:
    arch_name = read_field(reader, "general.architecture")
    if arch_name not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path} has architecture {arch_name!r}, which pdserve does not support; "
            f"supported GGUF architectures: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {path} has no token_embd.weight tensor; it is not a complete model")

    def meta(key: str, default: Any = None, required: bool = True) -> Any:
        value = read_field(reader, f"{arch_name}.{key}", default)
        if value is None and required:
            raise ValueError(f"GGUF file {path} lacks the metadata key {arch_name}.{key}")
        return value

    def uniform(key: str, value: Any) -> int:
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"GGUF file {path}: per-layer {arch_name}.{key} {value} is not supported")
            value = value[0]
        return int(value)

    hidden = int(meta("embedding_length"))
    num_layers = int(meta("block_count"))
    num_heads = uniform("attention.head_count", meta("attention.head_count"))
    num_kv_heads = uniform("attention.head_count_kv", meta("attention.head_count_kv", num_heads))
    # llama.cpp's default when the key is absent (transformers' Qwen3 GGUF loader ignores the
    # key and takes its config default 128, which real Qwen3 checkpoints also have)
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    value_dim = int(meta("attention.value_length", head_dim))
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"GGUF file {path}: key length {head_dim}, value length {value_dim} and rope "
            f"dimension {rope_dim} differ; pdserve supports only full-width RoPE with equal K/V heads")
    rope_theta = _float32_decimal(meta("rope.freq_base", 10000.0))
    rope_scaling = None
    scaling_type = meta("rope.scaling.type", None, required=False)
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _float32_decimal(meta("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(
            f"GGUF file {path} uses rope scaling {scaling_type!r}; from GGUF pdserve supports "
            "plain, linear and Llama 3.1-style (rope_freqs) RoPE scaling: use the model's "
            "Hugging Face folder instead")
    if "rope_freqs.weight" in tensors:
        if arch_name != "llama" or rope_scaling is not None:
            raise ValueError(
                f"GGUF file {path} stores RoPE frequency factors (tensor rope_freqs.weight) for "
                f"a {arch_name} model{' besides ' + scaling_type + ' rope scaling' if rope_scaling else ''}, "
                "which has no Hugging Face equivalent pdserve knows; use the model's Hugging Face folder instead")
        rope_scaling = _llama3_rope_scaling(path, tensors["rope_freqs.weight"], rope_theta, head_dim)
    architecture = SUPPORTED_GGUF_ARCHITECTURES[arch_name]
    hf_config = {
        "architectures": [architecture],
        "model_type": _HF_MODEL_TYPE.get(arch_name, arch_name),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": uniform("feed_forward_length", meta("feed_forward_length", 0,
                                                                 required=arch_name not in _MOE_ARCHITECTURES)),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": _float32_decimal(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": read_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": read_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch_name in _GEMMA_ARCHITECTURES:
        hf_config.update(_gemma_config(path, arch_name, meta, hf_config))
    else:
        hf_config["hidden_act"] = "silu"
    if arch_name in ("llama", "qwen3", "qwen3moe"):
        hf_config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch_name in _MOE_ARCHITECTURES:
        hf_config.update(_moe_config(meta, tensors, num_layers))
    return _GGUFModel(path, arch_name, hf_config, _engine_arch(path, hf_config),
                      read_field(reader, "tokenizer.ggml.padding_token_id"))


def _moe_config(meta: Any, tensors: dict, num_layers: int) -> dict:
    """Qwen3-MoE's experts as llama.cpp reads them: it always renormalizes the chosen experts'
    weights (norm_topk_prob), and a layer without a router is dense."""
    return {"num_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")), "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]}


def _gemma_config(path: str, arch_name: str, meta: Any, base: dict) -> dict:
    """Gemma 2/3 config values, as llama.cpp reads them (src/llama-model.cpp): what the
    metadata lacks is fixed by llama.cpp per architecture, not by transformers' defaults."""
    num_layers = base["num_hidden_layers"]
    window = meta("attention.sliding_window", None, required=False)
    pattern = meta("attention.sliding_window_pattern", None, required=False)
    config: dict = {"hidden_activation": "gelu_pytorch_tanh"}
    if window is None:
        layer_types = ["full_attention"] * num_layers
    elif isinstance(pattern, list):  # per layer, True = sliding window (newer llama.cpp)
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF file {path}: {arch_name}.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {num_layers} layers")
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        # every period-th layer is global: Gemma 2 alternates, Gemma 3 has 5 local : 1 global
        period = int(pattern) if pattern is not None else (2 if arch_name == "gemma2" else 6)
        layer_types = ["sliding_attention" if period == 0 or (i + 1) % period else "full_attention"
                       for i in range(num_layers)]
    config["sliding_window"] = int(window) if window is not None else None
    config["layer_types"] = layer_types
    # No key holds it: llama.cpp scales scores by 1/sqrt(head_dim), but for the 27B models
    # (46 and 62 layers) by 1/sqrt(hidden / heads), which is their query_pre_attn_scalar.
    is_27b = num_layers == {"gemma2": 46, "gemma3": 62}[arch_name]
    config["query_pre_attn_scalar"] = (base["hidden_size"] // base["num_attention_heads"]
                                       if is_27b else base["head_dim"])
    # llama.cpp's defaults when absent: Gemma 2 caps at 50 / 30, Gemma 3 does not cap
    defaults = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}[arch_name]
    for key, default in zip(("attn_logit_softcapping", "final_logit_softcapping"), defaults):
        value = meta(key, default, required=False)
        config[key] = _float32_decimal(value) if value is not None else None
    if arch_name == "gemma3":
        # local (sliding) layers use their own RoPE base, unscaled; rope_theta and
        # rope_scaling are the global layers'
        config["rope_local_base_freq"] = _float32_decimal(meta("rope.freq_base_swa", 10000.0, required=False))
    elif base["rope_scaling"] is not None:
        raise ValueError(f"GGUF file {path}: rope scaling on a gemma2 model is not supported")
    return config


def _engine_arch(path: str, hf_config: dict) -> ModelArchConfig:
    """Validate against what the engine runs, before any tensor is dequantized."""
    try:
        return ModelArchConfig.from_hf_config(hf_config)
    except ValueError as exc:
        raise ValueError(f"GGUF file {path}: {exc}") from exc


def _llama_cpp_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                            high_freq_factor: float, original_context: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter (LlamaModel.generate_extra_tensors) computes
    it from a llama3 rope_scaling, in the same float32 arithmetic."""
    import math

    import torch

    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(factors, dtype=np.float32)


def _llama3_rope_scaling(path: str, tensor: Any, rope_theta: float, head_dim: int) -> dict | None:
    """The llama3 rope_scaling whose llama.cpp rope_freqs equal this tensor (float32 rounding
    aside), or ValueError. The factors fix only the ratios original/low and original/high,
    which is all the RoPE depends on; original_max_position_embeddings is llama.cpp's 8192."""
    from gguf.quants import dequantize

    stored = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    if stored.size != head_dim // 2:
        raise ValueError(f"GGUF file {path}: rope_freqs.weight has {stored.size} entries, "
                         f"expected head_dim / 2 = {head_dim // 2}")
    if np.all(stored == 1.0):
        return None  # every frequency unscaled: plain RoPE, exactly
    original = _LLAMA_CPP_ROPE_ORIGINAL_CONTEXT
    factor = _float32_decimal(stored.max())
    candidates = [(1.0, 4.0)]  # Llama 3.1 / 3.2 / 3.3
    # Between the thresholds 1 / f is linear in original / wavelen: two such entries give
    # low_freq_factor (intercept) and high - low (slope).
    smooth = (1 / stored - 1 / factor) / (1 - 1 / factor) if factor > 1 else np.zeros_like(stored)
    inner = (stored > 1 + 1e-6) & (stored < factor * (1 - 1e-6))
    if inner.sum() >= 2:
        inv_wavelen = original / (2 * np.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim))
        slope, intercept = np.polyfit(smooth[inner], inv_wavelen[inner], 1)
        candidates.append((round(float(intercept), 4), round(float(intercept + slope), 4)))
    for low, high in candidates:
        if not 0 < low < high:
            continue
        expected = _llama_cpp_rope_factors(rope_theta, head_dim, factor, low, high, original)
        if np.allclose(expected, stored, rtol=2e-6, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError(
        f"GGUF file {path} stores RoPE frequency factors (tensor rope_freqs.weight) that no "
        "Llama 3.1-style (llama3) rope_scaling reproduces, so its RoPE cannot be recovered "
        "exactly; use the model's Hugging Face folder instead")


def _hf_name(gguf_architecture: str, gguf_name: str) -> tuple[str, int]:
    """(Hugging Face name, part): stacked gate and up experts are parts 0 and 1 of one tensor."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name], 0
    table = _BLOCK_TENSORS_BY_ARCH[gguf_architecture]
    match = _BLOCK_NAME.match(gguf_name)
    if match is not None and gguf_architecture in _MOE_ARCHITECTURES and match.group(2) in _STACKED_EXPERTS \
            and match.group(3) == "weight":
        name, part = _STACKED_EXPERTS[match.group(2)]
        return f"model.layers.{match.group(1)}.{name}", part
    if match is None or match.group(2) not in table:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a {gguf_architecture} model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{table[part]}.{kind}", 0


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (`num_heads` = heads of that projection)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _dequantized(model: _GGUFModel, tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        weight = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(
            f"GGUF file {model.path}: tensor {tensor.name} uses quantization "
            f"{tensor.tensor_type.name}, which the gguf package cannot dequantize ({exc})") from exc
    weight = np.array(weight, dtype=np.float32, order="C")
    expected = tuple(int(d) for d in reversed(tensor.shape))
    if weight.shape != expected:
        weight = weight.reshape(expected)
    if model.gguf_architecture in PERMUTED_QK_ARCHITECTURES:
        if ".attn_q." in tensor.name:
            weight = unpermute_qk(weight, model.hf_config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            weight = unpermute_qk(weight, model.hf_config["num_key_value_heads"])
    if model.gguf_architecture in _GEMMA_ARCHITECTURES and tensor.name.endswith("norm.weight"):
        weight = weight - np.float32(1)  # stored as 1 + w; float32 as transformers computes it
    return np.ascontiguousarray(weight)


def _plan_shards(outputs: list[tuple[str, list]]) -> list[list[tuple[str, list]]]:
    shards: list[list] = [[]]
    size = 0
    for output in outputs:
        nbytes = sum(int(t.n_elements) for t in output[1]) * 4
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(output)
        size += nbytes
    return shards


def _outputs(model: _GGUFModel, tensors: list) -> list[tuple[str, list]]:
    """The Hugging Face tensors to write, in file order: (name, the GGUF tensors that make it, in
    order along their second axis). Raises on a tensor this architecture does not have."""
    parts: dict[str, dict[int, Any]] = {}
    for tensor in tensors:
        name, part = _hf_name(model.gguf_architecture, tensor.name)
        parts.setdefault(name, {})[part] = tensor
    outputs = []
    for name, by_part in parts.items():
        if sorted(by_part) != list(range(len(by_part))) or (name.endswith("gate_up_proj") and len(by_part) != 2):
            raise ValueError(f"GGUF file {model.path}: {name} needs both ffn_gate_exps and ffn_up_exps")
        outputs.append((name, [by_part[p] for p in sorted(by_part)]))
    return outputs


def _shape(tensors: list) -> tuple[int, ...]:
    shapes = [tuple(int(d) for d in reversed(t.shape)) for t in tensors]
    return shapes[0] if len(shapes) == 1 else (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])


def _write_weights(model: _GGUFModel, reader: Any, folder: str, progress: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    outputs = _outputs(model, [t for t in reader.tensors if t.name not in _CONFIG_TENSORS])
    check_weights(model.arch, [(name, _shape(parts)) for name, parts in outputs], source=model.path)
    shards = _plan_shards(outputs)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total_size = 0
    bar = tqdm(total=len(outputs), desc=f"pdserve: converting {os.path.basename(model.path)}",
               unit="tensor", disable=not progress)
    with bar:
        for shard, file_name in zip(shards, names):
            state = {}
            for name, parts in shard:
                arrays = [_dequantized(model, tensor) for tensor in parts]
                state[name] = torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1))
                weight_map[name] = file_name
                total_size += state[name].numel() * 4
                bar.update(1)
            save_file(state, os.path.join(folder, file_name), metadata={"format": "pt"})
            del state
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def _write_config(model: _GGUFModel, folder: str) -> None:
    import torch
    from transformers import AutoConfig, GenerationConfig

    kwargs = {k: v for k, v in model.hf_config.items() if k != "model_type"}
    if model.pad_token_id is not None:
        kwargs["pad_token_id"] = model.pad_token_id
    config = AutoConfig.for_model(model.hf_config["model_type"], **kwargs)
    config.dtype = torch.float32
    config.save_pretrained(folder)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=model.pad_token_id).save_pretrained(folder)


def _write_tokenizer(model: _GGUFModel, reader: Any, folder: str) -> None:
    from transformers import AutoTokenizer

    if read_field(reader, "tokenizer.ggml.model") is None:
        raise ValueError(f"GGUF file {model.path} has no tokenizer (no tokenizer.ggml.model metadata)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(model.path)), gguf_file=os.path.basename(model.path))
    except Exception as exc:
        raise ValueError(f"could not build the tokenizer of GGUF file {model.path}: {exc}") from exc
    template = read_field(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.model_max_length = model.hf_config["max_position_embeddings"]
    tokenizer.save_pretrained(folder)


def _convert_into(gguf_path: str, folder: str, progress: bool) -> None:
    reader = open_reader(gguf_path)
    model = _read_model(gguf_path, reader)
    _write_weights(model, reader, folder, progress)
    _write_tokenizer(model, reader, folder)
    _write_config(model, folder)
    stat = os.stat(gguf_path)
    source = {"gguf": os.path.realpath(gguf_path), "size": stat.st_size,
              "mtime_ns": stat.st_mtime_ns, "converter_version": CONVERTER_VERSION}
    with open(os.path.join(folder, "pdserve_source.json"), "w") as f:
        json.dump(source, f, indent=2)
