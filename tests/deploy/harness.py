"""Helpers for the `pdserve serve` tests: the serve process, the `pdserve` commands, and
finding every process of one cluster (to check that none is left after a stop)."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from engine.sampling_params import SamplingParams
from tests.helpers import PythonProcess, child_env, stop_process, wait_until

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 900


class Serve(PythonProcess):
    """`python -m deploy.cli serve ...` with its output read by a thread. `ray_temp_dir`: the
    local Ray instance's (None when `args` join a cluster with --ray-address); `env`: more
    environment for it and the `pdserve` commands."""

    def __init__(self, state_file: Path, ray_temp_dir: str | None, *args: str, env: dict | None = None) -> None:
        self.state_file = state_file
        self.ray_temp_dir = ray_temp_dir
        self.env = child_env(PDSERVE_STATE_FILE=str(state_file), **(env or {}))
        temp_dir = [] if ray_temp_dir is None else ["--ray-temp-dir", ray_temp_dir]
        super().__init__(["-m", "deploy.cli", "serve", "--port", "0", "--omp-num-threads", "1",
                          *temp_dir, "--log-level", "info", *args], env=self.env)
        self.url: str | None = None  # set by the caller from the ready line

    def wait_for(self, text: str, timeout: float = STARTUP_TIMEOUT_S) -> str:
        """The first output line containing `text`."""
        line = self.next_line(lambda line: text in line, timeout, poll_s=1.0)
        if line is None:
            raise AssertionError(f"pdserve serve did not print {text!r}:\n" + self.tail())
        return line

    def wait_ready(self) -> str:
        """The router URL from the ready line `pdserve ready: URL/v1 ...`."""
        return self.wait_for("pdserve ready: ").split()[2].removesuffix("/v1")

    def stop(self, sig: int = signal.SIGINT) -> None:
        stop_process(self.popen, 180, sig)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=REPO, env=self.env,
                                capture_output=True, text=True, timeout=900)
        if check:
            assert result.returncode == 0, f"pdserve {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result

    def status(self) -> dict:
        """The controller's status, through the router's /admin/status once the server is ready
        (`pdserve status --json` joins Ray first: seconds per call; tests that check the command
        itself call `cli`)."""
        if getattr(self, "url", None) is None:
            return json.loads(self.cli("status", "--json").stdout)
        import httpx
        return httpx.get(self.url + "/admin/status", timeout=120).raise_for_status().json()

    def tail(self, lines: int = 60) -> str:
        return super().tail(lines)


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


def running(pid: int) -> bool:
    """The process exists and has not exited (an exited child nobody reaped yet is a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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


def processes_inheriting(name: str, value: str) -> list[str]:
    """Processes whose environment has name=value (Ray's daemons and workers inherit the serve
    process's environment, so a unique value finds every process of one cluster)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if needle in environ:
                found.append(f"{entry}: {cmdline[:200].decode(errors='replace')}")
    return found


def stop_and_check_nothing_is_left(serve: Serve) -> None:
    """SIGINT `pdserve serve`: it exits 0 with no traceback, and no process of its cluster (Ray's
    daemons, the controller, workers, routers) and no state file is left."""
    tree = descendants(serve.popen.pid)
    assert len(tree) >= 4  # Ray's daemons, the controller, the workers and the routers run below it
    # The marker must reach the cluster's processes, or the final check below proves nothing
    # (compared with a count, not with `tree`: short-lived Ray helpers come and go between snapshots).
    assert len(processes_inheriting("PDSERVE_STATE_FILE", str(serve.state_file))) >= 4
    serve.popen.send_signal(signal.SIGINT)
    assert serve.popen.wait(180) == 0, serve.tail()
    assert serve.log[-1].strip() == "pdserve stopped"
    assert "Traceback" not in "".join(serve.log), serve.tail(200)
    wait_until(lambda: all(start_time(pid) != started for pid, started in tree.items()), 60,
               "every process of the cluster to exit", interval=0.5)
    assert processes_mentioning(serve.ray_temp_dir) == []
    assert processes_inheriting("PDSERVE_STATE_FILE", str(serve.state_file)) == []
    assert not serve.state_file.exists()


@contextlib.contextmanager
def one_torch_thread():
    """This process computes on one torch thread meanwhile, as each worker of a test cluster does
    (`--omp-num-threads 1`): the cluster's processes keep the other core busy, and two threads that
    wait on each other there make a decode step of the default model several times slower (0.9 s
    against 0.11 s, measured on a busy 2-vCPU machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def offline_text(offline, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    with one_torch_thread():
        [output] = offline.generate(prompt, params, use_tqdm=False)
    return offline.tokenizer.decode(output.token_ids)


def offline_texts(offline, prompts: list[str], max_tokens: int, ignore_eos: bool = False) -> list[str]:
    """`offline_text` of each prompt, the prompts generated together as one batch (as the cluster
    batches its streams): one decode step for all of them instead of one per prompt and token."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    with one_torch_thread():
        outputs = offline.generate(prompts, params, use_tqdm=False)
    return [offline.tokenizer.decode(output.token_ids) for output in outputs]


def assert_chats_match_offline(client, offline, chats: list, max_tokens: int) -> None:
    """Each chat, greedy through the served API, and the first one streamed, give the offline
    engine's text."""
    for messages in chats:
        out = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens,
                                             temperature=0)
        assert out.choices[0].message.content == offline_text(offline, messages, max_tokens)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="default", messages=chats[0], max_tokens=max_tokens, temperature=0, stream=True) if chunk.choices)
    assert streamed == offline_text(offline, chats[0], max_tokens)


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


@contextlib.contextmanager
def running_cluster(num_blocks: int, *args: str):
    """`pdserve serve` on the default model, CPU, `num_blocks` KV blocks, remote prefill for every
    prompt, and `args` (the pools); yields the Serve with its `url`, stops it after."""
    with tempfile.TemporaryDirectory(prefix="pdsv-", dir="/tmp") as ray_temp_dir, \
            tempfile.TemporaryDirectory(prefix="pdserve-state-") as state_dir:
        server = Serve(Path(state_dir) / "serve.json", ray_temp_dir, "--model", "default", "--device", "cpu",
                       "--kv-cache-blocks", str(num_blocks), "--local-prefill-threshold", "0", *args)
        try:
            server.url = server.wait_ready()
            yield server
        finally:
            server.stop()


def cluster_fixtures(num_blocks: int, *pools: str):
    """The module-scoped fixtures of an end-to-end module: `serve` (a `running_cluster` with
    `pools`), `offline` (the offline engine, the reference output) and `client` (openai)."""
    import pytest

    @pytest.fixture(scope="module")
    def serve():
        with running_cluster(num_blocks, *pools) as server:
            yield server

    @pytest.fixture(scope="module")
    def offline():
        from engine import LLM
        return LLM("default", num_blocks=num_blocks)

    @pytest.fixture(scope="module")
    def client(serve):
        import openai
        return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=900)

    return serve, offline, client
