"""`RouterSupervisor`: the serve process runs its routers as child processes and keeps them up.

The serve process binds the HTTP port once and hands the listening socket to every router
(deploy/router_process.py), so N routers share one port with no SO_REUSEPORT and no proxy: the
kernel gives each new connection to whichever router accepts first. While a router is down its
socket stays open in the supervisor, so connections wait in the backlog instead of being refused.

- `start()` launches the routers and returns once each accepts connections (RouterStartError if
  one exits first, or hangs past `start_timeout_s`: a startup mistake the user must see, not a
  crash loop);
- then a router that exits, for any reason, is restarted in the same slot: at once the first
  time, then with a backoff (0.5 s doubling to 30 s) while it keeps dying within a minute;
- `stop()` sends SIGTERM (in-flight requests get up to 5 s), then SIGKILL after `grace_s`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace

from deploy.router_process import SPEC_ENV, RouterSpec

logger = logging.getLogger("pdserve")

MAX_BACKOFF_S = 30.0
HEALTHY_RUN_S = 60.0  # a router that ran this long before it died restarts at once
ROUTER_START_TIMEOUT_S = 120.0  # a router not accepting connections by then is killed (and retried)


class RouterStartError(Exception):
    """A router exited before it accepted connections (its log says why)."""


@dataclass
class _Slot:
    index: int
    process: asyncio.subprocess.Process | None = None
    router_id: str | None = None
    ready_at: float | None = None  # when its router last accepted connections (None: not yet)
    quick_failures: int = 0


class RouterSupervisor:
    def __init__(self, spec: RouterSpec, count: int, sock: socket.socket, grace_s: float = 10.0,
                 command: tuple[str, ...] = (sys.executable, "-m", "deploy.router_process"),
                 start_timeout_s: float = ROUTER_START_TIMEOUT_S) -> None:
        if count < 1:
            raise ValueError(f"the number of routers must be >= 1, got {count}")
        self.spec = spec
        self.command = command
        self.sock = sock
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._slots = [_Slot(index) for index in range(count)]
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        return [slot.process.pid for slot in self._slots if slot.process is not None and slot.process.returncode is None]

    async def start(self) -> None:
        results = await asyncio.gather(*(self._launch(slot) for slot in self._slots), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        self._tasks = [asyncio.get_running_loop().create_task(self._watch(slot), name=f"pdserve-router-{slot.index}")
                       for slot in self._slots]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        running = [slot.process for slot in self._slots if slot.process is not None and slot.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), self.grace_s)
        except asyncio.TimeoutError:
            for process in running:
                if process.returncode is None:
                    logger.warning("router pid %d did not stop in %g s; killing it", process.pid, self.grace_s)
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            await asyncio.gather(*(p.wait() for p in running))

    async def _launch(self, slot: _Slot) -> None:
        """Start the slot's router; return when it accepts connections."""
        slot.ready_at = None
        read_fd, write_fd = os.pipe()
        spec = replace(self.spec, index=slot.index, listen_fd=self.sock.fileno(), ready_fd=write_fd,
                       parent_pid=os.getpid())
        try:
            slot.process = await asyncio.create_subprocess_exec(
                *self.command, env={**os.environ, SPEC_ENV: spec.to_json()},
                pass_fds=(self.sock.fileno(), write_fd))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(read_fd, "rb", buffering=0))
        try:
            line = await asyncio.wait_for(reader.readline(), self.start_timeout_s)  # b"": it exited first
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                slot.process.kill()
            await slot.process.wait()
            raise RouterStartError(f"router {slot.index} did not accept connections within "
                                   f"{self.start_timeout_s:g} s; killed it (its log is above)") from None
        finally:
            transport.close()
        if not line:
            status = await slot.process.wait()
            raise RouterStartError(f"router {slot.index} exited with {_describe(status)} before it accepted "
                                   "connections (its log is above)")
        slot.router_id = line.decode().strip()
        slot.ready_at = time.monotonic()

    async def _watch(self, slot: _Slot) -> None:
        while not self._stopping:
            status = await slot.process.wait()
            if self._stopping:
                return
            # how long it served: a router that never got ready (hung at start, killed) did not
            ran_s = time.monotonic() - slot.ready_at if slot.ready_at is not None else 0.0
            slot.quick_failures = 0 if ran_s >= HEALTHY_RUN_S else slot.quick_failures + 1
            delay = 0.0 if slot.quick_failures <= 1 else min(MAX_BACKOFF_S, 0.5 * 2 ** (slot.quick_failures - 2))
            logger.warning("router %d (pid %d) exited with %s after %.0f s serving; restarting it%s", slot.index,
                           slot.process.pid, _describe(status), ran_s, f" in {delay:g} s" if delay else "")
            died_at = time.monotonic()
            await asyncio.sleep(delay)
            try:
                await self._launch(slot)
            except RouterStartError as exc:
                logger.warning("%s", exc)
                continue
            except Exception:  # e.g. no fork (ENOMEM, EAGAIN): the slot stays down, retried with the backoff
                logger.exception("router %d could not be started", slot.index)
                continue
            self.restarts += 1
            logger.info("router %d is back (pid %d), %.1f s after it exited", slot.index, slot.process.pid,
                        time.monotonic() - died_at)


def _describe(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-status).name}"
    return f"status {status}"
