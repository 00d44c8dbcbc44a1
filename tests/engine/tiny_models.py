"""Tiny random Llama-family model folders that the whole engine (`LLM`) can load: config, seeded
weights and a 128-token word-level tokenizer (`t0` .. `t127`; prompts are token ids).

The weights are drawn with `initializer_range=0.2` (transformers' default 0.02 makes a 3-layer
model repeat its last prompt token forever, which would hide a broken attention), and every bias
at std 0.5, so that biases matter.
"""
from __future__ import annotations

import torch
import transformers

VOCAB = 128


def tiny_config(kind: str = "llama", **overrides) -> transformers.PretrainedConfig:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, initializer_range=0.2)
    common.update(overrides)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def save_tiny_model(folder, config: transformers.PretrainedConfig, seed: int = 0, edit=None) -> str:
    """Write a random model of `config` and the tokenizer into `folder`; returns it as a string.
    `edit(model)`, under no_grad, may set weights of its own before the model is saved."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.5)
        if edit is not None:
            edit(model)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1")
    fast.save_pretrained(folder)
    return str(folder)
