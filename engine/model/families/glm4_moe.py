"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): grouped-query attention with q/k/v biases, partial
RoPE (`partial_rotary_factor`, 0.5 by default) and optional per-head q/k norms (`use_qk_norm`);
DeepSeek-V3's mixture of experts (sigmoid scores with `e_score_correction_bias`, group-limited
top-k, `routed_scaling_factor`, `n_shared_experts` shared experts) on every layer from
`first_k_dense_replace` on, the first ones dense. Its multi-token-prediction layer is skipped."""
from __future__ import annotations

ARCHITECTURES = {"Glm4MoeForCausalLM": "glm4_moe"}


def arch_fields(model_type: str, config) -> dict:
    layers, dense = config.get("num_hidden_layers"), config.get("first_k_dense_replace", 1)
    experts = config.get("n_routed_experts", config.get("num_local_experts", 0))
    return dict(o_proj_bias=False, qk_norm="head" if config.get("use_qk_norm", False) else None,
                num_experts=experts, num_experts_per_tok=config.get("num_experts_per_tok"),
                moe_intermediate_size=config.get("moe_intermediate_size"), moe_router="sigmoid_group_topk",
                norm_topk_prob=bool(config.get("norm_topk_prob", True)), moe_layers=tuple(i >= dense for i in range(layers)),
                moe_num_groups=config.get("n_group", 1), moe_topk_groups=config.get("topk_group", 1),
                moe_routed_scaling=float(config.get("routed_scaling_factor", 1.0)),
                moe_shared_intermediate_size=config.get("moe_intermediate_size") * config.get("n_shared_experts", 0),
                num_mtp_layers=config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)))
