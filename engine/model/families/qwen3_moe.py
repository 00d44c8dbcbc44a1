"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with mixture-of-experts MLPs of
`moe_intermediate_size` (top `num_experts_per_tok`, renormalized only with `norm_topk_prob`) on
every `decoder_sparse_step`-th layer except `mlp_only_layers`, which keep a dense MLP."""
from __future__ import annotations

ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe"}


def arch_fields(model_type: str, config) -> dict:
    window, layer_types = config.sliding() if config.get("use_sliding_window", False) else (None, None)
    # transformers 5 writes num_experts as num_local_experts
    experts = config.get("num_local_experts", config.get("num_experts", 0))
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers", []))
    moe_layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                       for i in range(config.get("num_hidden_layers")))
    return dict(qk_norm="head", sliding_window=window, layer_types=layer_types, num_experts=experts,
                num_experts_per_tok=config.get("num_experts_per_tok"),
                moe_intermediate_size=config.get("moe_intermediate_size"),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)), moe_layers=moe_layers)
