"""`pdserve serve` as a user runs it (a subprocess: local Ray, default model, CPU, 1 prefill + 1
decode), driven by the official `openai` client and the `pdserve scale/status` commands:

- greedy completions equal the offline engine's (`engine.LLM`);
- the decode pool goes 1 -> 2 -> 1 while a stream runs on the worker that is drained: the stream
  completes with the offline engine's tokens, and the drain ends only after it;
- a killed worker process: its stream ends with a clear error, the pool is back at size with a
  new worker (`pdserve status`), and requests are served again;
- SIGINT stops everything: no process of the cluster is left.
"""
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 900
NUM_BLOCKS = 256
PLAIN = "The quick brown fox"
STORY = "Once upon a time, in a small village at the edge of a forest, there lived"
LONG_STREAM_TOKENS = 600


class Serve:
    """`python -m deploy.cli serve ...` with its output read by a thread."""

    def __init__(self, state_file: Path, ray_temp_dir: str) -> None:
        self.state_file = state_file
        self.ray_temp_dir = ray_temp_dir
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONUNBUFFERED": "1", "PDSERVE_STATE_FILE": str(state_file)}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", "--model", "default", "--device", "cpu", "--prefill", "1",
             "--decode", "1", "--port", "0", "--kv-cache-blocks", str(NUM_BLOCKS), "--local-prefill-threshold", "0",
             "--omp-num-threads", "1", "--ray-temp-dir", ray_temp_dir, "--log-level", "info"],
            cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.log.append(line)
            self.lines.put(line)

    def wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            if line.startswith("pdserve ready: "):
                return line.split()[2].removesuffix("/v1")
        raise AssertionError("pdserve serve did not get ready:\n" + self.tail())

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=REPO, env=self.env,
                                capture_output=True, text=True, timeout=900)
        if check:
            assert result.returncode == 0, f"pdserve {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    def tail(self, lines: int = 60) -> str:
        return "".join(self.log[-lines:])


def descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every process below `pid` (walking /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = {}, [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            start = start_time(child)
            if start is not None:
                found[child] = start
                stack.append(child)
    return found


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry}: {cmdline[:200]}")
    return found


def wait_until(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="module")
def serve():
    with tempfile.TemporaryDirectory(prefix="pdsv-", dir="/tmp") as ray_temp_dir, \
            tempfile.TemporaryDirectory(prefix="pdserve-state-") as state_dir:
        server = Serve(Path(state_dir) / "serve.json", ray_temp_dir)
        try:
            server.url = server.wait_ready()
            yield server
        finally:
            if server.popen.poll() is None:
                server.popen.send_signal(signal.SIGINT)
                try:
                    server.popen.wait(120)
                except subprocess.TimeoutExpired:
                    server.popen.kill()
                    server.popen.wait()


@pytest.fixture(scope="module")
def offline():
    from engine import LLM
    return LLM("default", num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=900)


def offline_text(offline, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    [output] = offline.generate(prompt, params, use_tqdm=False)
    return offline.tokenizer.decode(output.token_ids)


def router_workers(serve) -> list[dict]:
    return httpx.get(serve.url + "/status", timeout=30).json()["workers"]


def ready_workers(status: dict, role: str) -> list[dict]:
    return [w for w in status["workers"] if w["role"] == role and w["state"] == "ready"]


class Stream:
    """A streaming completion read by a thread: `text`, `error`, `done` (an Event)."""

    def __init__(self, client, prompt: str, max_tokens: int) -> None:
        self.pieces: list[str] = []
        self.error: Exception | None = None
        self.first = threading.Event()
        self.done = threading.Event()
        self.finished_at: float | None = None
        threading.Thread(target=self._run, args=(client, prompt, max_tokens), daemon=True).start()

    def _run(self, client, prompt, max_tokens) -> None:
        try:
            for chunk in client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                self.pieces.append(chunk.choices[0].text if chunk.choices else "")
                self.first.set()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            self.first.set()
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def test_greedy_completions_match_the_offline_engine(serve, client, offline):
    expected = offline_text(offline, PLAIN, 24)
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt=PLAIN, max_tokens=24, temperature=0, stream=True))
    assert streamed == expected
    prefill = [w for w in router_workers(serve) if w["role"] == "prefill"]
    assert len(prefill) == 1 and prefill[0]["kv_bytes_sent"] > 0  # disaggregated: KV came from the prefill worker
    status = serve.status()
    assert [len(ready_workers(status, r)) for r in ("prefill", "decode")] == [1, 1]
    assert status["routers"] == 1 and status["settled"]


def test_decode_pool_scales_up_and_down_while_a_stream_runs(serve, client, offline):
    [first] = ready_workers(serve.status(), "decode")
    stream = Stream(client, STORY, LONG_STREAM_TOKENS)
    assert stream.first.wait(300) and stream.error is None

    serve.cli("scale", "--decode", "2")  # waits until the new worker is ready
    status = serve.status()
    decode = ready_workers(status, "decode")
    assert len(decode) == 2 and first["address"] in {w["address"] for w in decode}
    second = next(w for w in decode if w["address"] != first["address"])
    assert not stream.done.is_set(), "the stream ended before the pool grew; make LONG_STREAM_TOKENS larger"
    # The new worker joins the router's pool (membership comes from the controller only).
    wait_until(lambda: any(w["address"] == second["address"] and w["healthy"] for w in router_workers(serve)),
               60, "the router to route to the new decode worker")

    drain_issued = time.monotonic()
    assert not stream.done.is_set(), "the stream ended before the drain began; make LONG_STREAM_TOKENS larger"
    serve.cli("scale", "--decode", "1", "--drain", first["address"])  # waits for the drain
    scaled_down = time.monotonic()
    assert stream.done.is_set() and stream.finished_at <= scaled_down  # the drain waited for the stream
    assert stream.finished_at > drain_issued
    assert stream.error is None, f"the stream failed: {stream.error!r}"
    assert stream.text == offline_text(offline, STORY, LONG_STREAM_TOKENS, ignore_eos=True)

    status = serve.status()
    assert [w["address"] for w in ready_workers(status, "decode")] == [second["address"]]
    assert any(f"{first['worker_id']} at {first['address']} stopping: drained" in e["message"]
               for e in status["events"])
    wait_until(lambda: first["address"] not in {w["address"] for w in router_workers(serve)}, 60,
               "the router to drop the drained worker")
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=24, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 24)


def test_a_killed_worker_ends_its_stream_with_an_error_and_is_replaced(serve, client, offline):
    [victim] = ready_workers(serve.status(), "decode")
    stream = Stream(client, STORY, LONG_STREAM_TOKENS)
    assert stream.first.wait(300) and stream.error is None
    os.kill(victim["pid"], signal.SIGKILL)
    assert stream.done.wait(120), "the stream on the killed worker never ended"
    assert isinstance(stream.error, openai.APIError)

    def replaced():
        status = serve.status()
        decode = ready_workers(status, "decode")
        return status if status["settled"] and len(decode) == 1 and decode[0]["pid"] != victim["pid"] else None
    status = wait_until(replaced, 600, "a replacement decode worker")
    [replacement] = ready_workers(status, "decode")
    assert replacement["address"] != victim["address"] and replacement["worker_id"] != victim["worker_id"]
    assert any(f"{victim['worker_id']} at {victim['address']} died" in e["message"] for e in status["events"])
    table = serve.cli("status").stdout
    assert replacement["worker_id"] in table and victim["worker_id"] not in table.split("targets:")[0]
    wait_until(lambda: httpx.get(serve.url + "/health", timeout=30).status_code == 200, 120, "/health")
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=24, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 24)


def test_sigint_stops_every_process_of_the_cluster(serve):
    tree = descendants(serve.popen.pid)
    assert len(tree) >= 4  # Ray's daemons, the controller and the workers run below the serve process
    serve.popen.send_signal(signal.SIGINT)
    assert serve.popen.wait(180) == 0, serve.tail()
    assert serve.log[-1].strip() == "pdserve stopped"
    assert "Traceback" not in "".join(serve.log), serve.tail(200)
    wait_until(lambda: all(start_time(pid) != started for pid, started in tree.items()), 60,
               "every process of the cluster to exit", interval=0.5)
    assert processes_mentioning(serve.ray_temp_dir) == []
    assert not serve.state_file.exists()
