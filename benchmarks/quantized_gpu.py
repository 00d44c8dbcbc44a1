"""Quantized checkpoints served as stored against the same checkpoints dequantized at load.

A SmolLM2-135M-shaped random model (random_model.py; bf16) is written as an fp8 checkpoint with
128x128 block scales (DeepSeek-V3 / Qwen3 FP8's format), as AWQ and as GPTQ (4-bit, group 64)
by `engine.model.quant_formats.save_quantized_copy`. Each is run twice on the same device, with
`--quantization none` (weights dequantized to bf16 at load: the reference) and kept as stored
(the Triton kernels on CUDA), and reports: the weights held, greedy agreement over a batch of
prompts (tokens equal until the first difference, of all generated), the decode step at batch 1
and 64 (512-token context), and offline throughput on 64 prompts x 256 in / 64 out.

    python benchmarks/quantized_gpu.py [--device cuda] [--formats fp8,awq,gptq] [--json out.json]
    python benchmarks/quantized_gpu.py --device cpu --layers 2 --smoke   # the reference path, to check
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.random_model import write_random_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model.quant_formats import QuantFormat, save_quantized_copy  # noqa: E402

FORMATS = {"fp8": QuantFormat("fp8", block=(128, 128)), "awq": QuantFormat("awq", group_size=64),
           "gptq": QuantFormat("gptq", group_size=64, zero_offset=1)}


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _decode_step_ms(llm: LLM, batch: int, context: int, vocab: int) -> float:
    """Mean time per generated token of `batch` sequences after a `context`-token prompt each."""
    prompts = _prompts(batch, context, vocab, seed=batch)
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)  # prefill, cached
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=17, ignore_eos=True), use_tqdm=False)
    elapsed = time.perf_counter() - started
    first = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)  # the cached prefix hit
    return (elapsed - (time.perf_counter() - first)) / 16 * 1000


def run_one(folder: str, quantization: str, device: str, smoke: bool, vocab: int) -> dict:
    with LLM(folder, device=device, dtype="bfloat16", quantization=quantization) as llm:
        greedy = llm.generate(_prompts(4 if smoke else 32, 64, vocab, seed=1),
                              SamplingParams(max_tokens=8 if smoke else 32, temperature=0.0), use_tqdm=False)
        result = {"weight_bytes": llm.engine.runner.weight_bytes, "greedy": [out.token_ids for out in greedy]}
        batches = (1,) if smoke else (1, 64)
        result["decode_step_ms"] = {batch: _decode_step_ms(llm, batch, 64 if smoke else 512, vocab) for batch in batches}
        prompts = _prompts(4 if smoke else 64, 32 if smoke else 256, vocab, seed=2)
        started = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=8 if smoke else 64, ignore_eos=True), use_tqdm=False)
        elapsed = time.perf_counter() - started
        result["output_tok_s"] = sum(len(out.token_ids) for out in outs) / elapsed
    return result


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, int]:
    """(tokens equal until each sequence's first difference, tokens generated) summed."""
    same = 0
    for a, b in zip(reference, other):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same, sum(len(a) for a in reference)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--formats", default="fp8,awq,gptq")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--model-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pdserve-quantized"))
    parser.add_argument("--smoke", action="store_true", help="a few tokens, to check the script")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    source = os.path.join(args.model_dir, f"bf16-{args.layers}")
    if not os.path.isfile(os.path.join(source, "config.json")):
        write_random_model(source, args.layers)
    vocab = 49152
    results = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "formats": {}}
    for name in args.formats.split(","):
        folder = os.path.join(args.model_dir, f"{name}-{args.layers}")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            save_quantized_copy(source, folder, FORMATS[name])
        reference = run_one(folder, "none", args.device, args.smoke, vocab)
        kept = run_one(folder, name, args.device, args.smoke, vocab)
        same, total = agreement(reference.pop("greedy"), kept.pop("greedy"))
        results["formats"][name] = {"dequantized": reference, "kept": kept, "greedy_agreement": [same, total]}
        print(f"{name}: weights {kept['weight_bytes'] / 2**20:.1f} MiB kept vs {reference['weight_bytes'] / 2**20:.1f} "
              f"dequantized; greedy agreement {same}/{total}; decode step ms " +
              ", ".join(f"batch {b}: {kept['decode_step_ms'][b]:.2f} vs {reference['decode_step_ms'][b]:.2f}"
                        for b in kept["decode_step_ms"]) +
              f"; output tok/s {kept['output_tok_s']:.0f} vs {reference['output_tok_s']:.0f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
