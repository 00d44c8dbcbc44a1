"""Phi-3: a Llama whose checkpoint holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
(split at load), with partial rotary dims, longrope scaling and an optional sliding window on
every layer."""
from __future__ import annotations

ARCHITECTURES = {"Phi3ForCausalLM": "phi3"}


def arch_fields(model_type: str, config) -> dict:
    window, _ = config.sliding()
    return dict(fused_checkpoint=True, attention_bias=False, o_proj_bias=False, sliding_window=window)
