"""pdserve next to a peer OpenAI-compatible server: one client, one workload, one table.

Runs one system after another, never two at once, so each has the whole machine:

  pdserve colocated       pdserve serve --prefill 0 --decode 0 --colocated 1 (one worker, every thread)
  pdserve disaggregated   pdserve serve --prefill 1 --decode 1 (a thread each on 2 cores)
  peer                    --peer-url URL: a server you started (e.g. llama.cpp's llama-server, below)

Each system gets the same two loads, with fixed-length prompts of random words (--input-len
tokens in, --output-len out, ignore_eos): a fixed concurrency (--concurrency requests in flight,
--num-requests in all), then Poisson arrivals at --request-rate. The table has total token
throughput, TTFT and ITL p50 / p99 and errors per run, and the machine's CPU features and fp32
matmul peak, measured in the same run. Written to <out>/peer_compare.json and .md.

The client is benchmarks/serve.py (vLLM `bench serve`'s metrics: TTFT, ITL per token, TPOT), or
with --client aiperf, NVIDIA's aiperf (`pip install -e '.[peer]'`), which Dynamo's results use.

    python benchmarks/peer_compare.py                                   # both pdserve layouts
    python benchmarks/peer_compare.py --peer-url http://127.0.0.1:8080 --peer-name llama.cpp
    python benchmarks/peer_compare.py --smoke                           # a few requests, to check

A llama.cpp peer on the same weights (f32, the default model's GGUF converted to f32 so both
compute in fp32; llama-server from a llama.cpp build, or `pip install 'llama-cpp-python[server]'`):

    python -m llama_cpp.server --model smollm2-f32.gguf --n_threads 2 --n_ctx 8192 --port 8080
    llama-server -m smollm2-f32.gguf -t 2 -np 16 -c 8192 --port 8080
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.compare import ServeProcess  # noqa: E402
from benchmarks.serve import BenchConfig, run_benchmark  # noqa: E402

# torch threads: cores / workers by default (2 for the colocated worker, 1 each for P and D on 2 cores)
PDSERVE_SYSTEMS = {
    "pdserve colocated": ["--prefill", "0", "--decode", "0", "--colocated", "1"],
    "pdserve disaggregated": ["--prefill", "1", "--decode", "1", "--colocated", "0"],
    # as many running sequences as llama-server's 16 slots below (the rest wait, as in its queue)
    "pdserve colocated 16 seqs": ["--prefill", "0", "--decode", "0", "--colocated", "1", "--max-num-seqs", "16"],
}
DEFAULT_SYSTEMS = ("pdserve colocated", "pdserve disaggregated")
COMMON_SERVE_ARGS = ["--kv-cache-memory-gb", "2"]


def machine_facts() -> dict[str, Any]:
    """What the numbers depend on: CPU model and SIMD features, cores, torch, fp32 matmul peak."""
    import torch

    from benchmarks.offline import matmul_peak_gflops
    from engine import cpu_kernels
    return {"cpu": cpu_kernels.cpu_model(), "cpu_features": cpu_kernels.cpu_features(), "kernel_isa": cpu_kernels.isa(),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "fp32_matmul_peak_gflops": matmul_peak_gflops(torch.float32)}


# Where a pdserve run's CPU time went, by process kind (cmdline substrings, first match wins).
PROCESS_KINDS = (("router", "router_process"), ("controller", "ControllerActor"), ("workers", "ray::"),
                 ("ray", "ray/"), ("ray", "raylet"), ("ray", "gcs_server"))


def cpu_seconds_by_kind(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of `root_pid` (kind "serve") and every descendant, by kind
    (Linux /proc; processes that already exited are not counted)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    pending = [root_pid]
    while pending:
        pid = pending.pop()
        pending += children.get(pid, [])
        if pid not in stats:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        kind = "serve" if pid == root_pid else next((k for k, marker in PROCESS_KINDS if marker in cmdline), "other")
        totals[kind] = totals.get(kind, 0.0) + (int(stats[pid][11]) + int(stats[pid][12])) / tick
    return totals


def run_load(url: str, label: str, load: dict[str, Any], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    if args.client == "aiperf":
        return run_aiperf(url, label, load, args)
    config = BenchConfig(base_url=url, label=label, seed=seed, request_timeout_s=900,
                         request_rate=load.get("request_rate", float("inf")),
                         max_concurrency=load.get("max_concurrency"), use_logprobs=not args.no_logprobs,
                         show_progress=False)
    report = run_benchmark(config, "random", load["num_requests"],
                           {"input_len": args.input_len, "output_len": args.output_len})
    s = report["summary"]
    return {"total_tok_s": s["total_token_throughput"], "output_tok_s": s["output_token_throughput"],
            "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "itl_p50_ms": s["itl_ms"]["median"], "itl_p99_ms": s["itl_ms"]["p99"],
            "completed": s["completed"], "errors": s["errors"] + s["incomplete"],
            "error_messages": s["error_messages"]}


def served_model(url: str) -> str:
    import httpx
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def run_aiperf(url: str, label: str, load: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The same load through `aiperf profile`; its JSON export's metrics, in the table's units."""
    out = Path(tempfile.mkdtemp(prefix="aiperf-"))
    command = ["aiperf", "profile", "--url", url, "--endpoint-type", "chat", "--streaming",
               "--model", args.served_model or served_model(url), "--tokenizer", args.tokenizer,
               "--synthetic-input-tokens-mean", str(args.input_len), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(args.output_len), "--output-tokens-stddev", "0",
               "--extra-inputs", "ignore_eos:true", "--request-count", str(load["num_requests"]),
               "--artifact-dir", str(out), "--random-seed", "0"]
    if "max_concurrency" in load:
        command += ["--concurrency", str(load["max_concurrency"])]
    else:
        command += ["--request-rate", str(load["request_rate"])]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    export = next(out.rglob("profile_export_aiperf.json"))
    metrics = json.loads(export.read_text())

    def stat(name: str, key: str) -> float | None:
        value = metrics.get(name)
        return value.get(key) if isinstance(value, dict) else None

    completed = stat("request_count", "avg") or 0
    tokens = (stat("total_isl", "avg") or 0) + (stat("total_osl", "avg") or 0)
    return {"total_tok_s": tokens / (stat("benchmark_duration", "avg") or float("inf")),
            "output_tok_s": stat("output_token_throughput", "avg"),
            "ttft_p50_ms": stat("time_to_first_token", "p50"), "ttft_p99_ms": stat("time_to_first_token", "p99"),
            "itl_p50_ms": stat("inter_token_latency", "p50"), "itl_p99_ms": stat("inter_token_latency", "p99"),
            "completed": int(completed), "errors": int(stat("error_request_count", "avg") or 0),
            "error_messages": [], "client": "aiperf", "export": str(export)}


def loads(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"name": f"concurrency {args.concurrency}", "max_concurrency": args.concurrency,
             "num_requests": args.num_requests},
            {"name": f"{args.request_rate:g} req/s", "request_rate": args.request_rate,
             "num_requests": args.rate_requests}]


def bench_system(name: str, url: str, args: argparse.Namespace, server_pid: int | None = None) -> list[dict[str, Any]]:
    """Each load against `url`; with `server_pid` (a pdserve serve process), also the CPU seconds
    its processes spent on the load, by kind (router, workers, ray, ...)."""
    rows = []
    # Warm-up (first requests compile nothing, but touch every code path and page in the weights).
    run_load(url, f"{name} warm-up", {"max_concurrency": 4, "num_requests": 4}, args, seed=99)
    for i, load in enumerate(loads(args)):
        started = time.monotonic()
        cpu_before = cpu_seconds_by_kind(server_pid) if server_pid else {}
        result = run_load(url, f"{name} {load['name']}", load, args, seed=i)
        result.update(system=name, load=load["name"], wall_s=time.monotonic() - started)
        if server_pid:
            cpu_after = cpu_seconds_by_kind(server_pid)
            result["cpu_s"] = {kind: round(cpu_after[kind] - cpu_before.get(kind, 0.0), 2) for kind in cpu_after}
        print(f"  {name:24s} {load['name']:16s} {fmt_row(result)}  cpu s {result.get('cpu_s', '-')}", flush=True)
        rows.append(result)
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _cpu(seconds: dict[str, float] | None) -> str:
    if not seconds:
        return "-"
    workers, router = seconds.get("workers", 0.0), seconds.get("router", 0.0)
    return f"{workers:.0f} / {router:.0f} / {sum(seconds.values()) - workers - router:.0f}"


def fmt_row(r: dict[str, Any]) -> str:
    return (f"{r['total_tok_s']:8.1f} tok/s  TTFT {_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])} ms  "
            f"ITL {_ms(r['itl_p50_ms'])} / {_ms(r['itl_p99_ms'])} ms  errors {r['errors']}")


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"{m['cpu']}, {m['cores']} cores, features {' '.join(m['cpu_features'])} (kernels: {m['kernel_isa']}), "
             f"torch {m['torch']}, fp32 matmul peak {m['fp32_matmul_peak_gflops']:.0f} GFLOP/s; "
             f"random {report['input_len']} in / {report['output_len']} out, ignore_eos, client {report['client']}",
             *([f"(rows of an earlier run on {report['previous_machine']['cpu']}: fp32 matmul peak "
                f"{report['previous_machine']['fp32_matmul_peak_gflops']:.0f} GFLOP/s then)"]
               if "previous_machine" in report else []),
             "", "| system | load | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors | CPU s: workers / "
             "router / rest |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['system']} | {r['load']} | {r['total_tok_s']:.1f} | {_ms(r['ttft_p50_ms'])} / "
                     f"{_ms(r['ttft_p99_ms'])} | {_ms(r['itl_p50_ms'])} / {_ms(r['itl_p99_ms'])} | {r['errors']} | "
                     f"{_cpu(r.get('cpu_s'))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated pdserve layouts to run, of: {'; '.join(PDSERVE_SYSTEMS)} "
                             "(empty: only the peer)")
    parser.add_argument("--peer-url", default=None, help="a running OpenAI-compatible server to compare with")
    parser.add_argument("--peer-name", default="peer")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=128, help="requests of the concurrency run")
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--rate-requests", type=int, default=48, help="requests of the request-rate run")
    parser.add_argument("--client", choices=["builtin", "aiperf"], default="builtin")
    parser.add_argument("--tokenizer", default=None, help="aiperf: tokenizer folder (default: the default model's)")
    parser.add_argument("--served-model", default=None, help="aiperf: model name to send")
    parser.add_argument("--no-logprobs", action="store_true",
                        help="count one token per streamed chunk (for peers that do not stream logprobs)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `pdserve serve` argument")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="a few short requests of each load")
    parser.add_argument("--previous", type=Path, default=None,
                        help="a peer_compare.json whose rows come first in this report (e.g. the pdserve rows "
                             "of an earlier run on this machine, with --systems '' and a peer now)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.input_len, args.output_len, args.concurrency = 32, 8, 4
        args.num_requests, args.rate_requests, args.request_rate = 8, 4, 4.0
    if args.client == "aiperf" and args.tokenizer is None:
        from engine.model.loader import resolve_model
        args.tokenizer = str(resolve_model("default").model_dir)
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in PDSERVE_SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(PDSERVE_SYSTEMS)}")

    report: dict[str, Any] = {"machine": machine_facts(), "input_len": args.input_len,
                              "output_len": args.output_len, "client": args.client, "rows": [],
                              "date": time.strftime("%Y-%m-%d"), "commands": {}}
    if args.previous is not None:
        previous = json.loads(args.previous.read_text())
        report["rows"] += [dict(row, run=previous.get("date")) for row in previous["rows"]]
        report["commands"].update(previous.get("commands", {}))
        report["previous_machine"] = previous["machine"]
    print(f"machine: {report['machine']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="peer-compare-") as tmp:
        for name in systems:
            serve_args = [*PDSERVE_SYSTEMS[name], *COMMON_SERVE_ARGS, *args.serve_arg]
            report["commands"][name] = " ".join(["pdserve serve", *serve_args])
            server = ServeProcess(serve_args, Path(tmp) / f"{name.replace(' ', '-')}.log",
                                  Path(tmp) / f"{name.replace(' ', '-')}.state.json")
            try:
                report["rows"] += bench_system(name, server.wait_ready(900), args, server.popen.pid)
            finally:
                server.stop()
    if args.peer_url:
        report["commands"][args.peer_name] = args.peer_url
        report["rows"] += bench_system(args.peer_name, args.peer_url.removesuffix("/v1"), args)
    stem = "peer_compare_smoke" if args.smoke else "peer_compare"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print("\n" + markdown(report))
    return 1 if any(r["errors"] for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
