"""Qwen3: a Llama with an RMSNorm over each head's q and k before RoPE (`q_norm`, `k_norm`), and
sliding layers only with `use_sliding_window`."""
from __future__ import annotations

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3"}


def arch_fields(model_type: str, config) -> dict:
    window, layer_types = config.sliding() if config.get("use_sliding_window", False) else (None, None)
    return dict(qk_norm="head", sliding_window=window, layer_types=layer_types)
