"""Inter-token latency of running decodes while long prompts arrive, with and without a step-time
target (`max_step_ms`), on the offline engine (one process, no serving overhead).

    python benchmarks/itl_under_prefill.py [--decodes 8] [--prompt-tokens 2048] [--prompts 4]
                                           [--max-step-ms 80] [--json out.json]

`decodes` requests decode continuously; every `gap` steps a `prompt-tokens` prompt arrives. Each
step that carries decodes is one inter-token interval for them: the table gives its p50 / p99 /
max, the decode-only step time, and the time to the first token of the long prompts.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from engine import LLM, SamplingParams
from engine import cpu_kernels


def run(max_step_ms: float | None, args: argparse.Namespace) -> dict:
    llm = LLM("default", max_num_batched_tokens=args.budget, max_step_ms=max_step_ms, enable_prefix_caching=False)
    engine = llm.engine
    vocab = llm.tokenizer.vocab_size
    decode_params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(args.decodes):
        engine.add(engine.make_request([(i * 31 + j) % (vocab - 10) + 5 for j in range(32)], decode_params))
    itl, decode_only, ttft = [], [], []
    for warm_up in range(20):  # warm up, and let the cost model see decode-only steps
        started = time.perf_counter()
        engine.step()
        if warm_up >= 10:
            decode_only.append(time.perf_counter() - started)
    pending: dict[str, float] = {}
    prompt_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    arrivals = 0
    for step in range(args.steps):
        if step % args.gap == 0 and arrivals < args.prompts:
            request = engine.make_request([(arrivals * 7 + j) % (vocab - 10) + 5 for j in range(args.prompt_tokens)],
                                          prompt_params)
            engine.add(request)
            pending[request.request_id] = time.perf_counter()
            arrivals += 1
        started = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - started
        (itl if pending else decode_only).append(elapsed)
        for delta in deltas:
            if delta.request_id in pending and delta.finished:
                ttft.append(time.perf_counter() - pending.pop(delta.request_id))
        if arrivals == args.prompts and not pending:
            break
    ms = sorted(1000 * t for t in itl)
    return {"max_step_ms": max_step_ms, "itl_p50_ms": statistics.median(ms), "itl_p99_ms": ms[int(0.99 * (len(ms) - 1))],
            "itl_max_ms": ms[-1], "decode_only_step_ms": 1000 * statistics.median(decode_only),
            "long_prompt_ttft_s": statistics.mean(ttft) if ttft else None, "steps_with_prefill": len(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--gap", type=int, default=10, help="steps between long prompts")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--max-step-ms", type=float, default=80.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [run(None, args), run(args.max_step_ms, args)]
    print(f"{'max_step_ms':>12} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9} {'decode-only':>12} {'TTFT long':>10}")
    for row in rows:
        print(f"{str(row['max_step_ms']):>12} {row['itl_p50_ms']:>7.1f}ms {row['itl_p99_ms']:>7.1f}ms "
              f"{row['itl_max_ms']:>7.1f}ms {row['decode_only_step_ms']:>10.1f}ms {row['long_prompt_ttft_s']:>9.2f}s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": platform.processor() or platform.machine(), "cpu_features": cpu_kernels.cpu_features(),
                       "args": vars(args), "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
