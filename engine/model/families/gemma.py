"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), four norms per layer (before and
after attention and the MLP) that multiply by 1 + w, GeGLU (gelu-tanh) MLPs, attention scaled by
`query_pre_attn_scalar ** -0.5`, sliding and full layers (`layer_types`). Gemma 2 soft-caps
attention scores and the final logits; Gemma 3 normalizes each head's q and k instead (with
1 + w too) and gives its sliding layers their own RoPE base (`rope_local_base_freq`)."""
from __future__ import annotations

ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}

_NORMS = (("input", "input_layernorm"), ("attn_out", "post_attention_layernorm"),
          ("mlp_in", "pre_feedforward_layernorm"), ("mlp_out", "post_feedforward_layernorm"))


def arch_fields(model_type: str, config) -> dict:
    window, layer_types = config.sliding()
    fields = dict(
        layer_norms=_NORMS, norm_weight_offset=1.0, embed_scale=config.get("hidden_size") ** 0.5,
        attention_scale=float(config.get("query_pre_attn_scalar", config.get("head_dim"))) ** -0.5,
        attn_logit_softcap=config.get("attn_logit_softcapping"),
        final_logit_softcap=config.get("final_logit_softcapping"),
        sliding_window=window, layer_types=layer_types)
    if model_type == "gemma3_text":
        fields.update(qk_norm="head", rope_local_theta=config.rope_local_theta() if window else None)
    return fields
