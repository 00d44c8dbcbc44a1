"""Soak: `pdserve serve` under a steady mixed load for a long time, with a seeded fault every few minutes.

It starts `pdserve serve` (default model, CPU, 1 prefill + 2 decode workers, one torch thread per
worker, its own local Ray instance), drives a seeded mix of the serving workloads
(deploy/bench_workloads.py: chat, short and long prompts, code_edit, json_echo; every request
a streamed chat completion with `ignore_eos`) at a steady Poisson rate through the OpenAI API,
and injects a fault at each time of a seeded schedule (about every --fault-interval-s), cycling
through every kind before repeating one:

  kill_decode      SIGKILL of a ready decode worker's process (its streams should migrate to the
                   other decode worker; the controller replaces it)
  kill_prefill     SIGKILL of a ready prefill worker's process (decode workers prefill locally
                   meanwhile; the controller replaces it)
  sigstop_worker   SIGSTOP of a ready worker (either role) for --stop-s seconds, then SIGCONT
  kill_controller  SIGKILL of the controller actor's process (`ray::ControllerActor`); Ray restarts
                   it and it adopts the workers
  link_cut         every packet to or from a decode worker's gRPC and KV ports on loopback dropped
                   for --cut-s seconds (`tc`: an htb root qdisc on `lo` whose class for those ports
                   ends in a `pfifo limit 0`; the kernel here has no iptables, netem or tc drop
                   action); needs root, skipped with the reason otherwise

What it measures and writes (JSON, and a PNG of RSS over time with the faults marked):
  requests   sent / completed / failed (by reason: HTTP status + error body, or the stream's
             error event) / lost: a request whose response began (200 headers) but ended neither
             with [DONE] nor with an error event (a cut stream, or one still open at the end);
             migrated: the router's `pdserve:request_migrations` counter, and the requests the
             router logged as resumed on another worker (by response id)
  memory     every pdserve process's RSS (/proc) every --sample-interval-s: the serve process,
             router, controller, each worker by role, Ray's gcs_server and raylet; a replaced
             process is a new series. Each series' slope (MB/hour, 10^6 bytes, least squares over
             the second half of its life while the load ran)
  KV         every worker's used KV blocks (total - free, router's /status) once idle at the end
  faults     what each did, and when the cluster was whole again (controller status)

    python benchmarks/soak.py                                  # 30 min, 0.4 req/s, a fault every ~240 s
    python benchmarks/soak.py --duration-s 60                  # a quick check (no fault at that length)
    python benchmarks/soak.py --duration-s 120 --fault-interval-s 30 --out /tmp/soak.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import compare  # noqa: E402
from benchmarks.common import REPO, run_metadata  # noqa: E402
from deploy.bench import arrival_offsets  # noqa: E402
from deploy.bench_workloads import WorkloadConfig, build_workload  # noqa: E402

FAULT_KINDS = ("kill_decode", "kill_prefill", "sigstop_worker", "kill_controller", "link_cut")
RESULTS = REPO / "benchmarks" / "results"

# The mix: (kind, weight, the workload it comes from, that workload's tag). Outputs are
# sized so that streams run for seconds (a killed decode worker has streams to migrate).
MIX = (("chat", 0.5, "chat", None), ("short", 0.2, "interference", "short"),
       ("long", 0.1, "interference", "long"), ("code_edit", 0.1, "code_edit", None),
       ("json_echo", 0.1, "json_echo", None))
MIX_CONFIG = WorkloadConfig(long_input_len=1024, long_output_len=8, short_output_len=64,
                            edit_output_len=192, json_output_len=160)


# ---- the pure parts (tests/benchmarks/test_soak.py) -----------------------------------------------

def fault_schedule(duration_s: float, interval_s: float, seed: int, kinds: tuple[str, ...] = FAULT_KINDS,
                   jitter: float = 0.2) -> list[dict[str, Any]]:
    """Fault times and kinds: one per `interval_s` (the first at `interval_s`), each moved by up to
    `jitter` x interval either way, none in the last tail (min(90 s, interval / 2)) so that the
    run sees the recovery from the last one; the kinds cycle through seeded shuffles of `kinds`
    (every kind once before any repeats)."""
    if interval_s <= 0 or duration_s <= 0:
        return []
    rng = random.Random(seed)
    tail = min(90.0, interval_s / 2)
    schedule: list[dict[str, Any]] = []
    cycle: list[str] = []
    slot = interval_s
    while slot <= duration_s - tail:
        at = min(duration_s - tail, max(interval_s / 2, slot + rng.uniform(-jitter, jitter) * interval_s))
        if not cycle:
            cycle = rng.sample(list(kinds), len(kinds))
        schedule.append({"at_s": round(at, 1), "kind": cycle.pop(0)})
        slot += interval_s
    return schedule


def mixed_requests(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` single-turn chat requests drawn from MIX by weight (seeded): {kind, messages, max_tokens}."""
    rng = random.Random(seed)
    kinds = rng.choices([m[0] for m in MIX], [m[1] for m in MIX], k=count)
    needed = Counter(kinds)
    sizes: dict[str, int] = Counter()
    for kind, _, workload, tag in MIX:  # interference has one long prompt in `long_every`
        share = (MIX_CONFIG.long_every if tag == "long" else 2) if workload == "interference" else 1
        sizes[workload] = max(sizes[workload], needed[kind] * share + share)
    pools = {workload: build_workload(workload, size, MIX_CONFIG, seed=seed).conversations
             for workload, size in sizes.items()}
    picked: dict[str, int] = Counter()
    requests = []
    for kind in kinds:
        _, _, workload, tag = next(m for m in MIX if m[0] == kind)
        candidates = [c for c in pools[workload] if tag is None or c.turns[0].tag == tag]
        conversation = candidates[picked[kind] % len(candidates)]
        picked[kind] += 1
        turn = conversation.turns[0]
        messages = ([{"role": "system", "content": conversation.system_prompt}] if conversation.system_prompt
                    else []) + [{"role": "user", "content": turn.content}]
        requests.append({"kind": kind, "messages": messages, "max_tokens": turn.max_tokens})
    return requests


def linear_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs; None with fewer than 2 distinct xs."""
    if len(xs) < 2:
        return None
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var


def rss_slope_mb_per_hour(samples: list[tuple[float, int]], end_s: float | None = None,
                          min_points: int = 3) -> dict[str, Any] | None:
    """The RSS slope of one process over the second half of its life, in MB (10^6 bytes) per hour.
    `samples`: (seconds, RSS bytes), ascending; `end_s`: ignore samples after it (the load's end).
    None with fewer than `min_points` samples in that half."""
    kept = [(t, rss) for t, rss in samples if end_s is None or t <= end_s]
    if not kept:
        return None
    start, end = kept[0][0], kept[-1][0]
    half = [(t, rss) for t, rss in kept if t >= start + (end - start) / 2]
    if len(half) < min_points:
        return None
    slope = linear_slope([t for t, _ in half], [rss for _, rss in half])
    if slope is None:
        return None
    return {"mb_per_hour": round(slope * 3600 / 1e6, 2), "fit_from_s": round(half[0][0], 1),
            "fit_to_s": round(half[-1][0], 1), "points": len(half),
            "rss_mb_start": round(kept[0][1] / 1e6, 1), "rss_mb_fit_start": round(half[0][1] / 1e6, 1),
            "rss_mb_end": round(kept[-1][1] / 1e6, 1), "rss_mb_max": round(max(r for _, r in kept) / 1e6, 1)}


def classify(record: dict[str, Any]) -> tuple[str, str]:
    """(outcome, reason) of one request record: `completed` (200, [DONE], no error event, a finish
    reason), `failed` (refused: no 200 or no answer at all; or a 200 whose stream carried an error
    event: the client was told), `lost` (200 headers, then neither [DONE] nor an error event:
    cut, or still open when the run ended), or `not_sent`."""
    if not record.get("sent"):
        return "not_sent", ""
    status = record.get("status")
    if status is None:
        return "failed", f"no response: {record.get('exception') or 'unknown'}"
    if status != 200:
        return "failed", f"HTTP {status}: {record.get('error_body') or '(empty body)'}"
    if record.get("error_event"):
        return "failed", f"HTTP 200, then a stream error event: {record['error_event']}"
    if record.get("done") and record.get("finish_reason"):
        return "completed", ""
    if record.get("done"):
        return "lost", "[DONE] without a finish reason"
    if record.get("exception"):
        return "lost", f"HTTP 200, then the stream broke: {record['exception']}"
    if record.get("open_at_end"):
        return "lost", "HTTP 200, still open when the run ended"
    return "lost", "HTTP 200, then the stream ended without [DONE]"


def _reason_key(reason: str) -> str:
    """A reason with addresses, ids and counts blanked, so the same failure counts once."""
    reason = re.sub(r"\d+\.\d+\.\d+\.\d+:\d+", "<addr>", reason)
    reason = re.sub(r"(chat)?cmpl-[0-9a-f]+", "<id>", reason)
    return re.sub(r"\b\d+(\.\d+)?\b", "<n>", reason)[:300]


def account(records: list[dict[str, Any]], migrated_ids: set[str] = frozenset()) -> dict[str, Any]:
    """The request table: sent, completed, failed (by reason), lost (with their ids and reasons),
    migrated (of the sent requests, those whose response id the router logged as resumed),
    completions shorter than their max_tokens (with ignore_eos, a sign of a cut generation)."""
    outcomes = [(r, *classify(r)) for r in records]
    sent = [o for o in outcomes if o[1] != "not_sent"]
    failed = [o for o in outcomes if o[1] == "failed"]
    lost = [o for o in outcomes if o[1] == "lost"]
    completed = [o for o in outcomes if o[1] == "completed"]
    short = [r for r, outcome, _ in completed
             if r.get("completion_tokens") is not None and r["completion_tokens"] < r["max_tokens"]]
    accepted = [o for o in sent if o[0].get("status") == 200]
    return {"sent": len(sent), "completed": len(completed), "failed": len(failed), "lost": len(lost),
            "accepted": len(accepted), "not_sent": len(outcomes) - len(sent),
            "accepted_then_failed": sum(1 for o in failed if o[0].get("status") == 200),
            "migrated": sum(1 for r, _, _ in sent if r.get("response_id") in migrated_ids),
            "migrated_completed": sum(1 for r, _, _ in completed if r.get("response_id") in migrated_ids),
            "failed_by_reason": dict(Counter(_reason_key(reason) for _, _, reason in failed).most_common()),
            "lost_requests": [{"index": r["index"], "response_id": r.get("response_id"), "kind": r["kind"],
                               "sent_at_s": r.get("sent_at_s"), "tokens": r.get("tokens_streamed"),
                               "reason": reason} for r, _, reason in lost],
            "short_completions": [{"index": r["index"], "response_id": r.get("response_id"),
                                   "completion_tokens": r["completion_tokens"], "max_tokens": r["max_tokens"]}
                                  for r in short]}


MIGRATION_LINE = re.compile(r"request (\S+): decode worker (\S+) failed after (\d+) tokens \((.*)\); resuming")


def migrations_in_log(lines: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Response id -> the router's migration log lines for it (one per migration)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        match = MIGRATION_LINE.search(line)
        if match:
            found.setdefault(match.group(1), []).append(
                {"worker": match.group(2), "after_tokens": int(match.group(3)), "reason": match.group(4)})
    return found


# ---- processes (/proc) ------------------------------------------------------------------------

def _proc_children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    children, found, stack = _proc_children(), [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def memory_bytes(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon) of a process in bytes, or None. RssAnon leaves out shared mappings: a decode
    worker maps its prefill workers' KV caches (shm transport), which come and go with them."""
    found: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "RssAnon:")):
                found[line.split(":")[0]] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "VmRSS" not in found:
        return None
    return found["VmRSS"], found.get("RssAnon", found["VmRSS"])


def alive(pid: int, started: str | None = None) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and (started is None or start_time(pid) == started)


def process_role(pid: int, serve_pid: int, command: str, workers: dict[int, dict[str, Any]]) -> str | None:
    """What a process of the cluster is, or None for one not followed (Ray's helpers, idle workers)."""
    if pid == serve_pid:
        return "serve"
    if pid in workers:
        return workers[pid]["role"]
    if "deploy.router_process" in command:
        return "router"
    if command.startswith("ray::ControllerActor"):
        return "controller"
    if command.startswith("ray::WorkerActor"):
        return "worker"  # not in the controller's status yet (starting)
    for daemon in ("gcs_server", "raylet"):
        if command.split(" ", 1)[0].endswith(daemon):
            return f"ray:{daemon}"
    return None


# ---- pdserve serve ------------------------------------------------------------------------------

PACKAGES = ("decode_worker", "deploy", "engine", "kvtransfer", "prefill_worker", "router", "serving", "wire")


def snapshot_source(dest: Path) -> str:
    """Copy pdserve's packages into `dest` (every process of the run imports them from there, so
    edits to the checkout during a long run do not reach workers started after a fault); returns
    a sha256 of the copied files, which names the code that ran."""
    import hashlib
    digest = hashlib.sha256()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build")
    for package in PACKAGES:
        shutil.copytree(REPO / package, dest / package, ignore=ignore)
    for path in sorted(dest.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(dest)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class ServeProcess(compare.ServeProcess):
    """`python -m deploy serve ...` (compare.py's) at log level info, run from `source` (the
    checkout or its snapshot), its warnings, errors and migration lines kept in `lines`."""

    def __init__(self, args: list[str], log_path: Path, state_file: Path, source: Path = REPO) -> None:
        self.lines: list[str] = []  # warnings, errors and migration lines (not every INFO line)
        env = {"OMP_NUM_THREADS": "1", "PDSERVE_STATE_FILE": str(state_file)}
        if source != REPO:  # imported from the snapshot, by this process and every one it starts
            env["PYTHONPATH"] = os.pathsep.join([str(source), *filter(None, [os.environ.get("PYTHONPATH")])])
        super().__init__(args, log_path, state_file, env=env, cwd=source, log_level="info")

    def on_line(self, line: str) -> None:
        if any(word in line for word in ("WARNING", "ERROR", "Traceback", "resuming", "CRITICAL")):
            self.lines.append(line.rstrip("\n"))

    def stop(self, timeout_s: float = 180.0) -> int | None:
        return super().stop(timeout_s)


# ---- link cut (tc on lo) ------------------------------------------------------------------------

def link_cut_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (tc on lo)"
    if shutil.which("tc") is None:
        return "no tc"
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    if shown.returncode != 0:
        return f"tc qdisc show dev lo failed: {shown.stderr.strip()}"
    if not shown.stdout.strip().startswith("qdisc noqueue"):
        return f"lo already has a qdisc ({shown.stdout.strip().splitlines()[0]}): not touched"
    return None


def _tc(*args: str) -> None:
    result = subprocess.run(["tc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {(result.stderr or result.stdout).strip()}")


def cut_ports(ports: list[int]) -> None:
    """Drop every loopback packet to or from `ports` until `restore_lo()`."""
    _tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "0")
    try:
        _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "1gbit")
        _tc("qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:", "pfifo", "limit", "0")
        for port in ports:
            for direction in ("dport", "sport"):
                _tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                    "match", "ip", direction, str(port), "0xffff", "flowid", "1:1")
    except Exception:
        restore_lo()
        raise


def restore_lo() -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, text=True)


def _port(address: str) -> int | None:
    match = re.search(r":(\d+)$", address or "")
    return int(match.group(1)) if match else None


# ---- the run -------------------------------------------------------------------------------------

class Soak:
    def __init__(self, args: argparse.Namespace, serve: ServeProcess) -> None:
        self.args = args
        self.serve = serve
        self.url = serve.url
        self.t0 = time.monotonic()
        self.load_end_s: float | None = None
        self.records: list[dict[str, Any]] = []
        self.series: dict[str, dict[str, Any]] = {}  # "pid:start" -> {role, label, pid, samples}
        self.workers: dict[int, dict[str, Any]] = {}  # pid -> {"role", "worker_id"} (every pid ever seen)
        self.events: dict[tuple, str] = {}  # the controller's events, (time, message)
        self.faults: list[dict[str, Any]] = []
        self.metrics_samples: list[dict[str, Any]] = []
        self.worker_samples: list[dict[str, Any]] = []  # the router's /status every sample
        self.stopped: set[int] = set()  # SIGSTOPped pids to SIGCONT whatever happens
        self.lo_cut = False
        self.rng = random.Random(args.seed + 1)
        self.http = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def admin_status(self, timeout: float = 10.0) -> dict[str, Any] | None:
        try:
            answer = await self.http.get(f"{self.url}/admin/status", timeout=timeout)
            if answer.status_code == 200:
                status = answer.json()
                for w in status.get("workers", []):
                    if w.get("pid"):
                        self.workers[w["pid"]] = {"role": w["role"], "worker_id": w["worker_id"]}
                for event in status.get("events", []):
                    self.events[(event["time"], event["message"])] = event["message"]
                return status
        except Exception:  # noqa: BLE001 - the controller may be restarting
            return None
        return None

    async def router_status(self) -> dict[str, Any] | None:
        try:
            answer = await self.http.get(f"{self.url}/status", timeout=30)
            return answer.json() if answer.status_code == 200 else None
        except Exception:  # noqa: BLE001
            return None

    async def migrations_counter(self) -> float | None:
        try:
            text = (await self.http.get(f"{self.url}/metrics", timeout=10)).text
        except Exception:  # noqa: BLE001
            return None
        for line in text.splitlines():
            if line.startswith("pdserve:request_migrations_total"):
                return float(line.split()[-1])
        return None

    # -- sampling
    def sample_processes(self) -> None:
        now = self.now()
        for pid in [self.serve.pid, *descendants(self.serve.pid)]:
            command = cmdline(pid)
            role = process_role(pid, self.serve.pid, command, self.workers)
            if role is None:
                continue
            started = start_time(pid)
            memory = memory_bytes(pid)
            if started is None or memory is None:
                continue
            key = f"{pid}:{started}"
            series = self.series.setdefault(key, {"pid": pid, "role": role, "label": role, "samples": [],
                                                   "first_seen_s": round(now, 1)})
            if role != "worker":  # a starting worker's role is known once the controller lists it
                series["role"] = role
            series["label"] = self.workers[pid]["worker_id"] if pid in self.workers else series["role"]
            series["samples"].append((round(now, 1), *memory))
            series["last_seen_s"] = round(now, 1)

    async def sample_workers(self) -> None:
        """Each worker's load as the router sees it (a fresh poll): what a stall or a leak looks like."""
        status = await self.router_status()
        if status is None:
            self.worker_samples.append({"t_s": round(self.now(), 1), "error": "no /status answer"})
            return
        self.worker_samples.append({"t_s": round(self.now(), 1), "router_inflight": status["inflight_requests"],
                                    "workers": [[w["role"], w["address"], w["healthy"], w["running"], w["waiting"],
                                                 w["kv_blocks_total"] - w["kv_blocks_free"],
                                                 w["router_inflight_requests"]] for w in status["workers"]]})

    async def sampler(self, stop: asyncio.Event) -> None:
        """RSS on its own clock (reading /proc never waits); the HTTP samples beside it (they may
        wait for a stopped worker or a restarting controller)."""
        async def processes() -> None:
            while not stop.is_set():
                self.sample_processes()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.args.sample_interval_s)

        async def http() -> None:
            while not stop.is_set():
                await self.admin_status()
                await self.sample_workers()
                migrations = await self.migrations_counter()
                self.metrics_samples.append({"t_s": round(self.now(), 1), "request_migrations": migrations})
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.args.sample_interval_s)

        await self.admin_status()  # the workers' roles before the first RSS sample
        await asyncio.gather(processes(), http())

    # -- load
    async def one_request(self, index: int, request: dict[str, Any], model: str) -> None:
        import httpx
        record = self.records[index]
        payload = {"model": model, "messages": request["messages"], "max_tokens": request["max_tokens"],
                   "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
                   "ignore_eos": True}
        record.update(sent=True, sent_at_s=round(self.now(), 3))
        try:
            async with self.http.stream("POST", f"{self.url}/v1/chat/completions", json=payload,
                                        timeout=httpx.Timeout(self.args.request_timeout_s, connect=30.0)) as response:
                record["status"] = response.status_code
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", errors="replace")
                    record["error_body"] = _error_message(body)
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        record["done"] = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record["error_event"] = _error_message(json.dumps(chunk))
                        continue
                    record.setdefault("response_id", chunk.get("id"))
                    for choice in chunk.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            record["tokens_streamed"] = record.get("tokens_streamed", 0) + 1
                            record.setdefault("ttft_s", round(self.now() - record["sent_at_s"], 3))
                        if choice.get("finish_reason"):
                            record["finish_reason"] = choice["finish_reason"]
                    if chunk.get("usage"):
                        record["completion_tokens"] = chunk["usage"].get("completion_tokens")
                        record["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
        except asyncio.CancelledError:
            record["open_at_end"] = True
            raise
        except Exception as exc:  # noqa: BLE001 - recorded
            record["exception"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            record["ended_at_s"] = round(self.now(), 3)

    async def load(self, model: str) -> list[asyncio.Task]:
        duration = self.args.duration_s
        count = max(1, int(duration * self.args.rate * 1.5) + 10)
        requests = mixed_requests(count, self.args.seed)
        offsets = arrival_offsets(count, self.args.rate, random.Random(self.args.seed))
        tasks = []
        for index, (request, offset) in enumerate(zip(requests, offsets)):
            if offset >= duration:
                break
            self.records.append({"index": index, "kind": request["kind"], "max_tokens": request["max_tokens"],
                                 "sent": False})
            delay = offset - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one_request(index, request, model)))
        await asyncio.sleep(max(0.0, duration - self.now()))
        self.load_end_s = self.now()
        return tasks

    # -- faults
    async def faults_loop(self, schedule: list[dict[str, Any]]) -> None:
        for planned in schedule:
            await asyncio.sleep(max(0.0, planned["at_s"] - self.now()))
            fault = {"planned_at_s": planned["at_s"], "kind": planned["kind"], "at_s": round(self.now(), 1)}
            self.faults.append(fault)
            print(f"[soak {self.now():7.1f} s] fault: {planned['kind']}", flush=True)
            try:
                await getattr(self, f"fault_{planned['kind']}")(fault)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is recorded
                fault["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[soak {self.now():7.1f} s]   {json.dumps({k: v for k, v in fault.items() if k != 'kind'})}",
                  flush=True)

    async def _ready_worker(self, roles: tuple[str, ...]) -> dict[str, Any] | None:
        status = await self.admin_status()
        if status is None:
            return None
        ready = [w for w in status["workers"] if w["role"] in roles and w["state"] == "ready" and w.get("pid")]
        return self.rng.choice(ready) if ready else None

    def _target(self, fault: dict[str, Any], worker: dict[str, Any]) -> None:
        fault.update(worker_id=worker["worker_id"], role=worker["role"], pid=worker["pid"],
                     address=worker["address"])

    async def _kill_worker(self, fault: dict[str, Any], role: str) -> None:
        worker = await self._ready_worker((role,))
        if worker is None:
            fault["skipped"] = f"no ready {role} worker (or no controller answer)"
            return
        self._target(fault, worker)
        os.kill(worker["pid"], signal.SIGKILL)
        fault["injected_at_s"] = round(self.now(), 1)
        asyncio.create_task(self.watch_recovery(fault, replaced_pid=worker["pid"], role=role))

    async def fault_kill_decode(self, fault: dict[str, Any]) -> None:
        await self._kill_worker(fault, "decode")

    async def fault_kill_prefill(self, fault: dict[str, Any]) -> None:
        await self._kill_worker(fault, "prefill")

    async def fault_sigstop_worker(self, fault: dict[str, Any]) -> None:
        worker = await self._ready_worker(("prefill", "decode"))
        if worker is None:
            fault["skipped"] = "no ready worker (or no controller answer)"
            return
        self._target(fault, worker)
        pid = worker["pid"]
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        fault["injected_at_s"] = round(self.now(), 1)
        try:
            await asyncio.sleep(self.args.stop_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self.stopped.discard(pid)
        fault["resumed_at_s"] = round(self.now(), 1)
        fault["alive_after"] = alive(pid)
        asyncio.create_task(self.watch_recovery(fault, replaced_pid=None, role=worker["role"], same_pid=pid))

    async def fault_kill_controller(self, fault: dict[str, Any]) -> None:
        pids = [pid for pid in descendants(self.serve.pid) if cmdline(pid).startswith("ray::ControllerActor")]
        if len(pids) != 1:
            fault["skipped"] = f"found {len(pids)} controller processes"
            return
        [pid] = pids
        fault.update(pid=pid)
        os.kill(pid, signal.SIGKILL)
        fault["injected_at_s"] = round(self.now(), 1)
        asyncio.create_task(self.watch_controller(fault, pid))

    async def fault_link_cut(self, fault: dict[str, Any]) -> None:
        reason = link_cut_unavailable_reason()
        if reason:
            fault["skipped"] = reason
            return
        worker = await self._ready_worker(("decode",))
        if worker is None:
            fault["skipped"] = "no ready decode worker (or no controller answer)"
            return
        self._target(fault, worker)
        ports = [p for p in (_port(worker["address"]), _port(worker.get("transport_address", ""))) if p]
        fault["ports"] = ports
        cut_ports(ports)
        self.lo_cut = True
        fault["injected_at_s"] = round(self.now(), 1)
        try:
            await asyncio.sleep(self.args.cut_s)
        finally:
            restore_lo()
            self.lo_cut = False
        fault["restored_at_s"] = round(self.now(), 1)
        asyncio.create_task(self.watch_recovery(fault, replaced_pid=None, role="decode", same_pid=worker["pid"]))

    async def watch_recovery(self, fault: dict[str, Any], replaced_pid: int | None, role: str,
                             same_pid: int | None = None, timeout_s: float = 600.0) -> None:
        """When the pools were whole again: settled, at their targets, every worker healthy (and the
        killed pid gone from them); for a stopped or cut worker, whether it is still the same one."""
        start = self.now()
        while self.now() - start < timeout_s:
            status = await self.admin_status()
            if status is not None:
                pids = {w.get("pid") for w in status["workers"]}
                ready = status["settled"] and all(w["healthy"] for w in status["workers"])
                if replaced_pid is not None and replaced_pid not in pids and ready:
                    fault["recovered_at_s"] = round(self.now(), 1)
                    fault["recovered_after_s"] = round(self.now() - fault["injected_at_s"], 1)
                    return
                if same_pid is not None and ready:
                    fault["recovered_at_s"] = round(self.now(), 1)
                    fault["recovered_after_s"] = round(self.now() - fault["injected_at_s"], 1)
                    fault["same_worker_kept"] = same_pid in pids
                    return
            await asyncio.sleep(2.0)
        fault["recovered_at_s"] = None

    async def watch_controller(self, fault: dict[str, Any], old_pid: int, timeout_s: float = 300.0) -> None:
        start = self.now()
        while self.now() - start < timeout_s:
            status = await self.admin_status(timeout=5.0)
            new = [pid for pid in descendants(self.serve.pid) if cmdline(pid).startswith("ray::ControllerActor")]
            if status is not None and new and old_pid not in new:
                fault["recovered_at_s"] = round(self.now(), 1)
                fault["recovered_after_s"] = round(self.now() - fault["injected_at_s"], 1)
                fault["new_pid"] = new[0]
                fault["adopted"] = [e for e in status.get("events", []) if "controller restarted" in e["message"]][-1:]
                return
            await asyncio.sleep(1.0)
        fault["recovered_at_s"] = None

    # -- the end
    async def wait_idle(self, timeout_s: float) -> dict[str, Any]:
        """Poll the router's /status until no worker runs, waits or holds a KV block (or `timeout_s`)."""
        start = self.now()
        first = last = None
        while True:
            status = await self.router_status()
            if status is not None:
                workers = [{"address": w["address"], "role": w["role"], "running": w["running"],
                            "waiting": w["waiting"], "kv_blocks_total": w["kv_blocks_total"],
                            "kv_blocks_used": w["kv_blocks_total"] - w["kv_blocks_free"],
                            "kv_blocks_cached": w["kv_blocks_cached"]} for w in status["workers"]]
                last = {"t_s": round(self.now(), 1), "router_inflight": status["inflight_requests"],
                        "workers": workers}
                first = first or last
                if all(w["kv_blocks_used"] == 0 and not w["running"] and not w["waiting"] for w in workers) \
                        and workers:
                    return {"idle": True, "after_s": round(self.now() - start, 1), "first": first, "final": last}
            if self.now() - start > timeout_s:
                return {"idle": False, "after_s": round(self.now() - start, 1), "first": first, "final": last}
            await asyncio.sleep(2.0)

    async def run(self) -> dict[str, Any]:
        import httpx
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=30.0) as http:
            self.http = http
            models = (await http.get(f"{self.url}/v1/models")).json()["data"]
            model = models[0]["id"]
            schedule = fault_schedule(self.args.duration_s, self.args.fault_interval_s, self.args.seed)
            print(f"[soak] {self.args.duration_s:g} s at {self.args.rate:g} req/s; faults: "
                  f"{[(f['at_s'], f['kind']) for f in schedule]}", flush=True)
            stop_sampling = asyncio.Event()
            sampler = asyncio.create_task(self.sampler(stop_sampling))
            faults = asyncio.create_task(self.faults_loop(schedule))
            tasks = await self.load(model)
            print(f"[soak {self.now():7.1f} s] load ended; waiting up to {self.args.drain_s:g} s for "
                  f"{sum(1 for t in tasks if not t.done())} open request(s)", flush=True)
            await faults  # its last one is at least the tail before the end
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=self.args.drain_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            idle = await self.wait_idle(self.args.idle_timeout_s)
            print(f"[soak {self.now():7.1f} s] idle: {idle['idle']} after {idle['after_s']} s", flush=True)
            await asyncio.sleep(1.0)
            stop_sampling.set()
            await sampler
            self.sample_processes()
            final_status = await self.admin_status()
            migrations = await self.migrations_counter()
            self.metrics_samples.append({"t_s": round(self.now(), 1), "request_migrations": migrations})
        return {"schedule": schedule, "idle": idle, "final_status": final_status, "model": model}


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
    except (ValueError, AttributeError):
        pass
    return body.strip()[:300] or "(empty body)"


def plot(series: dict[str, dict[str, Any]], faults: list[dict[str, Any]], load_end_s: float | None,
         path: Path, title: str) -> None:
    """Three panels over time: the workers' RSS, their RssAnon (without shared mappings), and the
    other processes' RSS; one line per process (a replaced one is a new line), faults dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (rss_axis, anon_axis, small) = plt.subplots(3, 1, figsize=(14, 11), sharex=True)
    palette = plt.get_cmap("tab20").colors
    ordered = sorted((s for s in series.values() if len(s["samples"]) >= 2),
                     key=lambda s: (s["role"] not in ("prefill", "decode", "worker"), s["role"], s["first_seen_s"]))
    for index, s in enumerate(ordered):
        xs = [sample[0] / 60 for sample in s["samples"]]
        label = f"{s['label']} (pid {s['pid']})"
        color = palette[index % len(palette)]
        if s["role"] in ("prefill", "decode", "worker"):
            rss_axis.plot(xs, [sample[1] / 1e6 for sample in s["samples"]], color=color, lw=1.3, label=label)
            anon_axis.plot(xs, [sample[2] / 1e6 for sample in s["samples"]], color=color, lw=1.3, label=label)
        else:
            small.plot(xs, [sample[1] / 1e6 for sample in s["samples"]], color=color, lw=1.3, label=label)
    for axis in (rss_axis, anon_axis, small):
        for fault in faults:
            if "injected_at_s" in fault:
                axis.axvline(fault["injected_at_s"] / 60, color="black", ls="--", lw=0.8, alpha=0.6)
        if load_end_s is not None:
            axis.axvline(load_end_s / 60, color="gray", ls=":", lw=1.2)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    low = rss_axis.get_ylim()[0]
    for fault in faults:
        if "injected_at_s" in fault:
            rss_axis.text(fault["injected_at_s"] / 60, low, " " + fault["kind"], rotation=90, va="bottom",
                          fontsize=8)
    rss_axis.set_ylabel("workers: RSS (MB)")
    anon_axis.set_ylabel("workers: RssAnon (MB)")
    small.set_ylabel("others: RSS (MB)")
    small.set_xlabel("minutes since the cluster was ready (dashed: faults; dotted: the load ended)")
    rss_axis.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=1800.0, help="how long the load runs")
    parser.add_argument("--rate", type=float, default=0.4, help="requests per second (Poisson)")
    parser.add_argument("--fault-interval-s", type=float, default=240.0, help="one fault about this often (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default benchmarks/results/soak-<UTC date>.json; the PNG beside it)")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--stop-s", type=float, default=20.0, help="how long a SIGSTOPped worker stays stopped")
    parser.add_argument("--cut-s", type=float, default=20.0, help="how long a link cut lasts")
    parser.add_argument("--sample-interval-s", type=float, default=10.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0,
                        help="per request: the longest wait for its response's next bytes")
    parser.add_argument("--drain-s", type=float, default=240.0, help="after the load: the wait for open requests")
    parser.add_argument("--idle-timeout-s", type=float, default=120.0,
                        help="then the longest wait for every worker to be idle with no KV block held")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more `pdserve serve` argument")
    parser.add_argument("--no-snapshot", action="store_true",
                        help="run the checkout's code as it is on disk (default: a copy taken at the start)")
    parser.add_argument("--no-git", action="store_true",
                        help="record no commit (run_metadata runs no git command)")
    args = parser.parse_args(argv)
    if not args.rate > 0 or not args.duration_s > 0:
        parser.error("--rate and --duration-s must be > 0")

    started_utc = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or RESULTS / f"soak-{started_utc:%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pdsoak-", dir="/tmp"))
    ray_temp = workdir / "ray"
    serve_args = ["--model", "default", "--device", "cpu", "--prefill", str(args.prefill), "--decode",
                  str(args.decode), "--omp-num-threads", "1", "--kv-cache-memory-gb", "0.5",
                  "--ray-temp-dir", str(ray_temp), *args.serve_arg]
    log_path = workdir / "serve.log"
    source, source_sha256 = REPO, None
    if not args.no_snapshot:
        source = workdir / "src"
        source_sha256 = snapshot_source(source)
        print(f"[soak] pdserve's code copied to {source} (sha256 {source_sha256[:16]})", flush=True)
    print(f"[soak] pdserve serve {' '.join(serve_args)} (log {log_path})", flush=True)
    serve = ServeProcess(serve_args, log_path, workdir / "serve.json", source)
    soak: Soak | None = None
    startup_s: float | None = None
    outcome: dict[str, Any] = {}
    seen: dict[int, str] = {}
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM,)}
    try:
        ready_started = time.monotonic()
        serve.wait_ready(900)
        startup_s = time.monotonic() - ready_started
        print(f"[soak] ready at {serve.url} after {startup_s:.0f} s", flush=True)
        soak = Soak(args, serve)
        outcome = asyncio.run(soak.run())
    except KeyboardInterrupt:
        print("[soak] interrupted: stopping", flush=True)
        outcome["interrupted"] = True
    except Exception:  # a bug here: stop the cluster and keep what was measured
        import traceback
        outcome["error"] = traceback.format_exc()
        print(f"[soak] failed: stopping\n{outcome['error']}", flush=True)
    finally:
        if soak is not None:
            for pid in list(soak.stopped):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            if soak.lo_cut:
                restore_lo()
        seen = {pid: start_time(pid) for pid in [serve.pid, *descendants(serve.pid)]}
        stop_started = time.monotonic()
        exit_status = serve.stop()
        stop_s = time.monotonic() - stop_started
        deadline = time.monotonic() + 60
        leftovers = [pid for pid, st in seen.items() if st and alive(pid, st)]
        while leftovers and time.monotonic() < deadline:
            time.sleep(0.5)
            leftovers = [pid for pid, st in seen.items() if st and alive(pid, st)]
        leftover_commands = {pid: cmdline(pid) for pid in leftovers}
        for pid in leftovers:  # ours: started below the serve process
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if soak is None:
        print(f"[soak] pdserve serve did not start; log: {log_path}", file=sys.stderr)
        return 1

    with contextlib.suppress(Exception):  # what was measured, before anything below can fail
        (workdir / "raw.json").write_text(json.dumps({
            "records": soak.records, "series": soak.series, "faults": soak.faults, "outcome": outcome,
            "worker_samples": soak.worker_samples, "metrics": soak.metrics_samples}, default=str))
    log_lines = serve.lines
    migrated = migrations_in_log(log_lines)
    table = account(soak.records, set(migrated))
    counter = [m["request_migrations"] for m in soak.metrics_samples if m["request_migrations"] is not None]
    table["request_migrations_counter"] = (max(counter) if counter else None)
    table["migrations_logged"] = sum(len(v) for v in migrated.values())
    slopes = {}
    for key, s in soak.series.items():
        lifetime = s["last_seen_s"] - s["first_seen_s"]
        fit = rss_slope_mb_per_hour([(t, rss) for t, rss, _ in s["samples"]], end_s=soak.load_end_s)
        anon_fit = rss_slope_mb_per_hour([(t, anon) for t, _, anon in s["samples"]], end_s=soak.load_end_s)
        slopes[key] = {"role": s["role"], "label": s["label"], "pid": s["pid"], "first_seen_s": s["first_seen_s"],
                       "last_seen_s": s["last_seen_s"], "lifetime_s": round(lifetime, 1),
                       "long_lived": lifetime >= 0.5 * args.duration_s, "fit": fit, "anon_fit": anon_fit}
    by_kind = Counter(r["kind"] for r in soak.records if r.get("sent"))
    ttfts = sorted(r["ttft_s"] for r in soak.records if "ttft_s" in r)
    if args.no_git:
        import deploy.bench_record
        deploy.bench_record._git = lambda *git_args: None
    result = {
        "benchmark": "soak", "run": run_metadata(argv if argv is not None else sys.argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "serve_command": "pdserve serve " + " ".join(a for a in serve_args if not a.startswith(str(workdir))),
        "source": {"snapshot": not args.no_snapshot, "sha256": source_sha256,
                   "taken_utc": started_utc.isoformat(timespec="seconds")},
        "mix": [{"kind": kind, "weight": weight, "workload": workload, "tag": tag} for kind, weight, workload, tag in MIX],
        "mix_config": {k: getattr(MIX_CONFIG, k) for k in ("long_input_len", "long_output_len", "short_input_len",
                                                           "short_output_len", "edit_output_len", "json_output_len",
                                                           "chat_output_median", "chat_output_max")},
        "startup_s": round(startup_s, 1) if startup_s is not None else None,
        "load_end_s": soak.load_end_s, "interrupted": outcome.get("interrupted", False),
        "error": outcome.get("error"),
        "requests": table, "sent_by_kind": dict(by_kind),
        "ttft_s": {"median": ttfts[len(ttfts) // 2], "p99": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
                   "max": ttfts[-1]} if ttfts else None,
        "migrations_by_response_id": migrated,
        "faults_planned": outcome.get("schedule"), "faults": soak.faults,
        "kv_at_idle": outcome.get("idle"),
        "rss_slopes": slopes,
        "rss_series_fields": ["seconds", "VmRSS bytes", "RssAnon bytes"],
        "rss_series": {key: {"role": s["role"], "label": s["label"], "pid": s["pid"], "samples": s["samples"]}
                       for key, s in soak.series.items()},
        "migrations_counter_samples": soak.metrics_samples,
        "worker_load_fields": ["role", "address", "healthy", "running", "waiting", "kv_blocks_used",
                               "router_inflight"],
        "worker_load_samples": soak.worker_samples,
        "controller_events": [{"time": t, "message": m} for (t, m) in sorted(soak.events)],
        "final_status_workers": [{k: w.get(k) for k in ("worker_id", "role", "state", "pid", "healthy", "age_s",
                                                        "rss_bytes", "kv_blocks_total", "kv_blocks_free")}
                                 for w in (outcome.get("final_status") or {}).get("workers", [])],
        "serve_warnings": log_lines[-2000:], "serve_log": str(log_path), "ray_session": str(ray_temp),
        "shutdown": {"exit_status": exit_status, "seconds": round(stop_s, 1), "processes_seen": len(seen),
                     "left_after_60_s": leftover_commands},
        "requests_detail": soak.records,
    }
    log_copy = out.with_suffix(".log")
    if log_path.exists() and log_path.stat().st_size < 20_000_000:
        shutil.copyfile(log_path, log_copy)
        result["serve_log"] = str(log_copy.relative_to(REPO) if log_copy.is_relative_to(REPO) else log_copy)
    if source != REPO:  # the code snapshot (Ray's session folder, with the workers' logs, is kept)
        shutil.rmtree(source, ignore_errors=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    png = out.with_suffix(".png")
    title = (f"pdserve soak: {args.duration_s:g} s at {args.rate:g} req/s, {args.prefill} prefill + {args.decode} "
             f"decode (CPU), seed {args.seed}; {result['run'].get('cpu_model')}")
    plot(soak.series, soak.faults, soak.load_end_s, png, title)
    print_summary(result, out, png)
    return 0


def print_summary(result: dict[str, Any], out: Path, png: Path) -> None:
    t = result["requests"]
    print(f"\nrequests: sent {t['sent']}, completed {t['completed']}, failed {t['failed']} "
          f"({t['accepted_then_failed']} after a 200), lost {t['lost']}, migrated {t['migrated']} "
          f"(counter {t['request_migrations_counter']}), short completions {len(t['short_completions'])}")
    for reason, count in t["failed_by_reason"].items():
        print(f"  failed x{count}: {reason}")
    for lost in t["lost_requests"]:
        print(f"  lost: {lost}")
    print("faults:")
    for fault in result["faults"]:
        print(f"  {json.dumps(fault)}")
    print("RSS slopes (MB/hour, second half of each life while the load ran):")
    for s in sorted(result["rss_slopes"].values(), key=lambda s: (s["role"], s["first_seen_s"])):
        fit, anon = s["fit"], s["anon_fit"]
        print(f"  {s['label']:>16} pid {s['pid']:>7} {s['role']:>14} lived {s['lifetime_s']:7.0f} s  "
              + (f"RSS {fit['mb_per_hour']:+9.1f} MB/h ({fit['rss_mb_start']:.0f} -> {fit['rss_mb_end']:.0f} MB), "
                 f"RssAnon {anon['mb_per_hour']:+9.1f} MB/h ({anon['rss_mb_start']:.0f} -> {anon['rss_mb_end']:.0f} MB)"
                 if fit and anon else "(too few samples)"))
    idle = result["kv_at_idle"]
    if idle and idle.get("final"):
        print(f"KV at idle (idle: {idle['idle']} after {idle['after_s']} s): "
              + ", ".join(f"{w['role']} {w['address']}: {w['kv_blocks_used']}/{w['kv_blocks_total']} used"
                          for w in idle["final"]["workers"]))
    print(f"shutdown: exit {result['shutdown']['exit_status']} in {result['shutdown']['seconds']} s; "
          f"left: {result['shutdown']['left_after_60_s'] or 'none'}")
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    sys.exit(main())
