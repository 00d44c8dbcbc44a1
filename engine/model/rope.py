"""Rotary position embeddings (the "rotate half" layout Hugging Face Llama uses).

The cos/sin table is computed once in fp32 for every position up to the context length, the same
way transformers 5 computes it (`transformers.modeling_rope_utils`: `position * inv_freq` in fp32,
cos and sin multiplied by the rope type's attention factor), so logits match it to rounding.

Rope types whose transformers frequencies depend on the running sequence length (`dynamic`,
`longrope`) get one fixed table here; `RotaryEmbedding` documents the rule and where it differs.
"""
from __future__ import annotations

import math

import torch

from engine.model import fused_ops

# The one table of supported scaling rope types (HF `rope_type`; plain RoPE, "default", is a None
# scaling dict and needs nothing) -> the parameters the scaling dict must carry besides rope_theta
# (engine/model/arch.py validates configs against it). Optional ones are
# read as transformers reads them: yarn's attention_factor, beta_fast, beta_slow, mscale,
# mscale_all_dim, truncate; longrope's factor, attention_factor; any type's partial_rotary_factor.
# `max_position_embeddings` is the model config's top-level value (HF keeps it outside
# rope_parameters; the config loader copies it in): dynamic NTK scales relative to it, and
# longrope (yarn too, if factor is None) derives `factor` from it when the config has none (Phi-3).
ROPE_SCALING_PARAMS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES = ("default", *ROPE_SCALING_PARAMS)


def rope_type_of(scaling: dict | None) -> str:
    """The scaling dict's rope type ("default" for None); ValueError naming the supported ones."""
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return rope_type


def rope_parameters(rotary_dim: int, theta: float, scaling: dict | None,
                    seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] fp32, attention factor) as transformers'
    `ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)` returns them, for a head whose first
    `rotary_dim` dims rotate (transformers' `int(head_dim * partial_rotary_factor)`).

    `seq_len` matters only to `dynamic` (None: the model's max_position_embeddings, i.e. unscaled)
    and `longrope` (long factors iff seq_len > original_max_position_embeddings)."""
    rope_type = rope_type_of(scaling)
    scaling = scaling or {}
    missing = [k for k in ROPE_SCALING_PARAMS.get(rope_type, ()) if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{rope_type} rope scaling needs {', '.join(missing)}")
    dim = rotary_dim
    if rope_type == "default":
        return _default_inv_freq(dim, theta), 1.0
    if rope_type == "linear":
        return _default_inv_freq(dim, theta) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(dim, theta), scaling), 1.0
    if rope_type == "dynamic":
        return _dynamic_inv_freq(dim, theta, scaling, seq_len), 1.0
    if rope_type == "yarn":
        return _yarn_parameters(dim, theta, scaling)
    return _longrope_parameters(dim, theta, scaling, seq_len)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """inv_freq for a fully rotated head at the model's initial (unscaled-by-length) setting."""
    return rope_parameters(head_dim, theta, scaling)[0]


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic_inv_freq(dim: int, theta: float, scaling: dict, seq_len: int | None) -> torch.Tensor:
    factor = scaling["factor"]
    original = scaling["max_position_embeddings"]
    # transformers' forward passes seq_len as an int64 tensor (max(position_ids) + 1), so the base
    # is computed in fp32 tensor arithmetic; doing the same keeps the frequencies bit-identical.
    length = torch.tensor(original if seq_len is None else seq_len, dtype=torch.int64)
    length = torch.maximum(length, torch.tensor(original, dtype=torch.int64))
    base = theta * ((factor * length / original) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_get_mscale(scale: float = 1, mscale: float = 1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_parameters(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    mscale = scaling.get("mscale")
    mscale_all_dim = scaling.get("mscale_all_dim")
    original = scaling["original_max_position_embeddings"]
    if factor is None:  # DeepSeek-style: the ratio of the context lengths
        factor = _model_max_position(scaling, "yarn") / original
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)  # a stored None disables truncation, as in transformers

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _longrope_parameters(dim: int, theta: float, scaling: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:  # Phi-3: the ratio of the context lengths
        factor = _model_max_position(scaling, "longrope") / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    for name in ("short_factor", "long_factor"):
        if len(scaling[name]) != dim // 2:
            raise ValueError(f"longrope {name} has {len(scaling[name])} entries; rotary dim {dim} needs {dim // 2}")
    chosen = scaling["long_factor"] if seq_len and seq_len > original else scaling["short_factor"]
    ext_factors = torch.tensor(chosen, dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * theta ** inv_freq_shape), attention_factor


def _model_max_position(scaling: dict, rope_type: str) -> int:
    value = scaling.get("max_position_embeddings")
    if value is None:
        raise ValueError(f"{rope_type} rope scaling without factor needs the model's max_position_embeddings")
    return value


class RotaryEmbedding(torch.nn.Module):
    """RoPE for positions [0, max_position) with fp32 `cos_cache`/`sin_cache` [max_position, rotary_dim].

    Contract:
    - `head_dim`: the per-head size of query and key; `max_position`: the engine's context length
      (max_model_len), the number of table rows; positions at or past it are an error.
    - `theta`: rope_theta. `scaling`: None for plain RoPE, else a dict with `rope_type` (or legacy
      `type`) from `ROPE_SCALING_PARAMS` and that type's parameters, named as in HF configs.
    - `rotary_dim`: how many leading dims of each head rotate (rotate-half within them); the rest
      pass through unchanged. None: `int(head_dim * scaling["partial_rotary_factor"])` if the
      scaling dict carries that factor, else head_dim. Must be even and at most head_dim; frequencies
      are computed over rotary_dim, as transformers does for partial rotary.
    - The tables hold cos and sin already multiplied by the type's attention factor (yarn,
      longrope), as transformers' `cos * attention_scaling`.

    Length-dependent types, where transformers recomputes frequencies from the batch's longest
    sequence (max(position_ids) + 1) on every forward:
    - `dynamic`: rows below the model's `max_position_embeddings` use the unscaled frequencies, so
      every sequence that stays within it is served exactly as transformers serves it; rows at and
      past it use the frequencies transformers computes for seq_len = `max_position` (fixed, as
      vLLM fixes them). Differs from transformers for sequences longer than max_position_embeddings:
      transformers rotates all their positions with inv_freq(current length), recomputed as they
      grow; here their first max_position_embeddings positions keep the unscaled frequencies.
    - `longrope`: the factors transformers picks for a request of total length `max_position`:
      long_factor for every position if max_position > original_max_position_embeddings, else
      short_factor. Identical to transformers whenever that is the factor set it would use, i.e.
      always when max_position <= original_max_position_embeddings; with a longer max_position,
      sequences that stay within the original length get long factors here, short in transformers.
      The attention factor does not depend on the length (as in transformers).
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        partial = (scaling or {}).get("partial_rotary_factor")
        implied = head_dim if partial is None else int(head_dim * partial)
        if rotary_dim is None:
            rotary_dim = implied
        elif partial is not None and rotary_dim != implied:
            raise ValueError(f"rotary_dim {rotary_dim} contradicts partial_rotary_factor {partial} "
                             f"(head_dim {head_dim} -> {implied})")
        if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        rope_type = rope_type_of(scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        if rope_type == "dynamic":
            inv_freq, attention = rope_parameters(rotary_dim, theta, scaling)
            freqs = positions[:, None] * inv_freq[None, :]
            original = scaling["max_position_embeddings"]
            if max_position > original:
                long_inv_freq, _ = rope_parameters(rotary_dim, theta, scaling, seq_len=max_position)
                freqs[original:] = positions[original:, None] * long_inv_freq[None, :]
        else:
            inv_freq, attention = rope_parameters(rotary_dim, theta, scaling, seq_len=max_position)
            freqs = positions[:, None] * inv_freq[None, :]
        self.attention_scaling = attention
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cache", emb.cos() * attention, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, Hq, head_dim], key [T, Hk, head_dim] -> rotated copies."""
        if self.rotary_dim == self.head_dim:
            return fused_ops.rotary(positions, query, key, self.cos_cache, self.sin_cache)
        d = self.rotary_dim
        q_rot, k_rot = fused_ops.rotary(positions, query[..., :d], key[..., :d], self.cos_cache, self.sin_cache)
        return torch.cat([q_rot, query[..., d:]], dim=-1), torch.cat([k_rot, key[..., d:]], dim=-1)
