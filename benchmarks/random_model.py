"""Write a Hugging Face folder with SmolLM2-135M's shape and seeded random weights.

For places the default model cannot reach: its GGUF (98 MB) is larger than what can be carried
to the GPU machine, and speed depends only on the shape. Each layer, the tied embedding and the
vocabulary (49152) are the real ones; the tokenizer is a word-level one whose token i is `t{i}`
(0, 1 and 2 are <unk>, <s> and </s>, the BOS and EOS) with a minimal chat template, so string,
token-id and chat prompts all work.

    python benchmarks/random_model.py /tmp/smollm2-random [--layers 30] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    pad_token_id=2,
)
# Roles as tokens t3 (system), t4 (user), t5 (assistant).
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ {'system': 't3', 'user': 't4', 'assistant': 't5'}.get(m['role'], '<unk>') }} "
                 "{{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<s> t5 {% endif %}")
# Weights drawn with this standard deviation (transformers' default is 0.02): at 0.02 a random
# model's greedy output locks onto one token; at 0.05 it moves with the context, which is what a
# token-exact comparison needs to mean something.
INITIALIZER_RANGE = 0.05


def write_tokenizer(folder: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(3, vocab_size)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "</s>", "model_max_length": SMOLLM2_135M["max_position_embeddings"],
              "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_random_model(folder: str, num_layers: int = 30, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16, **overrides) -> str:
    """Create `folder` (config.json, model.safetensors, tokenizer files); returns it.
    `overrides` replace LlamaConfig fields of the SmolLM2 shape (tests make tiny models so)."""
    import transformers
    os.makedirs(folder, exist_ok=True)
    config = transformers.LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": num_layers,
                                         "initializer_range": INITIALIZER_RANGE, **overrides})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    write_tokenizer(folder, config.vocab_size)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    print(write_random_model(args.folder, args.layers, args.seed, getattr(torch, args.dtype)))


if __name__ == "__main__":
    main()
