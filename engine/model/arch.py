"""Architecture config of the Llama-family decoders the engine runs.

`ModelArchConfig` is the single description of a model's shape that the model code, the
weight loader and the KV cache sizing read. It is built from a Hugging Face `config.json`
(a dict or a `transformers.PretrainedConfig`) and validated at construction, so a model
that the engine cannot run is refused with a clear message before any weight is read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

_ROPE_KEYS_NOT_SCALING = ("rope_theta", "rope_type", "type", "partial_rotary_factor")
# The roles a decoder layer's norms play (engine/model/decoder.py): before attention, on the
# attention's output, before the MLP, on the MLP's output. Llama has the first and third.
NORM_ROLES = ("input", "attn_out", "mlp_in", "mlp_out")
QK_NORMS = ("head", "projection")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LLAMA_NORMS = (("input", "input_layernorm"), ("mlp_in", "post_attention_layernorm"))
MOE_ROUTERS = ("softmax_topk", "topk_softmax", "softmax_group_topk", "sigmoid_group_topk")
EXPERT_LAYOUTS = ("rows", "gpt_oss")

TokenIds = int | list[int] | None


@dataclass(frozen=True)
class ModelArchConfig:
    """What the decoder (engine/model/decoder.py) needs: one description for every family.

    A family (engine/model/families/) turns its `config.json` into these fields; the model code,
    the weight loader and the KV cache sizing read only them.

    `attention_bias` is the bias on the q/k/v projections (always on for Qwen2);
    `o_proj_bias` the bias on the output projection (Llama's `attention_bias` sets both).
    `rope_scaling` is None for plain RoPE, else a HF-format dict such as
    {"rope_type": "llama3", "factor": 8.0, ...}; `rotary_dim` (None: head_dim) the leading dims of
    each head that rotate (`partial_rotary_factor`). `sliding_window` is None for full attention;
    with it, `layer_types` says which layers slide ("sliding_attention") and which attend to the
    whole context ("full_attention"; None: every layer slides). `rope_local_theta`: the RoPE base
    of sliding layers, unscaled (Gemma 3; None: the same RoPE as full layers).

    Per family: `qk_norm` ("head": an RMSNorm over each head's dims, Qwen3 and Gemma 3;
    "projection": over the whole q / k projection, OLMo 2) before RoPE; `layer_norms`, the
    (role, Hugging Face name) of each norm in a layer (roles in NORM_ROLES); `norm_weight_offset`
    (Gemma: a norm multiplies by 1 + w); `embed_scale` (Gemma: sqrt(hidden), in the model dtype);
    `attention_scale` (None: head_dim ** -0.5); `attn_logit_softcap` / `final_logit_softcap`
    (Gemma 2: tanh soft-capping of attention scores / logits); `fused_checkpoint` (Phi-3: the
    checkpoint holds qkv_proj and gate_up_proj already fused).

    Mixture of experts (`num_experts` > 0; Mixtral, Qwen3-MoE): the MLP of each layer that
    `moe_layers` marks (None: every layer) is `num_experts` gated experts of
    `moe_intermediate_size`, of which a softmax router picks `num_experts_per_tok` per token,
    their weights renormalized to sum to 1 when `norm_topk_prob`; the other layers keep a dense
    MLP of `intermediate_size`. gpt-oss differs in four ways: `moe_router` "topk_softmax" (the
    top-k logits, then a softmax over those k), `moe_bias` (the router and every expert projection
    have a bias), `swiglu_limit` / `swiglu_alpha` (its clamped SwiGLU: `(up + 1) * gate *
    sigmoid(alpha * gate)` with gate clamped above and up both ways at the limit), and its
    checkpoint's `expert_layout` "gpt_oss" (fused [experts, hidden, 2 x intermediate] with gate and
    up columns interleaved). DeepSeek-V3's router (`moe_router` "sigmoid_group_topk"; GLM-4.5):
    sigmoid scores, to which the router's `e_score_correction_bias` is added for the choice only;
    the experts fall in `moe_num_groups` groups, of which the `moe_topk_groups` with the highest
    sum of their two best scores are eligible; the chosen scores (renormalized when
    `norm_topk_prob`) times `moe_routed_scaling` weigh the experts. DeepSeek-V2's
    ("softmax_group_topk"): softmax scores, the eligible groups those with the best single score. `moe_shared_intermediate_size`
    (0: none): a dense gated MLP every token runs beside the routed experts (`shared_experts`).
    `num_mtp_layers`: multi-token-prediction layers stored after the last layer (their tensors
    are skipped: pdserve does not run them).

    Multi-head latent attention (`kv_lora_rank` set; DeepSeek-V2/V3, Kimi K2): queries through
    `q_lora_rank` (None: one `q_proj`) of `qk_nope_head_dim + qk_rope_head_dim` per head; keys and
    values from one latent per token, `kv_lora_rank` normalized values plus `qk_rope_head_dim`
    rotated ones (`rope_interleave`: their dims in interleaved pairs, as DeepSeek stores them);
    values of `v_head_dim`. The cache holds that latent only, as one KV head whose K and V halves
    are its two halves: `num_key_value_heads` 1 and `head_dim` (kv_lora_rank + qk_rope_head_dim) / 2,
    so every part of pdserve that sizes, moves or hashes KV blocks sees exactly the latent's bytes.
    `attention_scale` then carries the softmax scale (with yarn's `mscale_all_dim` correction).
    `attention_sinks`: a learned per-head logit in every softmax's
    denominator (gpt-oss).
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
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    rotary_dim: int | None = None
    qk_norm: str | None = None
    layer_norms: tuple[tuple[str, str], ...] = LLAMA_NORMS
    norm_weight_offset: float = 0.0
    embed_scale: float | None = None
    attention_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    fused_checkpoint: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] | None = None
    moe_router: str = "softmax_topk"
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    expert_layout: str = "rows"
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    moe_routed_scaling: float = 1.0
    moe_shared_intermediate_size: int = 0
    num_mtp_layers: int = 0
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    attention_sinks: bool = False

    def __post_init__(self) -> None:
        from engine.model.families import SUPPORTED_ARCHITECTURES
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
        if self.kv_lora_rank is not None:
            self._check_latent_attention()
        elif self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"model config: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"model config: rope_theta must be > 0, got {self.rope_theta!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"model config: hidden_act {self.hidden_act!r} is not supported; pdserve runs "
                f"{', '.join(HIDDEN_ACTS)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model config: sliding_window must be >= 1 or None, got {self.sliding_window!r}")
        if self.layer_types is not None:
            unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if unknown or len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"model config: layer_types must name full_attention or sliding_attention for each of the "
                    f"{self.num_hidden_layers} layers, got {list(self.layer_types)}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"model config: the rotary dims ({self.rotary_dim}) must be even and at most "
                             f"head_dim ({self.head_dim})")
        if self.qk_norm not in (None, *QK_NORMS):
            raise ValueError(f"model config: qk_norm must be one of {', '.join(QK_NORMS)} or None, got {self.qk_norm!r}")
        roles = [role for role, _ in self.layer_norms]
        if any(role not in NORM_ROLES for role in roles) or len(set(roles)) != len(roles):
            raise ValueError(f"model config: layer norm roles must be distinct ones of {', '.join(NORM_ROLES)}, "
                             f"got {roles}")
        for name in ("attention_scale", "attn_logit_softcap", "final_logit_softcap", "embed_scale",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model config: {name} must be > 0 or None, got {value!r}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts or not (self.moe_intermediate_size or 0) > 0:
                raise ValueError(
                    f"model config: a mixture of experts needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) "
                    f"<= num_experts ({self.num_experts}) and a positive expert intermediate size "
                    f"({self.moe_intermediate_size!r})")
            if self.moe_router not in MOE_ROUTERS or self.expert_layout not in EXPERT_LAYOUTS:
                raise ValueError(f"model config: moe_router must be one of {', '.join(MOE_ROUTERS)} and "
                                 f"expert_layout one of {', '.join(EXPERT_LAYOUTS)}")
            if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
                raise ValueError("model config: the clamped SwiGLU needs both swiglu_limit and swiglu_alpha")
            if self.moe_router.endswith("group_topk"):
                groups, chosen = self.moe_num_groups, self.moe_topk_groups
                per_group = self.num_experts // groups if groups > 0 and self.num_experts % groups == 0 else 0
                if per_group < 2 or not 1 <= chosen <= groups or self.num_experts_per_tok > chosen * per_group:
                    raise ValueError(
                        f"model config: grouped routing needs n_group ({groups}) to split the {self.num_experts} "
                        f"experts into groups of at least 2, 1 <= topk_group ({chosen}) <= n_group, and "
                        f"num_experts_per_tok ({self.num_experts_per_tok}) experts within the chosen groups")
            if self.moe_shared_intermediate_size < 0:
                raise ValueError(f"model config: the shared experts' intermediate size must be >= 0, "
                                 f"got {self.moe_shared_intermediate_size}")
            if self.moe_layers is not None and len(self.moe_layers) != self.num_hidden_layers:
                raise ValueError(f"model config: moe_layers must say for each of the {self.num_hidden_layers} "
                                 f"layers whether it is a mixture of experts, got {len(self.moe_layers)}")
        _check_token_ids("bos_token_id", self.bos_token_id)
        _check_token_ids("eos_token_id", self.eos_token_id)
        _check_rope_scaling(self.rope_scaling)

    def _check_latent_attention(self) -> None:
        sizes = dict(kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                     qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        if self.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.q_lora_rank
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad or self.qk_rope_head_dim % 2:
            raise ValueError(f"model config: latent attention needs positive sizes and an even "
                             f"qk_rope_head_dim, got {sizes}")
        if (self.kv_lora_rank + self.qk_rope_head_dim) % 2:
            raise ValueError(f"model config: kv_lora_rank + qk_rope_head_dim ({self.kv_lora_rank} + "
                             f"{self.qk_rope_head_dim}) must be even: the cache stores the latent in two halves")
        if self.num_key_value_heads != 1 or 2 * self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim:
            raise ValueError("model config: a latent-attention model's cache is one KV head of half the latent")

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (the cache holds latents)."""
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """The per-head dims RoPE tables are built for: the rotated part of an MLA head, else a head."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

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

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends within `sliding_window` rather than to the whole context."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    def is_skipped_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor is one pdserve does not run: RoPE's stored inverse
        frequencies, and the multi-token-prediction layers after the last layer."""
        if name.endswith(_IGNORED_WEIGHT_SUFFIXES):
            return True
        layer = _LAYER_INDEX.match(name)
        return self.num_mtp_layers > 0 and layer is not None and int(layer.group(1)) >= self.num_hidden_layers

    def expected_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must hold, by Hugging Face name, with its shape.

        `lm_head.weight` is absent when the embeddings are tied (a checkpoint may still
        carry it; `engine.model.loader.check_weights` accepts that).
        """
        hidden, inter = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, hidden)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            for _, name in self.layer_norms:
                shapes[p + name + ".weight"] = (hidden,)
            if self.is_mla:
                shapes.update(self._latent_attention_shapes(p + "self_attn."))
            else:
                if self.fused_checkpoint:
                    shapes[p + "self_attn.qkv_proj.weight"] = (self.q_size + 2 * self.kv_size, hidden)
                else:
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
            if self.attention_sinks:
                shapes[p + "self_attn.sinks"] = (self.num_attention_heads,)
            if self.qk_norm is not None:
                per_head = self.qk_norm == "head"
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim if per_head else self.q_size,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim if per_head else self.kv_size,)
            if self.is_moe(i):  # in `canonical_weights`' naming
                experts = self.moe_intermediate_size
                shapes[p + "mlp.gate.weight"] = (self.num_experts, hidden)
                if self.moe_bias:
                    shapes[p + "mlp.gate.bias"] = (self.num_experts,)
                if self.moe_router == "sigmoid_group_topk":
                    shapes[p + "mlp.gate.e_score_correction_bias"] = (self.num_experts,)
                if self.moe_shared_intermediate_size:
                    shared = self.moe_shared_intermediate_size
                    shapes[p + "mlp.shared_experts.gate_proj.weight"] = (shared, hidden)
                    shapes[p + "mlp.shared_experts.up_proj.weight"] = (shared, hidden)
                    shapes[p + "mlp.shared_experts.down_proj.weight"] = (hidden, shared)
                for e in range(self.num_experts):
                    shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (experts, hidden)
                    shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (experts, hidden)
                    shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (hidden, experts)
                    if self.moe_bias:
                        shapes[p + f"mlp.experts.{e}.gate_proj.bias"] = (experts,)
                        shapes[p + f"mlp.experts.{e}.up_proj.bias"] = (experts,)
                        shapes[p + f"mlp.experts.{e}.down_proj.bias"] = (hidden,)
                continue
            if self.fused_checkpoint:
                shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, hidden)
            else:
                shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
                shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes["model.norm.weight"] = (hidden,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, hidden)
        return shapes

    def _latent_attention_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        hidden, heads, latent = self.hidden_size, self.num_attention_heads, self.kv_lora_rank
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = self.attention_bias
        shapes = {p + "kv_a_proj_with_mqa.weight": (latent + self.qk_rope_head_dim, hidden),
                  p + "kv_a_layernorm.weight": (latent,),
                  p + "kv_b_proj.weight": (heads * (self.qk_nope_head_dim + self.v_head_dim), latent),
                  p + "o_proj.weight": (hidden, heads * self.v_head_dim)}
        if self.q_lora_rank is None:
            shapes[p + "q_proj.weight"] = (heads * qk_head, hidden)
        else:
            shapes.update({p + "q_a_proj.weight": (self.q_lora_rank, hidden), p + "q_a_layernorm.weight": (self.q_lora_rank,),
                           p + "q_b_proj.weight": (heads * qk_head, self.q_lora_rank)})
            if bias:
                shapes[p + "q_a_proj.bias"] = (self.q_lora_rank,)
        if bias:
            shapes[p + "kv_a_proj_with_mqa.bias"] = (latent + self.qk_rope_head_dim,)
        return shapes

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelArchConfig:
        """Build from a `config.json` dict or a `transformers.PretrainedConfig`.

        Values the config leaves out get transformers' defaults for that model type, so
        the engine and transformers read the same folder the same way; the family
        (engine/model/families/) reads what is its own.
        """
        from engine.model.families import family_of

        raw = _config_to_dict(cfg)
        family, architecture, model_type = family_of(raw)
        full = _with_transformers_defaults(model_type, raw)
        config = HFConfig(full)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if full.get(key) is None:
                raise ValueError(f"model config has no {key!r}; config.json must define it")
        if config.get("mlp_bias", False):
            raise ValueError(f"model config: mlp_bias=True is not supported ({architecture} MLPs have no bias)")
        num_heads = full["num_attention_heads"]
        head_dim = config.get("head_dim", full["hidden_size"] // num_heads)
        rope_theta, rope_scaling, partial = _rope_of(full)
        fields = dict(
            architecture=architecture,
            vocab_size=full["vocab_size"],
            hidden_size=full["hidden_size"],
            intermediate_size=full["intermediate_size"],
            num_hidden_layers=full["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=config.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rotary_dim=None if partial in (None, 1.0) else int(head_dim * partial),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            o_proj_bias=bool(config.get("attention_bias", False)),
            hidden_act=config.get("hidden_act") or config.get("hidden_activation") or "silu",
            bos_token_id=full.get("bos_token_id"),
            eos_token_id=full.get("eos_token_id"),
        )
        fields.update(family.arch_fields(model_type, config))
        return cls(**fields)


class HFConfig:
    """A model's config.json with transformers' defaults filled in, as the families read it."""

    def __init__(self, full: dict) -> None:
        self.full = full

    def get(self, key: str, default: Any = None) -> Any:
        value = self.full.get(key)
        return default if value is None else value

    def sliding(self) -> tuple[int | None, tuple[str, ...] | None]:
        """(sliding_window, layer_types) as transformers applies them: no window when it covers
        every position or no layer slides; layer types only when some layers attend fully."""
        window = self.get("sliding_window")
        layer_types = self.get("layer_types")
        if window is None or window >= self.get("max_position_embeddings", 2048):
            return None, None
        if layer_types is None:
            return window, None
        layer_types = tuple(layer_types)
        if "sliding_attention" not in layer_types:
            return None, None
        return window, None if set(layer_types) == {"sliding_attention"} else layer_types

    def rope_local_theta(self) -> float | None:
        """The RoPE base of sliding layers when it differs from full layers' (Gemma 3)."""
        params = self.full.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
            local = params["sliding_attention"]
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"model config: rope scaling of sliding layers ({local.get('rope_type')!r}) "
                                 "is not supported")
            return float(local.get("rope_theta", 10000.0))
        local = self.full.get("rope_local_base_freq")
        return None if local is None else float(local)


def _config_to_dict(cfg: Any) -> dict:
    if isinstance(cfg, dict):
        return dict(cfg)
    to_dict = getattr(cfg, "to_dict", None)
    if to_dict is None:
        raise ValueError(f"expected a config.json dict or a transformers PretrainedConfig, got {type(cfg).__name__}")
    return to_dict()


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


def _rope_of(cfg: dict) -> tuple[float, dict | None, float | None]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from either config style: transformers
    5's `rope_parameters` (per layer type for Gemma 3: the full-attention layers' here) or the
    older `rope_theta` + `rope_scaling`."""
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
    partial = cfg.get("partial_rotary_factor", merged.get("partial_rotary_factor"))
    partial = None if partial is None else float(partial)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return float(theta), None, partial
    out = {"rope_type": "longrope" if rope_type == "su" else rope_type}  # Phi-3's older name
    out.update({k: v for k, v in merged.items() if k not in _ROPE_KEYS_NOT_SCALING})
    # dynamic NTK, longrope and yarn (without a factor) scale against the model's context length;
    # a top-level original length (Phi-3's) wins over the rope parameters', as in transformers
    if out["rope_type"] in ("dynamic", "longrope", "yarn"):
        if cfg.get("max_position_embeddings") is not None:
            out.setdefault("max_position_embeddings", cfg["max_position_embeddings"])
        if cfg.get("original_max_position_embeddings") is not None:
            out["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return float(theta), out, partial


def _check_rope_scaling(scaling: dict | None) -> None:
    if scaling is None:
        return
    # The one table of the rope types pdserve computes and what each needs besides rope_theta.
    from engine.model.rope import ROPE_SCALING_PARAMS

    if not isinstance(scaling, dict):
        raise ValueError(f"model config: rope_scaling must be a dict or None, got {scaling!r}")
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_SCALING_PARAMS:
        raise ValueError(
            f"model config: rope scaling type {rope_type!r} is not supported; pdserve supports "
            f"plain RoPE and {', '.join(ROPE_SCALING_PARAMS)}")
    missing = [k for k in ROPE_SCALING_PARAMS[rope_type] if scaling.get(k) is None]
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
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def check_weights(arch: ModelArchConfig, names_and_shapes: Any, source: str = "") -> None:
    """Check a checkpoint against `arch`: every expected tensor present with its shape.

    `names_and_shapes` is a mapping or an iterable of (name, shape) pairs; a shape may be
    a tuple, a `torch.Size` or anything with `.shape` (a tensor). A missing, unexpected or
    misshapen tensor raises ValueError naming it with the expected and actual shapes.
    """
    pairs = names_and_shapes.items() if hasattr(names_and_shapes, "items") else names_and_shapes
    shapes = ((name, tuple(int(d) for d in getattr(shape, "shape", shape))) for name, shape in pairs)
    actual: dict[str, tuple[int, ...]] = dict(canonical_weights(shapes, arch.expert_layout))
    expected = arch.expected_weight_shapes()
    problems = []
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            problems.append(f"tensor {name} is missing (expected shape {list(want)})")
        elif got != want:
            problems.append(f"tensor {name} has shape {list(got)}, expected {list(want)}")
    for name, got in actual.items():
        if name in expected or arch.is_skipped_weight(name):
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


_MIXTRAL_EXPERT = re.compile(r"^(.*\.experts\.\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?(\.weight)?$")


def canonical_weights(pairs: Iterable[tuple[str, Any]], expert_layout: str = "rows") -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors (or their shapes, as tuples) with experts in the one naming the decoder
    and `expected_weight_shapes` use: the router `mlp.gate.{weight,bias}` and per expert
    `mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}`, weights [out, in] as nn.Linear holds them.
    Mixtral's `block_sparse_moe` / `w1 w3 w2` names and gpt-oss's `mlp.router` are renamed;
    fused 3-D expert tensors are split per expert: transformers 5's (`expert_layout` "rows":
    `gate_up_proj` [experts, 2 x intermediate, hidden], gate rows first) or gpt-oss's ("gpt_oss":
    [experts, hidden, 2 x intermediate], gate and up columns interleaved; `down_proj` [experts,
    intermediate, hidden]; biases beside them). Every other tensor passes through unchanged."""
    for name, value in pairs:
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            match = _MIXTRAL_EXPERT.match(name)
            if match:
                name = f"{match.group(1)}.{_MIXTRAL_PROJ[match.group(2)]}.weight"
        name = name.replace(".mlp.router.", ".mlp.gate.")
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            yield name, value
            continue
        prefix, kind, bias = match.group(1), match.group(2), match.group(3) is not None
        yield from _split_experts(prefix, kind, bias, value, expert_layout == "gpt_oss")


def _split_experts(prefix: str, kind: str, bias: bool, value: Any, gpt_oss: bool) -> Iterator[tuple[str, Any]]:
    """One fused expert tensor (or shape) as per-expert (name, value) pairs; see canonical_weights."""
    is_shape = isinstance(value, tuple)
    shape = value if is_shape else tuple(value.shape)
    suffix = "bias" if bias else "weight"
    for e in range(shape[0]):
        if kind == "down_proj":
            if bias:
                piece = shape[1:] if is_shape else value[e]
            elif gpt_oss:  # [intermediate, hidden] -> [hidden, intermediate]
                piece = (shape[2], shape[1]) if is_shape else value[e].t()
            else:
                piece = shape[1:] if is_shape else value[e]
            yield f"{prefix}.{e}.down_proj.{suffix}", piece
            continue
        for index, proj in enumerate(("gate_proj", "up_proj")):
            if bias:
                half = shape[1] // 2
                piece = (half,) if is_shape else (value[e][index::2] if gpt_oss else value[e].narrow(0, index * half, half))
            elif gpt_oss:  # [hidden, 2 x intermediate], columns gate, up, gate, up, ...
                piece = (shape[2] // 2, shape[1]) if is_shape else value[e][:, index::2].t()
            else:
                half = shape[1] // 2
                piece = (half, shape[2]) if is_shape else value[e].narrow(0, index * half, half)
            yield f"{prefix}.{e}.{proj}.{suffix}", piece
