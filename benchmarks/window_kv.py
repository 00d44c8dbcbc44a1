"""The KV a long prompt moves from a prefill to a decode worker, with sliding-window layers.

    python benchmarks/window_kv.py --model gemma-3-270m --lengths 8192 \\
        --json benchmarks/results/window_kv_gemma3.json

Starts one prefill and one decode worker (real processes, 127.0.0.1, `--transport tcp`), sends
one Generate per length (`max_tokens=1`, a fresh random prompt) and reads the bytes the decode
worker received (`kv_bytes_received`). A sliding layer's blocks behind the window of the next
token do not move (engine/kv_cache.py `window_skip_blocks`); the reference is what moving every
layer's blocks would take (layers x blocks x bytes per layer and block, from the model's config).
Also reports the KV memory the request holds: on the decode worker (its blocks in use, from its
Stats, read as the first token arrives; `max_tokens=4`), whose grouped cache (engine/kv_groups.py,
the default `kv_layout="auto"`) holds the full-attention layers' blocks and each sliding layer's
last window, and in a colocated engine (in this process, `--threads` threads) once the prompt is
computed. The reference is every layer's blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import wire  # noqa: E402
from benchmarks.ttft_disagg import Worker  # noqa: E402
from engine.cpu_kernels import cpu_model  # noqa: E402
from engine.kv_cache import layer_windows, window_skip_blocks  # noqa: E402
from engine.kv_groups import KVGroups  # noqa: E402
from engine.model.arch import ModelArchConfig  # noqa: E402
from engine.model.loader import resolve_model  # noqa: E402


def received_bytes(decode: Worker, prompt: list[int], prefill: Worker, request_id: str) -> tuple[int, int]:
    """(KV bytes the decode worker received, KV blocks it held as the first token arrived)."""
    pb = wire.messages()
    sampling = pb.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                                 ignore_eos=True)
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                 prefill_address=prefill.grpc)
    stub = decode.stub()
    received, remote, held = 0, False, None
    for chunk in stub.Generate(request, timeout=1800):
        received = max(received, chunk.kv_bytes_received)
        remote = remote or chunk.prefilled_remotely
        if held is None and chunk.token_ids:  # the only request in flight: every block in use is its
            stats = stub.Stats(pb.StatsRequest(), timeout=60)
            held = stats.kv_blocks_total - stats.kv_blocks_free
    if not remote:
        raise RuntimeError(f"{request_id} fell back to local prefill: not a disaggregated measurement")
    return received, held or 0


def colocated_held_bytes(model: str, prompt: list[int], block_size: int, threads: int) -> tuple[int, str]:
    """The KV bytes one request holds in an offline engine once its prompt is computed (with the
    first token being sampled), and the layout's description."""
    import torch

    from engine import LLM, SamplingParams
    from engine.kv_cache import bytes_per_block
    torch.set_num_threads(threads)
    with LLM(model, block_size=block_size, kv_cache_memory_gb=1.0, max_model_len=len(prompt) + 16) as llm:
        engine = llm.engine
        engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), request_id="w")
        request = engine.scheduler.get_request("w")
        while request.num_computed_tokens < len(prompt):
            engine.step()
        runner = engine.runner
        groups = runner.kv_groups if runner.kv_groups.grouped else None
        held = sum(1 for table in request.block_tables for block in table if block) if groups else len(request.block_ids)
        return held * bytes_per_block(runner.arch, block_size, runner.dtype, groups=groups), runner.kv_groups.describe()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OMP threads per worker")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    arch = ModelArchConfig.from_hf_config(json.loads((Path(resolve_model(args.model).model_dir) /
                                                      "config.json").read_text()))
    windows = layer_windows(arch) or (0,) * arch.num_hidden_layers
    num_blocks = max(args.lengths) // args.block_size + 64
    engine = ["--model", args.model, "--block-size", str(args.block_size), "--num-blocks", str(num_blocks),
              "--max-model-len", str(max(args.lengths) + 16)]
    prefill = Worker("prefill", engine, args.threads)
    decode = Worker("decode", [*engine, "--transport", "tcp", "--local-prefill-threshold", "0"], args.threads)
    report = {"model": args.model, "cpu_model": cpu_model(), "cpus": os.cpu_count(), "block_size": args.block_size,
              "layer_windows": list(windows), "results": {}}
    try:
        for worker in (prefill, decode):
            worker.wait_ready()
        rng = random.Random(0)
        print(f"{'tokens':>8} {'moved MiB':>10} {'all layers MiB':>15} {'ratio':>6} {'P/D held MiB':>13} "
              f"{'colocated held MiB':>19} {'ratio':>6}")
        for length in args.lengths:
            prompt = [rng.randrange(100, 40000) for _ in range(length)]
            moved, held_blocks = received_bytes(decode, prompt, prefill, f"window-{length}")
            blocks = -(-length // args.block_size)
            skips = window_skip_blocks(windows, length, args.block_size) or [0] * len(windows)
            chunks = sum(blocks - skip for skip in skips)  # the (layer, block) pairs the windows need
            if moved % chunks:
                raise RuntimeError(f"{moved} bytes moved are not {chunks} equal (layer, block) chunks")
            every = moved // chunks * blocks * len(windows)  # every layer's blocks, as the decode side holds
            held, layout = colocated_held_bytes(args.model, prompt, args.block_size, args.threads)
            groups = KVGroups.from_windows(windows) if any(windows) else None  # the decode worker's (auto)
            decode_held = held_blocks * moved // chunks * (groups.num_slots if groups else len(windows))
            report["results"][str(length)] = {"moved_bytes": moved, "moved_chunks": chunks,
                                              "all_layers_bytes": every, "ratio": moved / every,
                                              "held_bytes": decode_held, "held_ratio": decode_held / every,
                                              "colocated_held_bytes": held, "colocated_held_ratio": held / every,
                                              "colocated_layout": layout}
            print(f"{length:>8} {moved / 2**20:>10.1f} {every / 2**20:>15.1f} {moved / every:>6.3f} "
                  f"{decode_held / 2**20:>13.1f} {held / 2**20:>19.1f} {held / every:>6.3f}")
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        for worker in (prefill, decode):
            worker.stop()


if __name__ == "__main__":
    main()
