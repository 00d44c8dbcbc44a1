"""Inter-token latency of running decodes while long prompts arrive, with and without a step-time
target (`max_step_ms`), on the offline engine (one process, no serving overhead).

    python benchmarks/itl_under_prefill.py [--decodes 8] [--prompt-tokens 2048] [--prompts 4]
                                           [--max-step-ms 80] [--json out.json]

`decodes` requests decode continuously; every `gap` steps a `prompt-tokens` prompt arrives. Each
step that carries decodes is one inter-token interval for them: the table gives its p50 / p99
(interpolated, as benchmarks/serve.py's) / max over n such steps, the decode-only step time, and
the time to the first token of the long prompts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import percentile, run_metadata  # noqa: E402
from engine import cpu_kernels  # noqa: E402


def itl_summary(itl_s: list[float]) -> dict:
    """p50 / p99 / max (ms) of the inter-token intervals `itl_s` (seconds, at least one), with
    percentiles interpolated between ranks (benchmarks.common.percentile), and their count n."""
    ms = sorted(1000 * t for t in itl_s)
    return {"itl_p50_ms": percentile(ms, 50), "itl_p99_ms": percentile(ms, 99), "itl_max_ms": ms[-1],
            "itl_n": len(ms)}


def run(max_step_ms: float | None, args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams
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
    return {"max_step_ms": max_step_ms, **itl_summary(itl),
            "decode_only_step_ms": 1000 * statistics.median(decode_only),
            "long_prompt_ttft_s": statistics.mean(ttft) if ttft else None, "steps_with_prefill": len(itl)}


def format_table(rows: list[dict]) -> str:
    """The printed table: one line per row of run(), n (the ITL samples) next to the percentiles."""
    lines = [f"{'max_step_ms':>12} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9} {'n':>5} {'decode-only':>12} "
             f"{'TTFT long':>10}"]
    for row in rows:
        ttft = "-" if row["long_prompt_ttft_s"] is None else f"{row['long_prompt_ttft_s']:.2f}s"
        lines.append(f"{str(row['max_step_ms']):>12} {row['itl_p50_ms']:>7.1f}ms {row['itl_p99_ms']:>7.1f}ms "
                     f"{row['itl_max_ms']:>7.1f}ms {row['itl_n']:>5} {row['decode_only_step_ms']:>10.1f}ms "
                     f"{ttft:>10}")
    return "\n".join(lines)


def results_document(args: argparse.Namespace, rows: list[dict]) -> dict:
    """The JSON file: the CPU (its model name, and the SIMD features the kernels use), what was run
    (`run`: commit, command line, time, Python), the arguments and the rows."""
    run_info = run_metadata()
    return {"cpu": run_info["cpu_model"], "cpu_features": cpu_kernels.cpu_features(), "run": run_info,
            "args": vars(args), "rows": rows}


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
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results_document(args, rows), out, indent=2)


if __name__ == "__main__":
    main()
