"""Architecture config of the Llama-family decoders the engine runs.

`ModelArchConfig` is the single description of a model's shape that the model code, the
weight loader and the KV cache sizing read. It is built from a Hugging Face `config.json`
(a dict or a `transformers.PretrainedConfig`) and validated at construction, so a model
that the engine cannot run is refused with a clear message before any weight is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# HF rope_type -> the parameters that rope type needs besides rope_theta.
SUPPORTED_ROPE_SCALING = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_ROPE_KEYS_NOT_SCALING = ("rope_theta", "rope_type", "type", "partial_rotary_factor")

TokenIds = int | list[int] | None


@dataclass(frozen=True)
class ModelArchConfig:
    """What the Llama-family model code needs.

    `attention_bias` is the bias on the q/k/v projections (always on for Qwen2);
    `o_proj_bias` the bias on the output projection (Llama's `attention_bias` sets both).
    `rope_scaling` is None for plain RoPE, else a HF-format dict such as
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}. `sliding_window` is None for full attention.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    bos_token_id: TokenIds
    eos_token_id: TokenIds
    o_proj_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {self.architecture!r}; pdserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"model config: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"model config: rope_theta must be > 0, got {self.rope_theta!r}")
        if self.hidden_act != "silu":
            raise ValueError(
                f"model config: hidden_act {self.hidden_act!r} is not supported; "
                "Llama-family models use 'silu'")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model config: sliding_window must be >= 1 or None, got {self.sliding_window!r}")
        _check_token_ids("bos_token_id", self.bos_token_id)
        _check_token_ids("eos_token_id", self.eos_token_id)
        _check_rope_scaling(self.rope_scaling)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The stop token ids as a tuple (empty when the config names none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def expected_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must hold, by Hugging Face name, with its shape.

        `lm_head.weight` is absent when the embeddings are tied (a checkpoint may still
        carry it; `engine.model.loader.check_weights` accepts that).
        """
        hidden, inter = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, hidden)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (hidden,)
            shapes[p + "post_attention_layernorm.weight"] = (hidden,)
            shapes[p + "self_attn.q_proj.weight"] = (self.q_size, hidden)
            shapes[p + "self_attn.k_proj.weight"] = (self.kv_size, hidden)
            shapes[p + "self_attn.v_proj.weight"] = (self.kv_size, hidden)
            shapes[p + "self_attn.o_proj.weight"] = (hidden, self.q_size)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.q_size,)
                shapes[p + "self_attn.k_proj.bias"] = (self.kv_size,)
                shapes[p + "self_attn.v_proj.bias"] = (self.kv_size,)
            if self.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (hidden,)
            shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes["model.norm.weight"] = (hidden,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, hidden)
        return shapes

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelArchConfig:
        """Build from a `config.json` dict or a `transformers.PretrainedConfig`.

        Values the config leaves out get transformers' defaults for that model type, so
        the engine and transformers read the same folder the same way.
        """
        raw = _config_to_dict(cfg)
        architecture = _architecture_of(raw)
        model_type = next(t for t, a in ARCHITECTURE_BY_MODEL_TYPE.items() if a == architecture)
        full = _with_transformers_defaults(model_type, raw)

        def get(key: str, default: Any = None) -> Any:
            value = full.get(key)
            return default if value is None else value

        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if full.get(key) is None:
                raise ValueError(f"model config has no {key!r}; config.json must define it")
        if get("mlp_bias", False):
            raise ValueError("model config: mlp_bias=True is not supported (Llama-family MLPs have no bias)")
        num_heads = full["num_attention_heads"]
        rope_theta, rope_scaling = _rope_of(full)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
            sliding = get("sliding_window") if get("use_sliding_window", False) else None
        elif model_type == "llama":
            qkv_bias = o_bias = bool(get("attention_bias", False))
            sliding = None
        else:
            qkv_bias = o_bias = False
            sliding = get("sliding_window")
        max_pos = get("max_position_embeddings", 2048)
        if sliding is not None and sliding >= max_pos:
            sliding = None
        return cls(
            architecture=architecture,
            vocab_size=full["vocab_size"],
            hidden_size=full["hidden_size"],
            intermediate_size=full["intermediate_size"],
            num_hidden_layers=full["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=get("num_key_value_heads", num_heads),
            head_dim=get("head_dim", full["hidden_size"] // num_heads),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            hidden_act=get("hidden_act", "silu"),
            bos_token_id=full.get("bos_token_id"),
            eos_token_id=full.get("eos_token_id"),
            sliding_window=sliding,
        )


def _config_to_dict(cfg: Any) -> dict:
    if isinstance(cfg, dict):
        return dict(cfg)
    to_dict = getattr(cfg, "to_dict", None)
    if to_dict is None:
        raise ValueError(f"expected a config.json dict or a transformers PretrainedConfig, got {type(cfg).__name__}")
    return to_dict()


def _architecture_of(raw: dict) -> str:
    architectures = raw.get("architectures")
    model_type = raw.get("model_type")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if architectures:
        name = architectures[0] if isinstance(architectures, (list, tuple)) else architectures
        if name not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model architecture {name!r}; pdserve runs {supported}")
        return name
    if model_type in ARCHITECTURE_BY_MODEL_TYPE:
        return ARCHITECTURE_BY_MODEL_TYPE[model_type]
    raise ValueError(
        f"unsupported model architecture: config has model_type {model_type!r} and no known "
        f"'architectures' entry; pdserve runs {supported}")


def _with_transformers_defaults(model_type: str, raw: dict) -> dict:
    """Fill what the config leaves out the way transformers' own config class would."""
    try:
        from transformers import AutoConfig
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        return raw
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    try:
        return {**AutoConfig.for_model(model_type, **kwargs).to_dict(), **_explicit_rope(raw)}
    except Exception as exc:  # transformers' own validation of a broken config
        raise ValueError(f"invalid {model_type} model config: {exc}") from exc


def _explicit_rope(raw: dict) -> dict:
    return {k: raw[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if k in raw}


def _rope_of(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config style: transformers 5's
    `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params and all(
            isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    scaling = cfg.get("rope_scaling")
    merged: dict = {}
    if isinstance(params, dict):
        merged.update(params)
    if isinstance(scaling, dict):
        merged.update(scaling)
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = merged.get("rope_theta", 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    out = {"rope_type": rope_type}
    out.update({k: v for k, v in merged.items() if k not in _ROPE_KEYS_NOT_SCALING})
    return float(theta), out


def _check_rope_scaling(scaling: dict | None) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ValueError(f"model config: rope_scaling must be a dict or None, got {scaling!r}")
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_SCALING:
        raise ValueError(
            f"model config: rope scaling type {rope_type!r} is not supported; pdserve supports "
            f"plain RoPE and {', '.join(SUPPORTED_ROPE_SCALING)}")
    missing = [k for k in SUPPORTED_ROPE_SCALING[rope_type] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"model config: {rope_type} rope scaling needs {', '.join(missing)}")


def _check_token_ids(name: str, value: TokenIds) -> None:
    if value is None:
        return
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"model config: {name} must be a token id, a list of ids or null, got {value!r}")


_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


def check_weights(arch: ModelArchConfig, names_and_shapes: Any, source: str = "") -> None:
    """Check a checkpoint against `arch`: every expected tensor present with its shape.

    `names_and_shapes` is a mapping or an iterable of (name, shape) pairs; a shape may be
    a tuple, a `torch.Size` or anything with `.shape` (a tensor). A missing, unexpected or
    misshapen tensor raises ValueError naming it with the expected and actual shapes.
    """
    pairs = names_and_shapes.items() if hasattr(names_and_shapes, "items") else names_and_shapes
    actual: dict[str, tuple[int, ...]] = {}
    for name, shape in pairs:
        shape = getattr(shape, "shape", shape)
        actual[name] = tuple(int(d) for d in shape)
    expected = arch.expected_weight_shapes()
    problems = []
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            problems.append(f"tensor {name} is missing (expected shape {list(want)})")
        elif got != want:
            problems.append(f"tensor {name} has shape {list(got)}, expected {list(want)}")
    for name, got in actual.items():
        if name in expected or name.endswith(_IGNORED_WEIGHT_SUFFIXES):
            continue
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            want = (arch.vocab_size, arch.hidden_size)
            if got != want:
                problems.append(f"tensor {name} has shape {list(got)}, expected {list(want)}")
            continue
        problems.append(f"unexpected tensor {name} with shape {list(got)}")
    if problems:
        where = f" in {source}" if source else ""
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ValueError(
            f"the weights{where} do not match the {arch.architecture} config "
            f"({arch.num_hidden_layers} layers, hidden {arch.hidden_size}, {arch.num_attention_heads} "
            f"heads, {arch.num_key_value_heads} KV heads): {shown}. Check that config.json "
            "belongs to these weights")
