"""Helpers shared by the test packages: polling for a state, a free port, and child Python
processes (started from the repository root with their output read by a thread, stopped with a
signal and then SIGKILL)."""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


def _poll(predicate: Callable, timeout: float, interval: float):
    """`predicate()`'s first truthy value, or its last falsy one once `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_until(predicate: Callable, timeout: float = 60.0, what: str = "condition", interval: float = 0.05):
    """Poll until `predicate()` is truthy and return that value; AssertionError naming `what` when
    it is still falsy after `timeout` seconds (a hang guard for a state, not a speed assertion)."""
    value = _poll(predicate, timeout, interval)
    if not value:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
    return value


def eventually(predicate: Callable, timeout: float = 60.0, interval: float = 0.05) -> bool:
    """Whether `predicate()` became truthy within `timeout` seconds, for `assert eventually(...), detail`
    where the failure message says more than `wait_until`'s would."""
    return bool(_poll(predicate, timeout, interval))


def free_port() -> int:
    """A 127.0.0.1 TCP port nothing listens on (now: another process may take it later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child process: one OpenMP thread, no tokenizer threads, unbuffered
    output, and `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
            **extra}


def start_python(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python *args` in the repository root (`child_env()` unless `env`), stdout and stderr
    together on one text pipe."""
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=child_env() if env is None else env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop_process(popen: subprocess.Popen, grace_s: float, sig: int | None = signal.SIGTERM,
                 kill_wait_s: float = 30.0) -> int:
    """Stop a child: `sig` (None: it was already sent), up to `grace_s` seconds for it to exit,
    then SIGKILL; its exit status (AssertionError if it outlives the SIGKILL by `kill_wait_s`)."""
    if popen.poll() is None:
        if sig is not None:
            popen.send_signal(sig)
        try:
            popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            kill_process(popen, kill_wait_s)
    return popen.returncode


def kill_process(popen: subprocess.Popen, wait_s: float = 30.0) -> int:
    """SIGKILL a child that is still running; its exit status once it exited."""
    if popen.poll() is None:
        popen.kill()
        try:
            popen.wait(wait_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pid {popen.pid} still runs {wait_s:g} s after SIGKILL") from None
    return popen.returncode


class PythonProcess:
    """`python *args` (`start_python`) whose output a thread reads into `log` and the `lines` queue."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.popen = start_python(args, env)
        self.log: list[str] = []
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.log.append(line)
            self.lines.put(line)

    def next_line(self, matches: Callable[[str], bool], timeout: float, poll_s: float = 0.5) -> str | None:
        """The next output line for which `matches` is true; None when the process exits first or
        `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=poll_s)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            if matches(line):
                return line
        return None

    def tail(self, lines: int = 40) -> str:
        return "".join(self.log[-lines:])
