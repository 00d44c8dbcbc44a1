"""Paged-attention micro-benchmark: decode bandwidth against the card's copy bandwidth, and prefill throughput.

Decode is memory-bound, so its figure of merit is the achieved bandwidth: bytes of K/V read
plus query/output (and the new token's K/V written) per second, next to the device-to-device
copy bandwidth measured in the same run (the practical ceiling). Prefill is compute-bound:
tokens/s and attention TFLOP/s (causal, 4 * q * k * head_dim / 2 per head).

    python benchmarks/kernel_bench.py                      # CUDA: triton backend, bf16
    python benchmarks/kernel_bench.py --device cpu         # CPU: cpu backend (native decode kernel), fp32, small sizes
    python benchmarks/kernel_bench.py --json results.json  # also write JSON ($OUT/kernel_bench.json if OUT is set)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention import AttentionMetadata, get_attention_backend  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class BenchConfig:
    device: str
    backend: str
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    batch_sizes: list[int]
    context_lens: list[int]
    prefill_lens: list[int]
    prefill_batch: int
    iters: int
    compare_torch: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"--num-heads ({self.num_heads}) must be a multiple of --num-kv-heads "
                             f"({self.num_kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown --dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.iters < 1:
            raise ValueError("--iters must be >= 1")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but torch sees no CUDA device")


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, str | None]:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--backend", choices=["cpu", "torch", "triton"], default=None,
                        help="default: triton on cuda, cpu (torch + native decode kernel) on cpu")
    parser.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--num-kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--context-lens", type=int, nargs="+", default=None)
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=None)
    parser.add_argument("--prefill-batch", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--compare-torch", action="store_true",
                        help="also time the torch backend on the same decode batches (GPU)")
    parser.add_argument("--json", default=None, help="write results here (default: $OUT/kernel_bench.json)")
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    # GPU defaults: a Llama-3-8B layer (32 q heads, 8 KV heads, dim 128). CPU: SmolLM2-135M's layer.
    config = BenchConfig(
        device=args.device,
        backend=args.backend or ("triton" if on_gpu else "cpu"),
        dtype=args.dtype or ("bf16" if on_gpu else "fp32"),
        num_heads=args.num_heads or (32 if on_gpu else 9),
        num_kv_heads=args.num_kv_heads or (8 if on_gpu else 3),
        head_dim=args.head_dim or (128 if on_gpu else 64),
        block_size=args.block_size,
        batch_sizes=args.batch_sizes or ([1, 16, 64, 256] if on_gpu else [1, 8, 32]),
        context_lens=args.context_lens or ([512, 2048, 8192] if on_gpu else [128, 512]),
        prefill_lens=args.prefill_lens or ([512, 2048, 8192] if on_gpu else [128, 512]),
        prefill_batch=args.prefill_batch or (4 if on_gpu else 1),
        iters=args.iters or (20 if on_gpu else 5),
        compare_torch=args.compare_torch,
    )
    json_path = args.json or (os.path.join(os.environ["OUT"], "kernel_bench.json") if os.environ.get("OUT") else None)
    return config, json_path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(fn, device: str, iters: int) -> float:
    """Median seconds per call after two warm-up calls (CUDA events on the GPU)."""
    fn()
    fn()
    sync(device)
    samples = []
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            start_time = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start_time)
    return statistics.median(samples)


def copy_bandwidth(device: str, iters: int) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    num_bytes = (1 << 30) if device.startswith("cuda") else (64 << 20)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, iters)
    return 2 * num_bytes / seconds / 1e9


def make_paged_batch(cfg: BenchConfig, query_lens: list[int], seq_lens: list[int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[cfg.dtype]
    blocks = [-(-n // cfg.block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for count in blocks:
        tables.append(order[used:used + count])
        used += count
    num_tokens = sum(query_lens)
    device = cfg.device
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, cfg.block_size, device)
    kv_cache = torch.randn(num_blocks, 2, cfg.block_size, cfg.num_kv_heads, cfg.head_dim,
                           dtype=dtype, device=device)
    query = torch.randn(num_tokens, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
    key = torch.randn(num_tokens, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    return query, key, value, kv_cache, meta


def bench_decode(cfg: BenchConfig, backend, batch: int, context: int) -> dict:
    query, key, value, kv_cache, meta = make_paged_batch(cfg, [1] * batch, [context] * batch, seed=batch + context)
    scale = cfg.head_dim ** -0.5
    seconds = time_call(lambda: backend.forward(query, key, value, kv_cache, meta, scale), cfg.device, cfg.iters)
    element = query.element_size()
    kv_read = batch * context * cfg.num_kv_heads * cfg.head_dim * 2 * element
    q_and_out = 2 * batch * cfg.num_heads * cfg.head_dim * element
    kv_written = 2 * batch * cfg.num_kv_heads * cfg.head_dim * element
    total = kv_read + q_and_out + kv_written
    result = {"batch": batch, "context": context, "ms": seconds * 1e3, "gb_per_s": total / seconds / 1e9,
              "bytes": total}
    del query, key, value, kv_cache, meta
    return result


def bench_prefill(cfg: BenchConfig, backend, length: int) -> dict:
    batch = cfg.prefill_batch
    query, key, value, kv_cache, meta = make_paged_batch(cfg, [length] * batch, [length] * batch, seed=length)
    scale = cfg.head_dim ** -0.5
    seconds = time_call(lambda: backend.forward(query, key, value, kv_cache, meta, scale), cfg.device, cfg.iters)
    flops = batch * cfg.num_heads * 4 * cfg.head_dim * length * length / 2
    return {"batch": batch, "length": length, "ms": seconds * 1e3,
            "tokens_per_s": batch * length / seconds, "tflops": flops / seconds / 1e12}


def main(argv: list[str] | None = None) -> dict:
    cfg, json_path = parse_args(argv)
    if not cfg.device.startswith("cuda") and cfg.backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    backend = get_attention_backend(cfg.backend)
    torch_backend = get_attention_backend("torch") if cfg.compare_torch else None
    device_name = torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else "cpu"
    ceiling = copy_bandwidth(cfg.device, cfg.iters)
    print(f"device: {device_name}  backend: {cfg.backend}  dtype: {cfg.dtype}  heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads}  head_dim {cfg.head_dim}  block_size {cfg.block_size}")
    print(f"copy bandwidth (read + write): {ceiling:.1f} GB/s")

    decode = []
    print(f"\n{'decode':<8}{'batch':>7}{'context':>9}{'ms':>10}{'GB/s':>10}{'% copy':>8}"
          + (f"{'torch ms':>10}{'speedup':>9}" if torch_backend else ""))
    for batch in cfg.batch_sizes:
        for context in cfg.context_lens:
            row = bench_decode(cfg, backend, batch, context)
            row["fraction_of_copy"] = row["gb_per_s"] / ceiling
            line = (f"{'':<8}{batch:>7}{context:>9}{row['ms']:>10.3f}{row['gb_per_s']:>10.1f}"
                    f"{100 * row['fraction_of_copy']:>7.1f}%")
            if torch_backend:
                row["torch_ms"] = bench_decode(cfg, torch_backend, batch, context)["ms"]
                line += f"{row['torch_ms']:>10.3f}{row['torch_ms'] / row['ms']:>8.2f}x"
            decode.append(row)
            print(line, flush=True)
            if cfg.device.startswith("cuda"):
                torch.cuda.empty_cache()

    prefill = []
    print(f"\n{'prefill':<8}{'batch':>7}{'length':>9}{'ms':>10}{'tok/s':>12}{'TFLOP/s':>9}")
    for length in cfg.prefill_lens:
        row = bench_prefill(cfg, backend, length)
        prefill.append(row)
        print(f"{'':<8}{row['batch']:>7}{length:>9}{row['ms']:>10.3f}{row['tokens_per_s']:>12.0f}"
              f"{row['tflops']:>9.2f}", flush=True)

    results = {"device": device_name, "config": asdict(cfg), "copy_gb_per_s": ceiling,
               "decode": decode, "prefill": prefill}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {json_path}")
    return results


if __name__ == "__main__":
    main()
