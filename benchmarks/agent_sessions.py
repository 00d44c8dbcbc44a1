"""Idle agent sessions and the host cache tier (KV offload): one engine with and without it.

A fleet of agent sessions runs turn by turn: each turn resends the session's whole history (a
long system prompt of its own, then every earlier tool result and answer) plus a new tool
result, and generates a short answer. All sessions' turn t are submitted together (at most
`--max-running` run at once), then turn t + 1. The device KV pool holds `--max-running` full
histories and not many more, so by the time a session's next turn comes,
other sessions have evicted its blocks: without a host tier, every turn recomputes the whole
history; with one, the evicted blocks come back from host memory and only the new tail is
computed. Same prompts, same pool, greedy outputs checked identical.

Reports per run: wall time, prompt tokens computed, prompt tokens served from the cache (and of
those, from the host tier), blocks offloaded and reloaded; the speedup; JSON.

    python benchmarks/agent_sessions.py [--sessions 8] [--turns 6] [--num-blocks 128] [--host-cache-gb 1]
    python benchmarks/agent_sessions.py --smoke
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402

from engine.cpu_kernels import native_bf16  # noqa: E402


def session_turns(num_sessions: int, num_turns: int, system_tokens: int, tail_tokens: int, vocab: int,
                  seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each session's system prompt and, per turn, its new tool-result tokens (seeded)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, vocab) for _ in range(system_tokens)] for _ in range(num_sessions)]
    tails = [[[rng.randrange(100, vocab) for _ in range(tail_tokens)] for _ in range(num_turns)]
             for _ in range(num_sessions)]
    return systems, tails


def run(llm: LLM, systems, tails, answer_tokens: int) -> dict:
    params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
    histories = [list(system) for system in systems]
    outputs: list[list[int]] = []
    before = llm.engine.scheduler.stats()
    start = time.perf_counter()
    for turn in range(len(tails[0])):
        prompts = [history + session_tails[turn] for history, session_tails in zip(histories, tails)]
        results = llm.generate(prompts, params, use_tqdm=False)
        for index, result in enumerate(results):
            histories[index] = prompts[index] + result.token_ids
            outputs.append(result.token_ids)
    seconds = time.perf_counter() - start
    after = llm.engine.scheduler.stats()
    llm.engine.scheduler.check_integrity()
    return {"seconds": round(seconds, 2),
            "prompt_tokens": after.prefix_cache_queries - before.prefix_cache_queries,
            "prompt_tokens_computed": after.prompt_tokens_computed - before.prompt_tokens_computed,
            "cached_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
            "host_cache_hit_tokens": after.host_cache_hits - before.host_cache_hits,
            "offloaded_blocks": after.offloaded_blocks - before.offloaded_blocks,
            "reloaded_blocks": after.reloaded_blocks - before.reloaded_blocks,
            "preemptions": after.num_preemptions - before.num_preemptions,
            "outputs": outputs}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=512, help="each session's own system prompt")
    parser.add_argument("--tail-tokens", type=int, default=48, help="new tool-result tokens per turn")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=128, help="device KV pool (16-token blocks)")
    parser.add_argument("--max-running", type=int, default=2, help="sessions running at once (max_num_seqs)")
    parser.add_argument("--host-cache-gb", type=float, default=1.0)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU has it, else float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny CI-sized run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sessions, args.turns, args.system_tokens, args.tail_tokens = 3, 3, 64, 16
        args.answer_tokens, args.num_blocks, args.host_cache_gb = 4, 20, 0.05
    dtype = args.dtype or ("bfloat16" if native_bf16() else "float32")
    options = dict(num_blocks=args.num_blocks, dtype=dtype, max_num_seqs=args.max_running)
    results = {"config": {k: v for k, v in vars(args).items() if k != "json"} | {"dtype": dtype}}
    for name, host_cache_gb in (("device_only", 0.0), ("host_tier", args.host_cache_gb)):
        llm = LLM(args.model, host_cache_gb=host_cache_gb, **options)
        systems, tails = session_turns(args.sessions, args.turns, args.system_tokens, args.tail_tokens,
                                       llm.tokenizer.vocab_size, args.seed)
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        results[name] = run(llm, systems, tails, args.answer_tokens)
        print(f"{name:12s} {results[name]['seconds']:7.2f} s  prompt tokens computed "
              f"{results[name]['prompt_tokens_computed']:6d} of {results[name]['prompt_tokens']:6d}  "
              f"host-tier hits {results[name]['host_cache_hit_tokens']:6d} tokens  "
              f"offloaded/reloaded {results[name]['offloaded_blocks']}/{results[name]['reloaded_blocks']} blocks",
              flush=True)
        del llm
    same = results["device_only"].pop("outputs") == results["host_tier"].pop("outputs")
    results["outputs_identical"] = same
    results["speedup"] = round(results["device_only"]["seconds"] / results["host_tier"]["seconds"], 2)
    results["prefill_reduction"] = round(results["device_only"]["prompt_tokens_computed"]
                                         / max(1, results["host_tier"]["prompt_tokens_computed"]), 2)
    print(f"speedup {results['speedup']}x, {results['prefill_reduction']}x fewer prompt tokens computed, "
          f"outputs identical: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
