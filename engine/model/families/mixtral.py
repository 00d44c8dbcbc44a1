"""Mixtral: a Mistral whose MLPs are mixtures of experts (`num_local_experts`, top
`num_experts_per_tok`, weights renormalized), each expert of `intermediate_size`; its checkpoint
names them `block_sparse_moe` (engine.model.arch.canonical_weights)."""
from __future__ import annotations

ARCHITECTURES = {"MixtralForCausalLM": "mixtral"}


def arch_fields(model_type: str, config) -> dict:
    window, _ = config.sliding()
    return dict(attention_bias=False, o_proj_bias=False, sliding_window=window,
                num_experts=config.get("num_local_experts"), num_experts_per_tok=config.get("num_experts_per_tok"),
                moe_intermediate_size=config.get("intermediate_size"), norm_topk_prob=True)
