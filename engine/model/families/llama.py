"""Llama 2/3 (and SmolLM2), Mistral and Qwen2: the plain decoder. Qwen2 has a bias on q/k/v but
not on o_proj; Mistral's `sliding_window` applies to every layer; Qwen2's only with
`use_sliding_window`, to the layers its `layer_types` say."""
from __future__ import annotations

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def arch_fields(model_type: str, config) -> dict:
    if model_type == "qwen2":
        window, layer_types = config.sliding() if config.get("use_sliding_window", False) else (None, None)
        return dict(attention_bias=True, o_proj_bias=False, sliding_window=window, layer_types=layer_types)
    if model_type == "mistral":
        window, _ = config.sliding()
        return dict(attention_bias=False, o_proj_bias=False, sliding_window=window)
    return {}
