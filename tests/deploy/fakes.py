"""Fake workers for the controller's tests: a launcher whose handles the test drives by hand
(start succeeds / fails / blocks, the worker dies, Stats answers or not)."""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from wire.stats import WorkerStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeHandle:
    role: str
    worker_id: str
    port: int
    node_id: str = "ab" * 28  # the Ray node start() reports
    node_ip: str = "127.0.0.1"
    fail_start: str | None = None  # start() raises ValueError(fail_start)
    hold_start: bool = False  # start() waits until release_start()
    reply: dict[str, Any] = field(default_factory=lambda: {"running": 0, "waiting": 0, "kv_blocks_total": 100,
                                                           "kv_blocks_free": 100})  # what Stats answers (WorkerStats fields)
    unresponsive: bool = False
    stats_hang: bool = False  # Stats does not answer; stop() cancels the open calls (see stop())
    stopped_with_grace: float | None = None
    hand_overs: int = 0  # hand_over() calls
    open_calls: set[asyncio.Future] = field(default_factory=set)
    _released: asyncio.Event = field(default_factory=asyncio.Event)
    _died: asyncio.Future | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> dict[str, Any]:
        if self.hold_start:
            await self._released.wait()
        if self.fail_start is not None:
            raise ValueError(self.fail_start)
        self._died = asyncio.get_running_loop().create_future()
        return {"role": self.role, "grpc_address": self.address, "transport_address": f"tcp://127.0.0.1:{self.port + 1}",
                "pid": self.port, "node_id": self.node_id, "node_ip": self.node_ip}

    def release_start(self) -> None:
        self._released.set()

    async def wait_dead(self) -> str:
        return await asyncio.shield(self._died)  # a watcher cancelled (its controller died) kills nothing

    def die(self, reason: str = "killed") -> None:
        self._died.set_result(reason)

    async def stats(self, timeout_s: float) -> WorkerStats:
        if self.unresponsive:
            raise ConnectionError("connection refused")
        if self.stats_hang:
            call = asyncio.get_running_loop().create_future()
            self.open_calls.add(call)
            try:
                await call
            finally:
                self.open_calls.discard(call)
        return WorkerStats(**self.reply)

    async def hand_over(self) -> int:
        """Its streams end (their requests are aborted): nothing runs any more."""
        self.hand_overs += 1
        streams, self.reply = self.reply["running"], {**self.reply, "running": 0}
        return streams

    async def stop(self, grace_s: float) -> None:
        """Like `RayWorkerHandle.stop`, which closes its gRPC channel: the calls still open on it
        are cancelled, and their callers get asyncio.CancelledError (their own task is not
        being cancelled)."""
        self.stopped_with_grace = grace_s
        for call in list(self.open_calls):
            call.cancel()
        if self._died is not None and not self._died.done():
            self._died.set_result("stopped")

    @property
    def stopped(self) -> bool:
        return self.stopped_with_grace is not None

    @property
    def alive(self) -> bool:
        return not self.stopped and not (self._died is not None and self._died.done())


class MemoryStore:
    """The controller's StateStore in memory (what the GCS key-value store holds in production)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        self.saves = 0

    def load(self) -> dict[str, Any] | None:
        return None if self.state is None else json.loads(json.dumps(self.state))

    def save(self, state: dict[str, Any]) -> None:
        self.state = json.loads(json.dumps(state))  # what survives is what serializes
        self.saves += 1

    def clear(self) -> None:
        self.state = None


class FakeLauncher:
    """`plan[role]` lists keyword overrides for the next handles of that role (then defaults)."""

    def __init__(self) -> None:
        self.handles: list[FakeHandle] = []
        self.plan: dict[str, list[dict[str, Any]]] = {}
        self.capacity: int | None = None  # workers the fake cluster can place (None: any number)
        self._ports = itertools.count(41000, 10)

    def launch(self, role: str, worker_id: str) -> FakeHandle:
        overrides = self.plan.get(role, [])
        handle = FakeHandle(role, worker_id, next(self._ports), **(overrides.pop(0) if overrides else {}))
        self.handles.append(handle)
        return handle

    def find(self, role: str, worker_id: str, info: dict[str, Any] | None) -> FakeHandle | None:
        """A worker is found while it lives (started, not dead, not stopped) or is still starting."""
        for handle in self.handles:
            if handle.worker_id == worker_id and handle.alive:
                return handle
        return None

    def live_worker_ids(self) -> list[str]:
        return [h.worker_id for h in self.handles if h.alive]

    def capacity_shortfall(self, targets) -> str | None:
        wanted = sum(targets.counts().values())
        if self.capacity is not None and wanted > self.capacity:
            return f"{wanted} workers, room for {self.capacity}"
        return None

    def of(self, role: str) -> list[FakeHandle]:
        return [h for h in self.handles if h.role == role]

    def by_address(self, address: str) -> FakeHandle:
        return next(h for h in self.handles if h.address == address)


async def settle(rounds: int = 5) -> None:
    """Let spawned tasks run (start, watch, stop) without advancing the fake clock."""
    for _ in range(rounds):
        await asyncio.sleep(0)
