"""Real pdserve processes for end-to-end tests: a child process whose output is read by a
thread, a worker's gRPC address from its READY line, and a router on a free port, healthy."""
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.router.harness import free_socket, wait_until

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 600


class Process:
    """A child process whose stdout is read by a thread; `wait_for(prefix)` returns the first
    line starting with `prefix`."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.args = args
        self.popen = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.log.append(line)
            self.lines.put(line)

    def wait_for(self, prefix: str, timeout: float = STARTUP_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"{' '.join(self.args)} did not print {prefix!r}; output:\n{''.join(self.log[-40:])}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def grpc_address(process: Process) -> str:
    """Waits for the worker's `READY grpc=HOST:PORT ...` line."""
    ready = process.wait_for("READY ")
    return dict(part.split("=", 1) for part in ready.split()[1:])["grpc"]


def start_worker(module: str, *args: str) -> Process:
    """`python -m prefill_worker|decode_worker` on the default model and a free port."""
    return Process(["-m", module, "--model", "default", "--port", "0", *args])


def worker_stats(address: str, role: str):
    """A worker's own Stats (exact, not a router's last poll)."""
    import grpc

    import wire
    with grpc.insecure_channel(address) as channel:
        services = wire.services()
        stub = services.PrefillServiceStub(channel) if role == "prefill" else services.DecodeServiceStub(channel)
        return stub.Stats(wire.messages().StatsRequest(), timeout=30)


def start_router(*args: str) -> tuple[Process, str]:
    """`python -m router *args` on a free port; (the process, its URL) once /health answers 200."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    router = Process(["-m", "router", *args, "--port", str(port), "--stats-interval", "0.5", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if router.popen.poll() is not None:
            raise AssertionError("the router exited:\n" + "".join(router.log[-40:]))
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False
    try:
        wait_until(healthy, timeout=STARTUP_TIMEOUT_S, message="the router to report healthy")
    except BaseException:
        router.stop()
        raise
    return router, url
