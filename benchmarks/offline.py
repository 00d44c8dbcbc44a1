"""Offline throughput: the pdserve engine against transformers' static batching, in one run.

Workloads (seeded, random token prompts, EOS ignored):
  fixed  64 prompts x 256 tokens in, 64 out
  mixed  128 prompts, inputs uniform in [32, 1024], outputs uniform in [16, 256]

For each: output and total tokens/s of the engine and of transformers `generate` (batches of up to
64 in arrival order, left-padded, each batch run to its longest request: what static batching
costs), and their ratio. Also the decode step time at batch 1 against the memory-bandwidth bound
(weights + KV bytes read per step over a copy bandwidth measured here) and prefill FLOP/s against
a matmul peak measured here. Prints each result as it is measured, then a table; writes JSON.

Both sides run on the same device (`--device`, CUDA when torch sees one) and in the same dtype
(`--dtype`): bfloat16 by default on a GPU and where the CPU computes it natively (AVX512-BF16 or
AMX, as vLLM's CPU backend does), float32 elsewhere. The engine gets `--kv-cache-memory-gb` of KV
cache (default 4, vLLM's CPU default), so `mixed` fits without preemption; preemptions are reported.

    python benchmarks/offline.py [--workloads fixed,mixed] [--dtype bfloat16] [--json out.json] [--smoke]
    python benchmarks/offline.py --kv-cache-dtypes auto,int8,fp8_e4m3   # 8-bit KV: decode step, bytes
    python benchmarks/offline.py --device cuda --model /tmp/smollm2-random   # see random_model.py
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams, cpu_kernels  # noqa: E402
from engine.config import resolve_device  # noqa: E402
from engine.kv_cache import num_blocks_for_memory  # noqa: E402
from engine.model.loader import resolve_model  # noqa: E402


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, vocab_size: int, seed: int, smoke: bool) -> Workload:
    rng = random.Random(seed)
    low, high = 100, vocab_size - 100  # keep clear of special tokens at both ends
    if name == "fixed":
        n, lens, outs = (8, [64] * 8, [8] * 8) if smoke else (64, [256] * 64, [64] * 64)
    elif name == "mixed":
        n = 12 if smoke else 128
        lens = [rng.randint(16, 128) if smoke else rng.randint(32, 1024) for _ in range(n)]
        outs = [rng.randint(4, 24) if smoke else rng.randint(16, 256) for _ in range(n)]
    else:
        raise ValueError(f"unknown workload {name!r}")
    prompts = [[rng.randint(low, high) for _ in range(length)] for length in lens]
    return Workload(name, prompts, outs)


def run_engine(llm: LLM, workload: Workload) -> tuple[float, int]:
    """Seconds to generate the workload, and the preemptions it caused."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    preempted_before = llm.engine.scheduler.stats().num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    got = sum(len(o.token_ids) for o in outputs)
    assert got == workload.output_tokens, f"engine produced {got} tokens, expected {workload.output_tokens}"
    return elapsed, llm.engine.scheduler.stats().num_preemptions - preempted_before


def run_transformers(hf, workload: Workload, batch_size: int = 64) -> float:
    device = hf.device
    _sync(device)
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first:first + batch_size]
        outs = workload.output_lens[first:first + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding, as decoder-only generation needs
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        longest = max(outs)
        with torch.no_grad():
            hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                        min_new_tokens=longest, do_sample=False, pad_token_id=0, eos_token_id=None)
    _sync(device)
    return time.perf_counter() - start


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth_gbs(device: str = "cpu", repeats: int = 5) -> float:
    """Read+write bytes per second of a large tensor copy: the memory-bandwidth ceiling here."""
    nbytes = (2 if torch.device(device).type == "cuda" else 0.25) * 2**30
    src = torch.ones(int(nbytes) // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), device, repeats) / 1e9


def matmul_peak_gflops(dtype=torch.float32, device: str = "cpu", repeats: int = 5) -> float:
    n = 8192 if torch.device(device).type == "cuda" else 1536
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return 2 * n**3 / _best_seconds(lambda: a @ b, device, repeats) / 1e9


def decode_step_vs_bandwidth(llm: LLM, context: int, steps: int) -> dict:
    """Time decode steps of a single request and compare with bytes read / copy bandwidth."""
    engine = llm.engine
    arch = engine.runner.arch
    prompt = [1000 + (i % 5000) for i in range(context)]
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    while not any(d.new_token_ids for d in engine.step()):
        pass  # prefill (possibly chunked) until the first token
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    itemsize = engine.runner.dtype.itemsize
    weight_bytes = sum(p.numel() for p in engine.runner.model.parameters()) * itemsize
    kv_bytes = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * itemsize * (context + steps // 2)
    bandwidth = copy_bandwidth_gbs(str(engine.runner.device))
    bound_s = (weight_bytes + kv_bytes) / (bandwidth * 1e9)
    return {"context": context, "median_step_ms": step_s * 1e3, "bytes_read_per_step": weight_bytes + kv_bytes,
            "copy_bandwidth_gbs": bandwidth, "bandwidth_bound_ms": bound_s * 1e3,
            "fraction_of_bound": bound_s / step_s}


def decode_step_at_batch(llm: LLM, batch: int, context: int, steps: int) -> dict:
    """Median decode step time with `batch` requests of `context` prompt tokens all decoding."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([1000 + ((i * 131 + j) % 5000) for j in range(context)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()  # every prompt prefilled
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    runner = engine.runner
    kv_bytes_per_token = runner.kv_cache.data[0, 0].numel() * runner.kv_cache.data.element_size() \
        * runner.arch.num_hidden_layers / runner.block_size
    return {"batch": batch, "context": context, "median_step_ms": sorted(times)[len(times) // 2] * 1e3,
            "kv_bytes_per_token": kv_bytes_per_token}


def compare_kv_cache_dtypes(args, device: str, dtype: str, names: list[str]) -> dict:
    """Decode step time at batch 64 and 512-token context (smoke: 4 and 64) per KV cache dtype."""
    batch, context, steps = (4, 64, 4) if args.smoke else (64, 512, 16)
    rows = {}
    for name in names:
        llm = LLM(args.model, device=device, dtype=dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=max(args.max_num_seqs, batch), block_size=16, enable_prefix_caching=False,
                  kv_cache_memory_gb=args.kv_cache_memory_gb, kv_cache_dtype=name,
                  cuda_graphs=not args.no_cuda_graphs)
        rows[name] = decode_step_at_batch(llm, batch, context, steps)
        rows[name]["attention_backend"] = llm.engine.runner.backend.name
        llm.close()
        print(f"kv cache {name}: decode step {rows[name]['median_step_ms']:.1f} ms at batch {batch} x {context} "
              f"ctx, {rows[name]['kv_bytes_per_token']:.0f} KV bytes per token", flush=True)
    return rows


def forward_flops(llm: LLM, prompt_len: int, output_len: int) -> float:
    """FLOPs of one request: every linear layer for each token it computes (the prompt, then each
    output but the last), causal attention (QK^T and PV) over the context each token sees, and the
    LM head for each sampled token (the prompt's last and each output)."""
    arch = llm.engine.runner.arch
    matmul_params = sum(p.numel() for name, p in llm.engine.runner.model.named_parameters()
                        if "embed" not in name and "norm" not in name and "lm_head" not in name)
    tokens = prompt_len + max(output_len - 1, 0)
    hidden = arch.num_attention_heads * arch.head_dim
    attention = 2 * 2 * arch.num_hidden_layers * hidden * tokens * (tokens + 1) / 2
    return 2 * matmul_params * tokens + attention + 2 * arch.vocab_size * arch.hidden_size * max(output_len, 1)


def prefill_vs_peak(llm: LLM, tokens: int, dtype: torch.dtype = torch.float32,
                    earlier_peaks: tuple[float, ...] = ()) -> dict:
    """Prefill FLOP/s of one prompt against the matmul peak: the best of a measurement made now and
    `earlier_peaks` (made at the start of the run), so one measurement taken while the machine is
    slow does not make the fraction exceed 1."""
    engine = llm.engine
    prompt = [2000 + (i % 7000) for i in range(tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:64]], params, use_tqdm=False)  # warm up
    _sync(engine.runner.device)
    start = time.perf_counter()
    llm.generate([[t + 1 for t in prompt]], params, use_tqdm=False)  # shifted: no prefix-cache hit
    elapsed = time.perf_counter() - start
    flops = forward_flops(llm, tokens, 1)
    peaks = (*earlier_peaks, matmul_peak_gflops(dtype=dtype, device=str(engine.runner.device)))
    peak = max(peaks)
    return {"tokens": tokens, "seconds": elapsed, "gflops": flops / elapsed / 1e9, "matmul_peak_gflops": peak,
            "matmul_peak_measurements": list(peaks), "fraction_of_peak": flops / elapsed / 1e9 / peak}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--workloads", default="fixed,mixed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--smoke", action="store_true", help="tiny CI-sized run")
    parser.add_argument("--no-transformers", action="store_true", help="engine only")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (CUDA when torch sees one)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=None,
                        help="for both engine and transformers (default: bfloat16 on a GPU or where the CPU "
                             "has native bf16)")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=4.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="GPU: run decode steps eagerly")
    parser.add_argument("--kv-cache-dtypes", default=None,
                        help="only compare these KV cache dtypes (e.g. auto,int8,fp8_e4m3): decode step time at "
                             "batch 64 and 512-token context, and KV bytes per token")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") or cpu_kernels.native_bf16() else "float32")
    if args.kv_cache_dtypes:
        results = {"model": args.model, "device": device, "dtype": dtype, "threads": torch.get_num_threads(),
                   "cpu_features": cpu_kernels.cpu_features(),
                   "kv_cache_dtypes": compare_kv_cache_dtypes(args, device, dtype, args.kv_cache_dtypes.split(","))}
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return results

    loaded = resolve_model(args.model)
    # The KV pool is sized in bytes on both devices (on a GPU the engine would otherwise take a
    # share of all free memory, leaving none for the transformers side).
    num_blocks = num_blocks_for_memory(loaded.arch, 16, getattr(torch, dtype), int(args.kv_cache_memory_gb * 2**30))
    llm = LLM(args.model, device=device, dtype=dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, block_size=16, num_blocks=num_blocks, enable_prefix_caching=False,
              cuda_graphs=not args.no_cuda_graphs)
    hf = None
    if not args.no_transformers:
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.model_dir,
                                                               dtype=getattr(torch, dtype)).to(device).eval()
    vocab = llm.engine.runner.arch.vocab_size
    results: dict = {"model": args.model, "device": device, "dtype": dtype, "threads": torch.get_num_threads(),
                     "cuda_graphs": llm.engine.runner.decode_graphs is not None,
                     "attention_backend": llm.engine.runner.backend.name,
                     "native_decode_kernel": bool(getattr(llm.engine.runner.backend, "native", False)),
                     "workloads": {}, "load_average_before": os.getloadavg()}
    print(f"model={args.model} device={device} dtype={dtype} threads={results['threads']} "
          f"backend={results['attention_backend']} native decode kernel={results['native_decode_kernel']}", flush=True)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    peak_at_start = matmul_peak_gflops(dtype=getattr(torch, dtype), device=device)
    for name in args.workloads.split(","):
        workload = make_workload(name, vocab, args.seed, args.smoke)
        total = workload.prompt_tokens + workload.output_tokens
        engine_s, preemptions = run_engine(llm, workload)
        row = {"requests": len(workload.prompts), "prompt_tokens": workload.prompt_tokens,
               "output_tokens": workload.output_tokens, "engine_seconds": engine_s,
               "engine_output_tps": workload.output_tokens / engine_s, "engine_total_tps": total / engine_s,
               "engine_preemptions": preemptions}
        flops = sum(forward_flops(llm, len(p), o) for p, o in zip(workload.prompts, workload.output_lens))
        row.update(engine_gflops=flops / engine_s / 1e9, matmul_peak_gflops=peak_at_start,
                   fraction_of_matmul_peak=flops / engine_s / 1e9 / peak_at_start)
        print(f"{name}: engine {engine_s:.1f} s, {total / engine_s:.1f} total tok/s, "
              f"{row['engine_gflops']:.1f} GFLOP/s = {row['fraction_of_matmul_peak']:.0%} of the matmul peak "
              f"({preemptions} preemptions)", flush=True)
        if hf is not None:
            hf_s = run_transformers(hf, workload)
            row.update({"transformers_seconds": hf_s, "transformers_output_tps": workload.output_tokens / hf_s,
                        "transformers_total_tps": total / hf_s, "speedup": hf_s / engine_s})
            print(f"{name}: transformers {hf_s:.1f} s, {total / hf_s:.1f} total tok/s -> "
                  f"speedup {hf_s / engine_s:.2f}x", flush=True)
        results["workloads"][name] = row
    results["decode_batch1"] = decode_step_vs_bandwidth(llm, context=64 if args.smoke else 512,
                                                        steps=8 if args.smoke else 32)
    results["prefill"] = prefill_vs_peak(llm, tokens=64 if args.smoke else 1024, dtype=getattr(torch, dtype),
                                         earlier_peaks=(peak_at_start,))
    results["load_average_after"] = os.getloadavg()
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def print_table(results: dict) -> None:
    print(f"\nmodel={results['model']} device={results.get('device', 'cpu')} dtype={results['dtype']} threads={results['threads']} load average before/after "
          f"{results['load_average_before'][0]:.1f}/{results['load_average_after'][0]:.1f}")
    print(f"{'workload':<8} {'reqs':>5} {'engine out/s':>13} {'engine tot/s':>13} {'of peak':>8} {'hf out/s':>9} "
          f"{'hf tot/s':>9} {'speedup':>8}")
    for name, row in results["workloads"].items():
        print(f"{name:<8} {row['requests']:>5} {row['engine_output_tps']:>13.1f} {row['engine_total_tps']:>13.1f} "
              f"{row.get('fraction_of_matmul_peak', float('nan')):>8.0%} "
              f"{row.get('transformers_output_tps', float('nan')):>9.1f} {row.get('transformers_total_tps', float('nan')):>9.1f} "
              f"{row.get('speedup', float('nan')):>7.2f}x")
    d, p = results["decode_batch1"], results["prefill"]
    print(f"decode batch 1 @ {d['context']} ctx: {d['median_step_ms']:.1f} ms/step, bandwidth bound "
          f"{d['bandwidth_bound_ms']:.1f} ms ({d['fraction_of_bound']:.0%} of bound, copy {d['copy_bandwidth_gbs']:.1f} GB/s)")
    print(f"prefill {p['tokens']} tokens: {p['gflops']:.1f} GFLOP/s = {p['fraction_of_peak']:.0%} of matmul peak "
          f"{p['matmul_peak_gflops']:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
