"""DeepSeek-V2 / V2.5 / V2-Lite (`DeepseekV2ForCausalLM`): DeepSeek-V3's multi-head latent
attention (engine/model/families/deepseek_v3.py; its RoPE dims always interleaved) and shared
experts, with a softmax router: `topk_method` "greedy" (the top k of every expert's score, as
V2-Lite) or "group_limited_greedy" (the top k within the `topk_group` of `n_group` groups whose
best score is highest, as V2), times `routed_scaling_factor`. A config that renormalizes the
chosen weights (`norm_topk_prob`), scores another way or spaces its expert layers
(`moe_layer_freq` > 1) is refused: transformers and DeepSeek's own code read those differently,
and no released checkpoint sets them."""
from __future__ import annotations

from engine.model.families.deepseek_v3 import latent_attention_fields, moe_fields

ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2"}
TOPK_METHODS = {"greedy": "softmax_topk", "group_limited_greedy": "softmax_group_topk"}


def arch_fields(model_type: str, config) -> dict:
    method = config.get("topk_method", "greedy")
    if method not in TOPK_METHODS:
        raise ValueError(f"model config: DeepSeek-V2 topk_method {method!r} is not supported; pdserve runs "
                         f"{', '.join(TOPK_METHODS)}")
    if config.get("scoring_func", "softmax") != "softmax" or config.get("norm_topk_prob", False) \
            or (config.get("moe_layer_freq") or 1) != 1:
        raise ValueError("model config: DeepSeek-V2 with scoring_func other than softmax, norm_topk_prob=true or "
                         "moe_layer_freq > 1 is not supported (no released checkpoint has them)")
    fields = {**moe_fields(config, first_dense_default=0), "moe_router": TOPK_METHODS[method], "norm_topk_prob": False}
    if method == "greedy":
        fields.update(moe_num_groups=1, moe_topk_groups=1)
    return dict(**latent_attention_fields(config), rope_interleave=True, **fields)
