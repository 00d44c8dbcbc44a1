"""Disaggregated vs colocated pdserve, same total workers, every workload; JSON and PNG plots.

Starts both systems side by side, each its own `pdserve serve` (python -m deploy serve, a local
Ray instance, the default model on CPU, workers at nice 0), warms them up, then runs every
workload on one system right after the other (alternating which goes first), so that both see
the same background load on a shared machine; the idle one costs little (stats polls).

  disaggregated   --prefill 1 --decode 1
  colocated       --prefill 0 --decode 0 --colocated 2

  chat          at each of --rates (Poisson), latency percentiles vs request rate
  interference  short streams plus periodic long prompts, TPOT of the short ones over time
  agent         multi-turn tool loops, TTFT per turn, with prefix caching on and off (a second
                start of both systems with --no-prefix-caching runs only this workload)

Writes <out>/compare.json (summaries, plus the per-request series the plots need) and
<out>/latency_vs_rate.png, <out>/interference_tpot.png, <out>/agent_ttft_per_turn.png.

    python benchmarks/compare.py                       # the full comparison (~15-20 min on 2 cores)
    python benchmarks/compare.py --smoke               # a few requests of each, to check the harness
    python benchmarks/compare.py --plots-only          # redraw the plots from <out>/compare.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import REPO, run_metadata  # noqa: E402
from benchmarks.serve import SLO, BenchConfig, run_benchmark  # noqa: E402

# every system: a 0.5 GiB KV cache per worker (~11k tokens of SmolLM2-135M, plenty here), so four
# workers fit in memory next to each other
COMMON_SERVE_ARGS = ["--kv-cache-memory-gb", "0.5"]
SYSTEMS = {
    "disaggregated": ["--prefill", "1", "--decode", "1", "--colocated", "0"],
    "colocated": ["--prefill", "0", "--decode", "0", "--colocated", "2"],
}


@dataclass
class Plan:
    """What one comparison runs (the same for every system)."""
    rates: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])
    chat_requests: int = 16
    chat: dict[str, Any] = field(default_factory=lambda: {
        "chat_input_median": 128, "chat_input_sigma": 0.8, "chat_input_max": 768,
        "chat_output_median": 32, "chat_output_sigma": 0.5, "chat_output_max": 96})
    interference_rate: float = 0.4
    interference_requests: int = 24
    interference: dict[str, Any] = field(default_factory=lambda: {
        "short_input_len": 64, "short_output_len": 48, "long_input_len": 1024, "long_output_len": 4,
        "long_every": 8})
    agent_rate: float = 0.25
    agent_requests: int = 20
    agent: dict[str, Any] = field(default_factory=lambda: {
        "agent_turns": 5, "agent_system_tokens": 768, "agent_tool_result_tokens": 96, "agent_reply_tokens": 12,
        "agent_think_time_s": 0.5})
    slo: SLO = field(default_factory=lambda: SLO(ttft_ms=3000, tpot_ms=250))
    warmup_requests: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")

    @classmethod
    def smoke(cls) -> "Plan":
        return cls(rates=[1.0], chat_requests=3, interference_requests=6,
                   interference={"short_input_len": 32, "short_output_len": 8, "long_input_len": 256,
                                 "long_output_len": 2, "long_every": 3},
                   agent_requests=4, agent={"agent_turns": 2, "agent_system_tokens": 256,
                                            "agent_tool_result_tokens": 32, "agent_reply_tokens": 4,
                                            "agent_think_time_s": 0.1},
                   chat={"chat_input_median": 32, "chat_output_median": 8, "chat_output_max": 16}, warmup_requests=1)


# ---- a pdserve serve process --------------------------------------------------------------------

class ServeProcess:
    """`python -m deploy serve ...` in its own process group; `url` once it prints its ready line.
    `env`: more environment variables; `cwd`: where it runs (the checkout, or a copy of it);
    `on_line`, a subclass's hook: every line it prints (the ready line is handled here)."""

    READY = "pdserve ready: "

    def __init__(self, args: list[str], log_path: Path, state_file: Path, worker_niceness: int | None = 0,
                 env: dict[str, str] | None = None, cwd: Path = REPO, log_level: str = "warning") -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        if worker_niceness is not None:  # Ray starts its workers at nice 15 unless told otherwise
            full_env["RAY_worker_niceness"] = str(worker_niceness)
        self.command = [sys.executable, "-m", "deploy", "serve", "--port", "0", "--state-file", str(state_file),
                        "--log-level", log_level, *args]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.popen = subprocess.Popen(self.command, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.pid = self.popen.pid
        self._ready: queue.Queue[str] = queue.Queue()
        self.url: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith(self.READY):
                self._ready.put(line)
            self.on_line(line)

    def on_line(self, line: str) -> None:
        pass

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._ready.get(timeout=0.5)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            self.url = line[len(self.READY):].split()[0].removesuffix("/v1")
            return self.url
        raise RuntimeError(f"`{' '.join(self.command)}` was not ready within {timeout_s:.0f} s "
                           f"(exit status {self.popen.poll()}); see {self.log_path}")

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGINT (pdserve's clean shutdown), then SIGKILL to the process group if it lingers; its
        exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._log.close()
        return self.popen.returncode


@contextlib.contextmanager
def pdserve_pools(systems: list[str], prefix_caching: bool, workdir: Path, extra: list[str],
                  worker_niceness: int | None) -> Iterator[dict[str, tuple[str, str]]]:
    """Start every system at once (each its own `pdserve serve` and local Ray instance);
    yields {system: (url, the serve command)} when all are ready; stops them all."""
    processes: dict[str, tuple[ServeProcess, list[str]]] = {}
    try:
        for system in systems:
            args = [*SYSTEMS[system], *COMMON_SERVE_ARGS, *([] if prefix_caching else ["--no-prefix-caching"]),
                    *extra]
            name = f"{system}{'' if prefix_caching else '-nocache'}"
            processes[system] = (ServeProcess(args, workdir / f"{name}.log", workdir / f"{name}.state.json",
                                              worker_niceness), args)
        yield {system: (process.wait_ready(900), " ".join(["pdserve", "serve", *args]))
               for system, (process, args) in processes.items()}
    finally:
        for process, _ in processes.values():
            process.stop()


# ---- the runs -----------------------------------------------------------------------------------

def bench(url: str, label: str, workload: str, num_requests: int, rate: float, plan: Plan,
          options: dict[str, Any], seed: int) -> dict[str, Any]:
    """One run; every run of a system gets its own seed, so no run finds another's prompts cached."""
    config = BenchConfig(base_url=url, request_rate=rate, seed=seed, slo=plan.slo, label=label,
                         request_timeout_s=600)
    load_before = os.getloadavg()[0]
    report = run_benchmark(config, workload, num_requests, options)
    report["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
    s = report["summary"]
    print(f"  {label}: {s['completed']} ok, {s['errors']} errors, {s['incomplete']} unfinished or not sent, "
          f"TTFT median {_ms(s['ttft_ms']['median'])}, TPOT median {_ms(s['tpot_ms']['median'])}, "
          f"{s['output_token_throughput']:.1f} out tok/s", flush=True)
    return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def bench_command(workload: str, num_requests: int, rate: float, plan: Plan, options: dict[str, Any],
                  seed: int) -> str:
    """The equivalent `pdserve bench` command line, for the README."""
    parts = ["pdserve bench --base-url URL", f"--workload {workload}", f"--num-requests {num_requests}",
             f"--request-rate {rate:g}", f"--seed {seed}",
             f"--slo ttft:{plan.slo.ttft_ms:g} tpot:{plan.slo.tpot_ms:g}"]
    parts += [f"--{k.replace('_', '-')} {v}" for k, v in options.items()]
    return " ".join(parts)


def slim(report: dict[str, Any], keep: str) -> dict[str, Any]:
    """The report without the per-request detail that the plots do not need."""
    out = {k: v for k, v in report.items() if k != "requests"}
    if keep == "interference":
        out["requests"] = [{k: r[k] for k in ("tag", "sent_at_s", "ttft_ms", "tpot_ms", "e2e_ms", "itl_ms",
                                             "success")} for r in report["requests"]]
    elif keep == "agent":
        out["requests"] = [{k: r[k] for k in ("conversation_id", "turn", "sent_at_s", "ttft_ms", "prompt_tokens",
                                             "cached_tokens", "success")} for r in report["requests"]]
    return out


def warm_up(url: str, plan: Plan) -> None:
    if plan.warmup_requests:
        config = BenchConfig(base_url=url, seed=plan.seed + 999, show_progress=False, label="warmup")
        run_benchmark(config, "random", plan.warmup_requests, {"input_len": 64, "output_len": 8})


def run_side_by_side(systems: list[str], plan: Plan, workdir: Path, extra: list[str],
                     worker_niceness: int | None) -> dict[str, Any]:
    """Both systems run at the same time, idle while the other is measured; every workload runs on
    one right after the other (the order alternating), so both see the same background load."""
    out: dict[str, Any] = {system: {"chat": {}, "commands": []} for system in systems}
    turn = [0]

    def each(label: str, workload: str, num_requests: int, rate: float, options: dict[str, Any], seed: int,
             keep: str, key: str, urls: dict[str, tuple[str, str]]) -> None:
        order = systems if turn[0] % 2 == 0 else systems[::-1]
        turn[0] += 1
        for system in order:
            report = slim(bench(urls[system][0], f"{system} {label}", workload, num_requests, rate, plan, options,
                                seed), keep)
            if key.startswith("chat:"):
                out[system]["chat"][key[5:]] = report
            else:
                out[system][key] = report
            out[system]["commands"].append(bench_command(workload, num_requests, rate, plan, options, seed))

    with pdserve_pools(systems, True, workdir, extra, worker_niceness) as urls:
        for system in systems:
            out[system]["serve_command"] = urls[system][1]
            warm_up(urls[system][0], plan)
        for index, rate in enumerate(plan.rates):
            each(f"chat @ {rate:g} req/s", "chat", plan.chat_requests, rate, plan.chat, plan.seed + index,
                 "summary", f"chat:{rate:g}", urls)
        each("interference", "interference", plan.interference_requests, plan.interference_rate,
             plan.interference, plan.seed + 100, "interference", "interference", urls)
        each("agent (prefix caching)", "agent", plan.agent_requests, plan.agent_rate, plan.agent, plan.seed + 200,
             "agent", "agent_cache", urls)
    with pdserve_pools(systems, False, workdir, extra, worker_niceness) as urls:
        for system in systems:
            out[system]["serve_command_nocache"] = urls[system][1]
            warm_up(urls[system][0], plan)
        each("agent (no prefix caching)", "agent", plan.agent_requests, plan.agent_rate, plan.agent,
             plan.seed + 200, "agent", "agent_nocache", urls)
    return out


def machine_info() -> dict[str, Any]:
    """The machine and what runs on it now: CPUs, platform, load, and run_metadata() (commit, CPU
    model, command line, UTC time, Python)."""
    return {**run_metadata(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "load_average": list(os.getloadavg())}


# ---- plots --------------------------------------------------------------------------------------

COLORS = {"disaggregated": "tab:blue", "colocated": "tab:orange"}


def plot_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    return [plot_latency_vs_rate(results, out_dir), plot_interference(results, out_dir),
            plot_agent(results, out_dir)]


def plot_latency_vs_rate(results: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for system, data in results["systems"].items():
        rates = sorted(data["chat"], key=float)
        x = [float(r) for r in rates]
        for ax, metric in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms")):
            for stat, style in (("median", "-o"), ("p99", "--^")):
                y = [data["chat"][r]["summary"][metric][stat] for r in rates]
                ax.plot(x, y, style, color=COLORS.get(system), label=f"{system} {stat}")
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)", "end-to-end latency (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(f"chat: {title}")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "latency_vs_rate.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_interference(results: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib.pyplot as plt
    systems = list(results["systems"])
    fig, axes = plt.subplots(len(systems), 1, figsize=(11, 2.8 * len(systems)), sharex=True, squeeze=False)
    for ax, system in zip(axes[:, 0], systems):
        requests = results["systems"][system]["interference"]["requests"]
        times, gaps = [], []
        for r in requests:
            if r["tag"] != "short" or not r["success"]:
                continue
            t = r["sent_at_s"] + r["ttft_ms"] / 1000
            for gap in r["itl_ms"]:
                t += gap / 1000
                times.append(t)
                gaps.append(gap)
        ax.scatter(times, gaps, s=3, alpha=0.35, color=COLORS.get(system), label="short streams: ITL per token")
        short = [r for r in requests if r["tag"] == "short" and r["success"] and r["tpot_ms"] is not None]
        ax.plot([r["sent_at_s"] + r["e2e_ms"] / 1000 for r in short], [r["tpot_ms"] for r in short], "k.",
                markersize=5, label="short request TPOT (at its end)")
        for index, r in enumerate(x for x in requests if x["tag"] == "long" and x["sent_at_s"] is not None):
            end = r["sent_at_s"] + (r["ttft_ms"] or 0) / 1000
            ax.axvspan(r["sent_at_s"], end, color="red", alpha=0.12,
                       label="long prompt: sent -> first token" if index == 0 else None)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"interference, {system}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the run started (s)")
    fig.tight_layout()
    path = out_dir / "interference_tpot.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def agent_ttft_per_turn(report: dict[str, Any]) -> dict[int, float]:
    """Median TTFT (ms) per turn index."""
    import statistics
    by_turn: dict[int, list[float]] = {}
    for r in report["requests"]:
        if r["success"]:
            by_turn.setdefault(r["turn"], []).append(r["ttft_ms"])
    return {turn: statistics.median(values) for turn, values in sorted(by_turn.items())}


def plot_agent(results: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for system, data in results["systems"].items():
        for key, style, caching in (("agent_cache", "-o", "prefix caching on"),
                                    ("agent_nocache", "--s", "prefix caching off")):
            if key in data:
                per_turn = agent_ttft_per_turn(data[key])
                ax.plot([t + 1 for t in per_turn], list(per_turn.values()), style, color=COLORS.get(system),
                        label=f"{system}, {caching}")
    ax.set_xlabel("turn")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title("agent: TTFT per turn (the prompt grows every turn)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "agent_ttft_per_turn.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# ---- the headline table -------------------------------------------------------------------------

def headline_table(results: dict[str, Any]) -> str:
    """Markdown rows: per workload and system, throughput, goodput, TTFT and TPOT percentiles; "err"
    counts every request that did not succeed (failed, unfinished or never sent)."""
    lines = ["| workload | system | ok/err | out tok/s | goodput req/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
             "| ITL p99 (ms) | cached |", "|---|---|---|---|---|---|---|---|---|"]

    def row(name: str, system: str, s: dict[str, Any]) -> None:
        hit = "-" if s["prefix_cache_hit_rate"] is None else f"{100 * s['prefix_cache_hit_rate']:.0f}%"
        not_ok = s["errors"] + s.get("incomplete", 0)
        lines.append(f"| {name} | {system} | {s['completed']}/{not_ok} | {s['output_token_throughput']:.1f} | "
                     f"{s['goodput']:.3f} | {_n(s['ttft_ms']['median'])} / {_n(s['ttft_ms']['p99'])} | "
                     f"{_n(s['tpot_ms']['median'])} / {_n(s['tpot_ms']['p99'])} | {_n(s['itl_ms']['p99'])} | {hit} |")
    systems = results["systems"]
    first = next(iter(systems.values()))
    for rate in sorted(first["chat"], key=float):
        for system, data in systems.items():
            row(f"chat @ {rate} req/s", system, data["chat"][rate]["summary"])
    for system, data in systems.items():
        row("interference (all)", system, data["interference"]["summary"])
        short = data["interference"]["by_tag"].get("short")
        if short:
            row("interference (short only)", system, short)
    for key, name in (("agent_cache", "agent, prefix caching"), ("agent_nocache", "agent, no prefix caching")):
        for system, data in systems.items():
            if key in data:
                row(name, system, data[key]["summary"])
    return "\n".join(lines)


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


# ---- main ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of "
                                                                    + ", ".join(SYSTEMS))
    parser.add_argument("--rates", default=None, help="chat request rates, comma-separated (default 0.25,0.5,1)")
    parser.add_argument("--smoke", action="store_true", help="a few requests of each workload")
    parser.add_argument("--plots-only", action="store_true", help="redraw the plots from <out>/compare.json")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `pdserve serve` argument for every system (repeatable, e.g. "
                             "--serve-arg=--max-num-batched-tokens=512)")
    parser.add_argument("--worker-niceness", type=int, default=0,
                        help="nice value of the Ray worker processes (Ray's own default is 15, which loses every "
                             "CPU contest on a shared machine); -1: leave Ray's default")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result_path = args.out / "compare.json"
    if args.plots_only:
        results = json.loads(result_path.read_text())
    else:
        systems = [s for s in args.systems.split(",") if s]
        unknown = [s for s in systems if s not in SYSTEMS]
        if unknown:
            print(f"compare: error: unknown system(s) {unknown}; choose from {list(SYSTEMS)}", file=sys.stderr)
            return 2
        plan = Plan.smoke() if args.smoke else Plan()
        if args.rates:
            plan.rates = [float(r) for r in args.rates.split(",")]
        results = {"plan": {**asdict(plan)}, "machine_before": machine_info(),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"), "systems": {}}
        started = time.monotonic()
        logs = Path(tempfile.mkdtemp(prefix="pdserve-compare-"))
        print(f"pdserve logs in {logs}", flush=True)
        niceness = None if args.worker_niceness < 0 else args.worker_niceness
        results["worker_niceness"] = niceness
        results["systems"] = run_side_by_side(systems, plan, logs, args.serve_arg, niceness)
        results["machine_after"] = machine_info()
        results["wall_s"] = time.monotonic() - started
        result_path.write_text(json.dumps(results, indent=1))
    for path in plot_all(results, args.out):
        print(f"wrote {path}")
    print(f"wrote {result_path}")
    print(headline_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
