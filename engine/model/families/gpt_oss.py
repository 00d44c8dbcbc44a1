"""gpt-oss: attention with biases and learned sinks, sliding and full layers (`layer_types`), yarn
RoPE, and mixture-of-experts MLPs whose router takes the top-k logits then their softmax, whose
experts have biases and a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`), stored fused with gate
and up interleaved (engine.model.arch.canonical_weights). Its MXFP4 release checkpoints are
refused at load (their tensors are not float); dequantized ones load."""
from __future__ import annotations

ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}


def arch_fields(model_type: str, config) -> dict:
    window, layer_types = config.sliding()
    return dict(attention_bias=True, o_proj_bias=True, attention_sinks=True, sliding_window=window,
                layer_types=layer_types, num_experts=config.get("num_local_experts"),
                num_experts_per_tok=config.get("num_experts_per_tok"),
                moe_intermediate_size=config.get("intermediate_size"), moe_router="topk_softmax", moe_bias=True,
                swiglu_alpha=float(config.get("swiglu_alpha", 1.702)), swiglu_limit=float(config.get("swiglu_limit", 7.0)),
                expert_layout="gpt_oss")
