"""DeepSeek-V3 / R1 and Kimi K2 (`DeepseekV3ForCausalLM`): multi-head latent attention (a cache of
one `kv_lora_rank + qk_rope_head_dim` latent per token; queries through `q_lora_rank`, or one
`q_proj` without it, as in V2-Lite's shape; RoPE dims interleaved unless `rope_interleave` is
false; yarn's `mscale_all_dim` folded into the softmax scale), and DeepSeek-V3's mixture of
experts (`moe_fields`, which GLM-4.5 shares) from layer `first_k_dense_replace` on. The
multi-token-prediction layer is skipped."""
from __future__ import annotations

import math

ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3"}


def moe_fields(config, first_dense_default: int = 1) -> dict:
    """DeepSeek-V3's experts: sigmoid scores with `e_score_correction_bias`, `n_group` groups of
    which `topk_group` are eligible, `routed_scaling_factor`, `n_shared_experts` shared experts,
    the first `first_k_dense_replace` layers dense."""
    layers, dense = config.get("num_hidden_layers"), config.get("first_k_dense_replace", first_dense_default)
    inter = config.get("moe_intermediate_size")
    return dict(num_experts=config.get("n_routed_experts", config.get("num_local_experts", 0)),
                num_experts_per_tok=config.get("num_experts_per_tok"), moe_intermediate_size=inter,
                moe_router="sigmoid_group_topk", norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                moe_layers=tuple(i >= dense for i in range(layers)),
                moe_num_groups=config.get("n_group") or 1, moe_topk_groups=config.get("topk_group") or 1,
                moe_routed_scaling=float(config.get("routed_scaling_factor", 1.0)),
                moe_shared_intermediate_size=inter * (config.get("n_shared_experts") or 0),
                num_mtp_layers=config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)) or 0)


def softmax_scale(qk_head_dim: int, rope: dict | None) -> float:
    """1/sqrt(qk_head_dim), times yarn's mscale(factor, mscale_all_dim) squared where set."""
    scale = qk_head_dim ** -0.5
    rope = rope or {}
    factor, all_dim = rope.get("factor") or 1.0, rope.get("mscale_all_dim")
    if rope.get("rope_type", rope.get("type", "default")) != "default" and all_dim and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def arch_fields(model_type: str, config) -> dict:
    return dict(**latent_attention_fields(config), rope_interleave=bool(config.get("rope_interleave", True)),
                **moe_fields(config))


def latent_attention_fields(config) -> dict:
    """Multi-head latent attention's fields, which DeepSeek-V2 shares."""
    latent, rope = config.get("kv_lora_rank"), config.get("qk_rope_head_dim")
    nope = config.get("qk_nope_head_dim")
    return dict(kv_lora_rank=latent, q_lora_rank=config.get("q_lora_rank"), qk_nope_head_dim=nope,
                qk_rope_head_dim=rope, v_head_dim=config.get("v_head_dim"),
                num_key_value_heads=1, head_dim=(latent + rope) // 2,
                attention_scale=softmax_scale(nope + rope, config.get("rope_parameters") or config.get("rope_scaling")))
