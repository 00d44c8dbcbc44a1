"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): grouped-query attention with q/k/v biases, partial
RoPE (`partial_rotary_factor`, 0.5 by default) and optional per-head q/k norms (`use_qk_norm`);
DeepSeek-V3's mixture of experts (sigmoid scores with `e_score_correction_bias`, group-limited
top-k, `routed_scaling_factor`, `n_shared_experts` shared experts) on every layer from
`first_k_dense_replace` on, the first ones dense. Its multi-token-prediction layer is skipped."""
from __future__ import annotations

from engine.model.families.deepseek_v3 import moe_fields

ARCHITECTURES = {"Glm4MoeForCausalLM": "glm4_moe"}


def arch_fields(model_type: str, config) -> dict:
    return dict(o_proj_bias=False, qk_norm="head" if config.get("use_qk_norm", False) else None,
                **moe_fields(config))
