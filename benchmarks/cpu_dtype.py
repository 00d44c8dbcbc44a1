"""Decode-step and prefill time of the default model per dtype on this CPU (float32 vs bfloat16):
what `--dtype bfloat16` buys or costs here; with `--quantization none gguf`, also with its GGUF's
Q4_1 / Q8_0 weights kept as stored (`--quantization gguf`; reported as e.g. `float32+gguf`).

    python benchmarks/cpu_dtype.py --dtypes float32 bfloat16 --threads 2
    python benchmarks/cpu_dtype.py --dtypes float32 --quantization none gguf --batches 1 4 16

A decode step is (time of 33 greedy tokens - time of 1) / 32, after 256-token prompts; prefill is
one 1024-token prompt with max_tokens=1. `PDSERVE_FUSED_OPS=0` shows the torch-only path.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from engine import LLM, SamplingParams
from engine.cpu_kernels import cpu_features, cpu_model


def measure(dtype: str, batches: list[int], prefill_len: int = 1024, context: int = 256, steps: int = 32,
            quantization: str = "none") -> dict:
    llm = LLM("default", device="cpu", dtype=dtype, quantization=quantization)
    generator = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(100, 40000, (length,), generator=generator).tolist() for _ in range(n)]

    def timed(batch: list[list[int]], tokens: int) -> float:
        started = time.perf_counter()
        llm.generate(batch, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0), use_tqdm=False)
        return time.perf_counter() - started

    timed(prompts(1, 64), 2)  # warm-up
    result = {"weight_bytes": float(llm.engine.runner.weight_bytes),
              f"prefill_{prefill_len}_ms": timed(prompts(1, prefill_len), 1) * 1e3}
    for batch in batches:
        batch_prompts = prompts(batch, context)
        timed(batch_prompts, 1)
        result[f"decode_step_batch{batch}_ms"] = (timed(batch_prompts, steps + 1) - timed(batch_prompts, 1)) / steps * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "auto", "gguf", "int8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--smoke", action="store_true", help="a CI-sized run (short prompts, 2 steps)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU features: {' '.join(cpu_features())}; {args.threads} threads")
    sizes = dict(prefill_len=64, context=16, steps=2) if args.smoke else {}
    report = {"cpu_features": cpu_features(), "threads": args.threads, "dtypes": {}}
    report["cpu_model"] = cpu_model()
    for dtype in args.dtypes:
        for quantization in args.quantization:
            name = dtype if quantization == "none" else f"{dtype}+{quantization}"
            figures = measure(dtype, args.batches, quantization=quantization, **sizes)
            report["dtypes"][name] = figures
            print(name, "  ".join(f"{key} {value:.1f}" for key, value in figures.items()), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
