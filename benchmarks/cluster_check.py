"""The cluster on one device: disaggregated `pdserve serve` token-exact against colocated, then
the serving benchmark of both (the `cluster` step of benchmarks/gpu_check.sh).

On one device (a GPU, or this machine's CPU), with the random SmolLM2-shaped model
(benchmarks/random_model.py; written once, reused when the folder already holds it):

  colocated        pdserve serve --colocated 1 --prefill 0 --decode 0
  disaggregated    pdserve serve --prefill 1 --decode 1 --transport T   for each T of --transports
                   (on cuda with --worker-gpus 0.5: both workers on the one GPU)

one system at a time (each has the device to itself), colocated first, as the reference:

1. check: the same fixed prompts (token ids), one request at a time, greedy (temperature 0,
   `ignore_eos`, fixed max_tokens) through /v1/completions with logprobs. The random model's
   tokenizer names token i `t{i}`, so the logprobs' token strings are the output token ids. A
   disaggregated system passes when every prompt's output ids equal the colocated worker's, and
   the router's /metrics show one KV transfer per prompt, none failed (every prompt was prefilled
   on the prefill worker and its KV moved over T; `--local-prefill-threshold 0`);
2. benchmark: prompts of 1024 random token ids (distinct, so no prefix-cache hit), 128 tokens
   out, --concurrency 64 in flight, --num-requests 256 in all, cut at --bench-timeout (the
   unfinished ones count as incomplete); benchmarks/serve.py's client on the chat endpoint, after
   a warm-up wave. A request that fails fails the run.

One PASS/FAIL line per transport; a transport this machine cannot use (ucx without ucxx) is
skipped with a line saying why. Writes --json (everything) and --markdown (the table) after
every system. Every `pdserve serve` is stopped on every path, SIGTERM (from `timeout`) included.
Exit status 0 when at least one transport ran, every one that ran passed, and no system failed.

    python benchmarks/cluster_check.py --device cuda --transports ucx,tcp --json out.json --markdown out.md
    python benchmarks/cluster_check.py --device cpu --smoke --omp-num-threads 1 --json out.json   # CI size
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.compare import ServeProcess  # noqa: E402
from benchmarks.serve import BenchConfig, build_report, run_workload  # noqa: E402
from benchmarks.workloads import Conversation, Turn, Workload  # noqa: E402

DEFAULT_TRANSPORTS = {"cuda": "ucx,tcp", "cpu": "tcp,shm"}
# The CPU smoke run's tiny model: random_model.py's overrides of the SmolLM2-135M shape. At this
# width, random_model's weight scale (0.05) makes greedy output repeat one token, so a token-exact
# match would prove little; at 0.2 it moves with the context.
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.2)
_SPECIAL_IDS = {"<unk>": 0, "<s>": 1, "</s>": 2}
_TOKEN = re.compile(r"^t(\d+)$")


@dataclass
class Plan:
    """What one run checks and measures (the same for every system)."""
    layers: int = 30
    shape: dict[str, Any] = field(default_factory=dict)  # random_model overrides of the SmolLM2 shape
    dtype: str = "bfloat16"
    check_prompt_lens: list[int] = field(default_factory=lambda: [16, 75, 257, 1024, 2100])
    check_max_tokens: int = 64
    input_len: int = 1024
    output_len: int = 128
    concurrency: int = 64
    num_requests: int = 256
    warmup_requests: int = 64  # one wave at the benchmark's concurrency, 16 tokens out
    bench_timeout_s: float = 60.0  # the whole benchmark run of one system; unfinished ones count as incomplete
    kv_cache_blocks: int = 16384  # per worker (SmolLM2-135M bf16: 360 KiB a block, ~6 GiB)
    seed: int = 0

    @classmethod
    def smoke(cls) -> "Plan":
        return cls(layers=2, shape=dict(TINY_SHAPE), dtype="float32", check_prompt_lens=[5, 40, 130],
                   check_max_tokens=12, input_len=64, output_len=8, concurrency=4, num_requests=8,
                   warmup_requests=2, bench_timeout_s=300.0, kv_cache_blocks=512)

    @property
    def vocab_size(self) -> int:
        return int(self.shape.get("vocab_size", 49152))


# ---- the model ----------------------------------------------------------------------------------

def ensure_model(folder: Path, plan: Plan) -> tuple[Path, bool]:
    """The random model in `folder`: reused when its config already has this plan's shape,
    otherwise written. Returns (folder, whether it was written)."""
    from benchmarks.random_model import INITIALIZER_RANGE, SMOLLM2_135M
    want = {**SMOLLM2_135M, "initializer_range": INITIALIZER_RANGE, **plan.shape, "num_hidden_layers": plan.layers}
    config_path = folder / "config.json"
    if config_path.exists() and (folder / "tokenizer.json").exists() and \
            any(folder.glob("*.safetensors")):
        have = json.loads(config_path.read_text())
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "initializer_range")
        if all(have.get(k) == want[k] for k in keys) and have.get("torch_dtype", have.get("dtype")) == plan.dtype:
            return folder, False
    import torch
    from benchmarks.random_model import write_random_model
    write_random_model(str(folder), plan.layers, plan.seed, getattr(torch, plan.dtype), **plan.shape)
    return folder, True


def token_ids_of(tokens: list[str]) -> list[int] | None:
    """The random model's token strings (`t{i}`, <unk>, <s>, </s>) as ids; None for another tokenizer."""
    ids = []
    for token in tokens:
        if token in _SPECIAL_IDS:
            ids.append(_SPECIAL_IDS[token])
            continue
        match = _TOKEN.match(token)
        if match is None:
            return None
        ids.append(int(match.group(1)))
    return ids


def check_prompts(plan: Plan) -> list[list[int]]:
    """Fixed prompts (token ids, never the special ones), from the plan's seed."""
    rng = random.Random(plan.seed + 1234)
    return [[rng.randrange(3, plan.vocab_size) for _ in range(n)] for n in plan.check_prompt_lens]


def bench_workload(plan: Plan, num_requests: int, output_len: int, seed: int) -> Workload:
    """`random` with the random model's words: `input_len` distinct token ids per prompt (exactly
    that many tokens, plus the chat template's few), so no two prompts share a cached prefix."""
    rng = random.Random(seed)
    conversations = [Conversation(i, [Turn(" ".join(f"t{rng.randrange(3, plan.vocab_size)}"
                                                    for _ in range(plan.input_len)),
                                           output_len, plan.input_len, tag="random")])
                     for i in range(num_requests)]
    return Workload("random", conversations, f"{num_requests} requests, {plan.input_len} random token ids in "
                                             f"(+ the chat template), {output_len} out")


# ---- one system ---------------------------------------------------------------------------------

@dataclass
class System:
    name: str
    transport: str | None  # None: colocated
    args: list[str]

    @property
    def command(self) -> str:
        return " ".join(["pdserve", "serve", *self.args])


def build_systems(device: str, transports: list[str], model: Path, plan: Plan, omp_num_threads: int | None,
                  worker_gpus: float) -> list[System]:
    common = ["--model", str(model), "--device", device, "--kv-cache-blocks", str(plan.kv_cache_blocks),
              *(["--omp-num-threads", str(omp_num_threads)] if omp_num_threads else [])]
    systems = [System("colocated", None, ["--colocated", "1", "--prefill", "0", "--decode", "0", *common])]
    for transport in transports:
        systems.append(System(f"disaggregated-{transport}", transport, [
            "--prefill", "1", "--decode", "1", "--colocated", "0", "--transport", transport,
            "--local-prefill-threshold", "0", *(["--worker-gpus", f"{worker_gpus:g}"] if device == "cuda" else []),
            *common]))
    return systems


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).raise_for_status().text)


def parse_metrics(text: str) -> dict[str, float]:
    """The router's counters this check reads (Prometheus text): KV transfers (count, bytes), failed
    transfers (all reasons), prefills routed to the decode worker (`local_queue`)."""
    out = {"kv_transfers": 0.0, "kv_bytes": 0.0, "kv_failures": 0.0, "local_prefills": 0.0}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("pdserve:kv_transfer_seconds_count"):
            out["kv_transfers"] += float(value)
        elif name.startswith("pdserve:kv_transfer_bytes_total"):
            out["kv_bytes"] += float(value)
        elif name.startswith("pdserve:kv_transfer_failures_total"):
            out["kv_failures"] += float(value)
        elif name.startswith("pdserve:routing_decisions_total") and 'reason="local_queue"' in name:
            out["local_prefills"] += float(value)
    return out


def generate(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Each prompt alone (so every system runs the same batch shapes), greedy, `ignore_eos`."""
    outputs = []
    with httpx.Client(timeout=300) as client:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "logprobs": 0}
            response = client.post(url + "/v1/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"/v1/completions answered {response.status_code}: {response.text[:300]}")
            choice = response.json()["choices"][0]
            tokens = list(choice["logprobs"]["tokens"])
            outputs.append({"tokens": tokens, "token_ids": token_ids_of(tokens), "text": choice["text"],
                            "logprobs": list(choice["logprobs"]["token_logprobs"]),
                            "finish_reason": choice["finish_reason"]})
    return outputs


def served_model(url: str) -> str:
    cards = httpx.get(url + "/v1/models", timeout=30).raise_for_status().json()["data"]
    return cards[0]["id"]


def compare_outputs(reference: list[dict[str, Any]], outputs: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """Per prompt: identical token ids (token strings when the tokenizer is not the random one's)."""
    mismatches, diffs = [], []
    for index, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        key = "token_ids" if ref["token_ids"] is not None and out["token_ids"] is not None else "tokens"
        if ref[key] != out[key] or len(out[key]) != max_tokens:
            first = next((i for i, (a, b) in enumerate(zip(ref[key], out[key])) if a != b),
                         min(len(ref[key]), len(out[key])))
            mismatches.append({"prompt": index, "first_difference_at": first,
                               "colocated": ref[key][first:first + 8], "disaggregated": out[key][first:first + 8]})
        diffs += [abs(a - b) for a, b in zip(ref["logprobs"], out["logprobs"]) if a is not None and b is not None]
    return {"compared": "token ids" if all(o["token_ids"] is not None for o in outputs) else "token strings",
            "identical_prompts": len(reference) - len(mismatches), "prompts": len(reference),
            "mismatches": mismatches, "max_abs_logprob_difference": max(diffs, default=0.0)}


def run_bench(url: str, plan: Plan, label: str) -> dict[str, Any]:
    """A warm-up wave (16 tokens out, its own prompts), then the measured run, with the router's
    KV counters over it (on a disaggregated system, `local_prefills` are the prompts the router
    gave the decode worker to prefill itself: conditional disaggregation, --local-prefill-weight)."""
    if plan.warmup_requests:
        warm = BenchConfig(base_url=url, max_concurrency=plan.concurrency, show_progress=False,
                           label=f"{label} warm-up", request_timeout_s=300)
        asyncio.run(run_workload(warm, bench_workload(plan, plan.warmup_requests, 16, plan.seed + 999)))
    config = BenchConfig(base_url=url, max_concurrency=plan.concurrency, timeout_s=plan.bench_timeout_s,
                         request_timeout_s=plan.bench_timeout_s, seed=plan.seed, show_progress=False, label=label)
    workload = bench_workload(plan, plan.num_requests, plan.output_len, plan.seed)
    before = metrics(url)
    report = build_report(config, workload, asyncio.run(run_workload(config, workload)))
    after = metrics(url)
    report.pop("requests")
    report["router_metrics"] = {k: after[k] - before[k] for k in after}
    return report


def run_system(system: System, plan: Plan, prompts: list[list[int]], workdir: Path, ray_temp_root: Path,
               start_timeout_s: float, reference: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Start `system`, check it (against `reference` when given), benchmark it, stop it."""
    result: dict[str, Any] = {"system": system.name, "transport": system.transport, "serve_command": system.command}
    ray_temp_dir = tempfile.mkdtemp(prefix="r", dir=ray_temp_root)  # short: Ray's socket paths have a limit
    log = workdir / f"{system.name}.log"
    started = time.monotonic()
    process = ServeProcess([*system.args, "--ray-temp-dir", ray_temp_dir], log, workdir / f"{system.name}.state.json")
    _LIVE[process] = False
    try:
        url = process.wait_ready(start_timeout_s)
        result["start_s"] = round(time.monotonic() - started, 1)
        print(f"{system.name}: ready in {result['start_s']:.0f} s ({system.command})", flush=True)
        model = served_model(url)
        before = metrics(url)
        outputs = generate(url, model, prompts, plan.check_max_tokens)
        after = metrics(url)
        moved = {k: after[k] - before[k] for k in after}
        result["check"] = {"outputs": outputs, "router_metrics": moved}
        if reference is not None:
            verdict = compare_outputs(reference, outputs, plan.check_max_tokens)
            problems = []
            if verdict["mismatches"]:
                problems.append(f"{len(verdict['mismatches'])} of {len(prompts)} prompts differ from colocated "
                                f"(first: {verdict['mismatches'][0]})")
            if moved["kv_transfers"] != len(prompts) or moved["kv_bytes"] <= 0:
                problems.append(f"{moved['kv_transfers']:.0f} KV transfers ({moved['kv_bytes']:.0f} bytes) for "
                                f"{len(prompts)} prompts: not every prompt's KV moved over {system.transport}")
            if moved["kv_failures"] or moved["local_prefills"]:
                problems.append(f"{moved['kv_failures']:.0f} failed KV transfers, {moved['local_prefills']:.0f} "
                                f"prompts prefilled on the decode worker")
            verdict["problems"] = problems
            verdict["verdict"] = "FAIL" if problems else "PASS"
            result["check"]["verdict"] = verdict
            line = (f"cluster check {verdict['verdict']}: {system.transport}: disaggregated (1 prefill + 1 decode) "
                    f"vs colocated, {verdict['identical_prompts']}/{len(prompts)} prompts with identical "
                    f"{verdict['compared']} ({plan.check_max_tokens} greedy tokens each), "
                    f"{moved['kv_transfers']:.0f} KV transfers, {moved['kv_bytes'] / 1e6:.2f} MB, "
                    f"{moved['kv_failures']:.0f} failed; max |logprob difference| "
                    f"{verdict['max_abs_logprob_difference']:.3g}")
            print(line + ("" if not problems else "\n  " + "\n  ".join(problems)), flush=True)
        result["bench"] = run_bench(url, plan, system.name)
        s = result["bench"]["summary"]
        if s["errors"]:
            result["error"] = f"benchmark: {s['errors']} requests failed: {'; '.join(s['error_messages'][:3])}"
        print(f"{system.name}: benchmark {s['completed']} ok, {s['errors']} errors, {s['incomplete']} incomplete, "
              f"{s['output_token_throughput']:.0f} out tok/s, {s['total_token_throughput']:.0f} total tok/s, "
              f"TTFT p50 {_n(s['ttft_ms']['median'])} ms, TPOT p50 {_n(s['tpot_ms']['median'])} ms", flush=True)
    except Exception as exc:  # the other systems still run; this one is reported as failed
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{system.name}: ERROR {result['error']}\n--- the last lines of {log} ---\n{_tail(log)}", flush=True)
    finally:
        stop(process)
        remove_tree(Path(ray_temp_dir))
    return result


def remove_tree(path: Path) -> None:
    """rmtree, again for a few seconds while Ray's daemons, exiting after `pdserve serve`, still write there."""
    for _ in range(10):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.5)


# Every `pdserve serve` started and not yet stopped -> whether its stop has begun (SIGINT sent).
_LIVE: dict[ServeProcess, bool] = {}


def stop(process: ServeProcess) -> None:
    """ServeProcess.stop: SIGINT, then SIGKILL to its process group after 60 s."""
    _LIVE[process] = True
    process.stop(timeout_s=60)
    _LIVE.pop(process, None)


def on_sigterm(signum: int, frame: Any) -> None:
    """`timeout` (gpu_check.sh) sends SIGTERM, at any point, a `finally` included: stop every live
    `pdserve serve` here, then exit. Once: the stops are not interrupted again."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for process, stopping in list(_LIVE.items()):
        if not stopping:
            process.stop(timeout_s=60)
            continue
        # the stop this signal interrupted had begun: a second SIGINT would cut pdserve's teardown short
        try:
            process.popen.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.popen.pid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return "(no log)"


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---- the whole run ------------------------------------------------------------------------------

def verdicts(results: list[dict[str, Any]], skipped: dict[str, str]) -> dict[str, str]:
    """transport -> PASS / FAIL / SKIP (a colocated failure fails every transport)."""
    out = {t: "SKIP" for t in skipped}
    for r in results:
        if r["transport"] is not None:
            out[r["transport"]] = (r.get("check") or {}).get("verdict", {}).get("verdict", "FAIL")
    return out


def markdown(run: dict[str, Any]) -> str:
    plan = run["plan"]
    lines = [f"Cluster check on {run['device_name']} ({run['device']}), model {run['model_shape']}; "
             f"benchmark: {plan['num_requests']} requests, {plan['input_len']} in / {plan['output_len']} out, "
             f"concurrency {plan['concurrency']}.", "",
             "| system | token-exact vs colocated | ok/err/incomplete | out tok/s | total tok/s | TTFT p50 / p99 (ms) "
             "| TPOT p50 / p99 (ms) | ITL p99 (ms) | prefills remote / local | start (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in run["systems"]:
        if "check" in r and "verdict" in r["check"]:
            v = r["check"]["verdict"]
            exact = f"{v['verdict']} ({v['identical_prompts']}/{v['prompts']})"
        else:
            exact = "reference" if r["transport"] is None and "check" in r else "FAIL"
        s = (r.get("bench") or {}).get("summary")
        if s is None:
            lines.append(f"| {r['system']} | {exact} | error: {r.get('error', '-')[:80]} | | | | | | | |")
            continue
        moved = r["bench"]["router_metrics"]
        prefills = "-" if r["transport"] is None else f"{moved['kv_transfers']:.0f} / {moved['local_prefills']:.0f}"
        lines.append(f"| {r['system']} | {exact} | {s['completed']}/{s['errors']}/{s['incomplete']} | "
                     f"{s['output_token_throughput']:.0f} | {s['total_token_throughput']:.0f} | "
                     f"{_n(s['ttft_ms']['median'])} / {_n(s['ttft_ms']['p99'])} | "
                     f"{_n(s['tpot_ms']['median'], 1)} / {_n(s['tpot_ms']['p99'], 1)} | {_n(s['itl_ms']['p99'], 1)} | "
                     f"{prefills} | {r.get('start_s', '-')} |")
    for transport, reason in run["skipped"].items():
        lines.append(f"| disaggregated-{transport} | SKIP: {reason} | | | | | | | | |")
    return "\n".join(lines) + "\n"


def device_name(device: str) -> str:
    if device == "cuda":
        import torch
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--transports", default=None,
                        help="disaggregated systems' KV transports, comma-separated (default: ucx,tcp on cuda, "
                             "tcp,shm on cpu)")
    parser.add_argument("--smoke", action="store_true", help="CI size: a tiny model, 3 prompts, 8 requests")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the random model is (written there unless it already has the plan's shape; "
                             "default $TMPDIR/pdserve-smollm2-random, the offline step's, or a temporary folder "
                             "with --smoke)")
    parser.add_argument("--num-requests", type=int, default=None, help="benchmark requests per system")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--bench-timeout", type=float, default=None,
                        help="seconds one system's benchmark may run (unfinished requests count as incomplete)")
    parser.add_argument("--kv-cache-blocks", type=int, default=None, help="KV blocks per worker (default: the plan's)")
    parser.add_argument("--omp-num-threads", type=int, default=None, help="torch threads per worker")
    parser.add_argument("--worker-gpus", type=float, default=0.5, help="cuda: Ray GPUs per disaggregated worker")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="seconds for one `pdserve serve` to be ready")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    # A background job of a non-interactive shell starts with SIGINT ignored, and its children would
    # inherit that: a `pdserve serve` still starting up would then ignore ServeProcess.stop's SIGINT.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    plan = Plan.smoke() if args.smoke else Plan()
    for name in ("num_requests", "concurrency", "kv_cache_blocks"):
        if getattr(args, name) is not None:
            setattr(plan, name, getattr(args, name))
    if args.bench_timeout is not None:
        plan.bench_timeout_s = args.bench_timeout
    plan.warmup_requests = min(plan.warmup_requests, plan.concurrency)

    from kvtransfer.factory import TRANSPORT_NAMES, transport_unavailable_reason
    transports, skipped = [], {}
    for transport in (args.transports or DEFAULT_TRANSPORTS[args.device]).split(","):
        if transport not in TRANSPORT_NAMES:
            parser.error(f"unknown transport {transport!r}; choose from {', '.join(TRANSPORT_NAMES)}")
        reason = transport_unavailable_reason(transport)
        if reason is None:
            transports.append(transport)
        else:
            skipped[transport] = reason
            print(f"cluster check SKIP: {transport}: not usable here ({reason})", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="pdserve-cluster-check-"))
    ray_temp_root = Path(tempfile.mkdtemp(prefix="pdcc", dir="/tmp"))
    started = time.monotonic()
    shape = {**plan.shape, "num_hidden_layers": plan.layers} if plan.shape else \
        f"SmolLM2-135M ({plan.layers} layers, random weights)"
    results: list[dict[str, Any]] = []
    run = {"device": args.device, "device_name": device_name(args.device), "model_shape": shape,
           "dtype": plan.dtype, "plan": asdict(plan), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "python": platform.python_version(), "complete": False, "systems": results, "skipped": skipped}

    def write() -> None:
        """After every system, so a run cut short by its time limit keeps what it measured."""
        run["verdicts"] = verdicts(results, skipped)
        run["wall_s"] = round(time.monotonic() - started, 1)
        if args.json:
            args.json.write_text(json.dumps(run, indent=1))
        if args.markdown:
            args.markdown.write_text(markdown(run))

    try:
        model_dir = args.model_dir or (workdir / "model" if args.smoke else
                                       Path(os.environ.get("TMPDIR", "/tmp")) / "pdserve-smollm2-random")
        model, written = ensure_model(model_dir, plan)
        print(f"model: {model} ({'written' if written else 'reused'}: {plan.layers} layers, {plan.dtype}); "
              f"pdserve logs in {workdir}", flush=True)
        prompts = check_prompts(plan)
        run["check_prompts"] = [len(p) for p in prompts]
        reference = None
        for system in build_systems(args.device, transports, model, plan, args.omp_num_threads, args.worker_gpus):
            if system.transport is not None and reference is None:
                results.append({"system": system.name, "transport": system.transport, "serve_command": system.command,
                                "error": "no colocated reference (it failed)"})
                print(f"cluster check FAIL: {system.transport}: no colocated reference to compare with", flush=True)
            else:
                results.append(run_system(system, plan, prompts, workdir, ray_temp_root, args.start_timeout,
                                          reference))
                if system.transport is None and "check" in results[-1]:
                    reference = results[-1]["check"]["outputs"]
            write()
        run["complete"] = True
        write()
    finally:
        remove_tree(ray_temp_root)
    print(markdown(run))
    passed = [t for t, v in run["verdicts"].items() if v == "PASS"]
    failed = [t for t, v in run["verdicts"].items() if v == "FAIL"]
    errors = [r["system"] for r in results if "error" in r]
    ok = bool(passed) and not failed and not errors
    print(f"cluster check: {'PASS' if ok else 'FAIL'} (passed: {', '.join(passed) or '-'}; failed: "
          f"{', '.join(failed) or '-'}; skipped: {', '.join(skipped) or '-'}; errors: {', '.join(errors) or '-'}; "
          f"{run['wall_s']:.0f} s)", flush=True)
    if ok:  # the logs (and a --smoke model) are kept only when something failed
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
