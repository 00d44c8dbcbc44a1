"""OLMo 2: no norm before attention or the MLP; each one's output is normalized before the residual
add (`post_attention_layernorm`, `post_feedforward_layernorm`), and q and k are normalized over
the whole projection (all heads at once) before RoPE."""
from __future__ import annotations

ARCHITECTURES = {"Olmo2ForCausalLM": "olmo2"}

_NORMS = (("attn_out", "post_attention_layernorm"), ("mlp_out", "post_feedforward_layernorm"))


def arch_fields(model_type: str, config) -> dict:
    return dict(qk_norm="projection", layer_norms=_NORMS)
