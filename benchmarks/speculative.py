"""Speculative decoding (n-gram prompt lookup) against plain decoding, offline, in one run.

Workloads (benchmarks/workloads.py, seeded, chat-templated, greedy, ending at EOS or their budget):
  code_edit  rename a variable in a Python function: the answer repeats most of the prompt
  json_echo  return a JSON record with one field changed: the same
  chat       sentences of common words: an answer with little to copy (the control)

Each workload runs on one engine without speculation and one with `--speculative ngram`, at
concurrency 1 (one request at a time: the latency a single user sees) and at `--concurrency`
(a closed loop keeping that many requests in flight), and reports for each: output tokens/s,
the decode time per output token (TPOT, after the first token), tokens per sequence-step (how
many tokens a request gains per engine step it takes part in: 1 without speculation), the draft
acceptance rate, and the speedups (TPOT and throughput, plain / speculative). Outputs must be
token-identical between the two engines (greedy); the report says whether they were.

    python benchmarks/speculative.py [--requests 8] [--concurrency 8] [--num-speculative-tokens 4]
        [--workloads code_edit,json_echo,chat] [--json out.json] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import WorkloadConfig, build_workload  # noqa: E402
from engine import LLM, SamplingParams, cpu_kernels  # noqa: E402

WORKLOADS = ("code_edit", "json_echo", "chat")


@dataclass
class Record:
    tokens: list[int] = field(default_factory=list)
    first: float | None = None
    end: float | None = None
    steps_after_first: int = 0  # engine steps that gave this request tokens, after its first


def run(llm: LLM, prompts: list, max_tokens: list[int], concurrency: int) -> dict:
    """Greedy generation of every prompt, at most `concurrency` in flight (a closed loop)."""
    engine = llm.engine
    before = engine.scheduler.stats()
    pending = list(zip(prompts, max_tokens))
    order: list[str] = []
    active: dict[str, Record] = {}
    done: dict[str, Record] = {}
    started = time.perf_counter()
    while pending or active:
        while pending and len(active) < concurrency:
            prompt, limit = pending.pop(0)
            request = engine.make_request(prompt, SamplingParams(max_tokens=limit, temperature=0.0))
            engine.add(request, detokenize=False)
            order.append(request.request_id)
            active[request.request_id] = Record()
        for delta in engine.step():
            record = active[delta.request_id]
            now = time.perf_counter()
            if delta.new_token_ids:
                if record.first is None:
                    record.first = now
                else:
                    record.steps_after_first += 1
                record.tokens.extend(delta.new_token_ids)
            if delta.finished:
                if delta.error:
                    raise RuntimeError(f"{delta.request_id} failed: {delta.error}")
                record.end = now
                done[delta.request_id] = active.pop(delta.request_id)
    seconds = time.perf_counter() - started
    after = engine.scheduler.stats()
    records = [done[request_id] for request_id in order]
    decode_tokens = sum(len(r.tokens) - 1 for r in records)
    steps = sum(r.steps_after_first for r in records)
    tpots = [(r.end - r.first) / (len(r.tokens) - 1) for r in records if len(r.tokens) > 1]
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {"outputs": [r.tokens for r in records], "output_tokens": sum(len(r.tokens) for r in records),
            "seconds": seconds, "output_tps": sum(len(r.tokens) for r in records) / seconds,
            "tpot_ms_mean": 1000 * statistics.fmean(tpots) if tpots else None,
            "tokens_per_step": decode_tokens / steps if steps else None,
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}


def compare(plain: LLM, spec: LLM, prompts: list, max_tokens: list[int], concurrency: int) -> dict:
    run(plain, prompts[:1], [4], 1)  # warm-up: first-call costs of both engines
    run(spec, prompts[:1], [4], 1)
    base = run(plain, prompts, max_tokens, concurrency)
    fast = run(spec, prompts, max_tokens, concurrency)
    identical = base.pop("outputs") == fast.pop("outputs")
    return {"plain": base, "speculative": fast, "identical_outputs": identical,
            "tpot_speedup": base["tpot_ms_mean"] / fast["tpot_ms_mean"] if fast["tpot_ms_mean"] else None,
            "throughput_speedup": fast["output_tps"] / base["output_tps"]}


def prompts_of(name: str, count: int, config: WorkloadConfig, seed: int) -> tuple[list, list[int]]:
    workload = build_workload(name, count, config, seed)
    turns = [c.turns[0] for c in workload.conversations]
    return [[{"role": "user", "content": t.content}] for t in turns], [t.max_tokens for t in turns]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--requests", type=int, default=8, help="requests per workload and concurrency")
    parser.add_argument("--concurrency", type=int, default=8, help="the batched run's requests in flight")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CI size: 2 requests, short answers")
    args = parser.parse_args()
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    requests, concurrency = (2, 2) if args.smoke else (args.requests, args.concurrency)
    config = WorkloadConfig(edit_output_len=24, json_output_len=24, chat_output_max=24) if args.smoke \
        else WorkloadConfig(chat_output_median=160, chat_output_sigma=0.2, chat_output_max=256)
    common = dict(dtype=args.dtype, num_blocks=1024)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, **common, speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens,
               prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    report = {"cpu": cpu_kernels.cpu_model(), "cores": os.cpu_count(), "model": args.model,
              "dtype": str(plain.engine.runner.dtype).removeprefix("torch."),
              "num_speculative_tokens": args.num_speculative_tokens,
              "prompt_lookup": [args.prompt_lookup_min, args.prompt_lookup_max], "results": {}}
    print(f"{report['cpu']}, {report['cores']} cores, {report['dtype']}, k={args.num_speculative_tokens}")
    print(f"{'workload':<11}{'conc':>5}{'plain tok/s':>13}{'spec tok/s':>12}{'TPOT ms':>15}{'tok/step':>10}"
          f"{'accept':>8}{'TPOT x':>8}{'tput x':>8}  identical")
    for name in names:
        prompts, max_tokens = prompts_of(name, requests, config, args.seed)
        for level in sorted({1, concurrency}):
            row = compare(plain, spec, prompts, max_tokens, level)
            report["results"][f"{name}@{level}"] = row
            p, s = row["plain"], row["speculative"]
            accept = f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] is not None else "-"
            print(f"{name:<11}{level:>5}{p['output_tps']:>13.1f}{s['output_tps']:>12.1f}"
                  f"{p['tpot_ms_mean']:>8.1f}/{s['tpot_ms_mean']:<6.1f}{s['tokens_per_step']:>10.2f}{accept:>8}"
                  f"{row['tpot_speedup']:>8.2f}{row['throughput_speedup']:>8.2f}  {row['identical_outputs']}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
