"""What a mixture of experts costs to decode on CPU: a Qwen3-MoE-shaped model against a dense Qwen3
with the same active parameters per token (its MLP as wide as the top-k experts together), both
random, through the offline engine. Reports each model's weight bytes and its decode step time at
batch 1 and 16 (the wall time of the decode steps after a short prefill, per step).

    python benchmarks/moe_decode.py [--experts 8] [--top-k 2] [--expert-size 512] [--steps 48]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.common import run_metadata  # noqa: E402
from benchmarks.random_model import write_tokenizer  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=1024, initializer_range=0.05, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _save(config: transformers.PretrainedConfig, folder: str) -> str:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):  # Qwen3-MoE starts its routers at 0: all tokens to expert 0
                param.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    write_tokenizer(folder, config.vocab_size)
    return folder


def _decode_step_ms(folder: str, batch: int, steps: int) -> tuple[float, int]:
    from engine import LLM, SamplingParams
    prompt_len = 16
    prompts = [[3 + (7 * i + j) % 4000 for j in range(prompt_len)] for i in range(batch)]
    with LLM(folder, num_blocks=512, block_size=16) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        long = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, short, use_tqdm=False)
        prefill_and_one = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompts, long, use_tqdm=False)
        total = time.perf_counter() - start
        weight_bytes = llm.engine.runner.weight_bytes
    return (total - prefill_and_one) / steps * 1000, weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        moe = _save(transformers.Qwen3MoeConfig(num_experts=args.experts, num_experts_per_tok=args.top_k,
                                                moe_intermediate_size=args.expert_size, norm_topk_prob=True,
                                                intermediate_size=args.expert_size * args.top_k, **SHAPE),
                    os.path.join(tmp, "moe"))
        dense = _save(transformers.Qwen3Config(intermediate_size=args.expert_size * args.top_k, **SHAPE),
                      os.path.join(tmp, "dense"))
        results = {}
        for name, folder in (("moe", moe), ("dense", dense)):
            for batch in (1, 16):
                ms, weight_bytes = _decode_step_ms(folder, batch, args.steps)
                results[f"{name}_batch{batch}_step_ms"] = round(ms, 2)
            results[f"{name}_weight_bytes"] = weight_bytes
    print(json.dumps({"args": vars(args), "results": results, **run_metadata()}, indent=1))


if __name__ == "__main__":
    main()
