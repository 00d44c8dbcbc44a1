"""The controller: owns pool membership, keeps each pool at its target size, drains and replaces.

One worker's lifecycle in the controller (one state per line):

    STARTING   actor launched; engine loading; gRPC server not yet reported (not routable)
    READY      addresses reported; in the membership the routers sync from; Stats polled
    DRAINING   in the membership with `draining=True`: routers send it nothing new; a decode
               or colocated worker still streaming after `drain_grace_s` hands its streams
               over (the routers resume them elsewhere); it leaves once every live router
               reports none of its requests in flight and a later Stats poll says nothing runs
               or waits on it (or after `drain_timeout_s`, or after `replace_after_failures`
               failed polls: a drain never waits on a worker that cannot answer)
    STOPPING   out of the membership; its gRPC server stops (grace), then the actor is killed
    (gone)     stopped, dead (its actor died: noticed at once, replaced), failed to start (retried
               with backoff), or unresponsive for `replace_after_failures` polls (killed; replaced
               unless it was draining). A poll without an answer is a failed poll, also one whose
               call was cancelled under it.

`PoolController` is plain asyncio over a `Launcher` (Ray actors in production, fakes in tests);
`ControllerActor` is the Ray actor around it, found by name (`pdserve-controller` in namespace
`pdserve` by default). Routers learn workers only through `router_sync()` (see
deploy/router_sync.py), which also carries each router's in-flight counts back for draining.

Surviving its own death: the workers are not the controller's (detached actors, found by name),
and every change of targets or membership is written to a `StateStore` (the GCS key-value store
in production, deploy/durable.py). Ray restarts a dead `ControllerActor`; before it answers
anything, it `recover()`s: targets and membership from the store, each worker it lists adopted
if its actor still lives (STARTING ones are stopped: nobody awaits their start any more), any
other live worker of this controller stopped (an orphan), then health checks, replacement and
scaling resume. Routers keep their last membership meanwhile.

With `config.planner`, each tick also feeds the ready prefill and decode workers' Stats to the
goodput planner (deploy/planner.py); once the pools are settled, its decisions go through
`scale()` (or, in a dry run, only into the events), and `status()` lists its recent decisions.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from deploy.config import KV_ROLES, ROLES, ControllerConfig, PoolTargets, pool_name
from deploy.durable import GcsStateStore, StateStore
from deploy.planner import Planner
from engine.process import configure_logging
from wire.stats import WorkerStats

logger = logging.getLogger(__name__)

STARTING, READY, DRAINING, STOPPING = "starting", "ready", "draining", "stopping"


class WorkerHandle(Protocol):
    """One launched worker, as the controller drives it."""

    async def start(self) -> dict[str, Any]:
        """Build the engine and serve; return {"grpc_address", "transport_address", "pid", "node_id",
        "node_ip", "kv_settings"} (node: the Ray node the worker runs on; kv_settings: the KV
        transport and connector settings in effect, `serving.Worker.kv_settings`)."""

    async def wait_dead(self) -> str:
        """Return (with a reason) when the worker has died; never returns while it lives."""

    async def stats(self, timeout_s: float) -> WorkerStats:
        """The worker's Stats; raises when it does not answer."""

    async def hand_over(self) -> int:
        """Draining: end the worker's streams so their callers resume them elsewhere; how many."""

    async def stop(self, grace_s: float) -> None:
        """Stop serving (open calls get `grace_s`), then end the worker for good. Idempotent."""


class Launcher(Protocol):
    def launch(self, role: str, worker_id: str) -> WorkerHandle: ...

    def find(self, role: str, worker_id: str, info: dict[str, Any] | None) -> WorkerHandle | None:
        """The live worker `worker_id` an earlier incarnation of this controller launched (None if
        it is gone), bound to the `info` its start reported (None: only to stop it)."""

    def live_worker_ids(self) -> list[str]:
        """Ids of every live worker launched under this controller's name."""

    def capacity_shortfall(self, targets: PoolTargets) -> str | None:
        """Why pools of these sizes cannot all be placed (workers that do not fit would wait for
        resources, on a fixed cluster forever), or None."""


_SAVED_FIELDS = ("worker_id", "role", "state", "grpc_address", "transport_address", "pid", "node_id", "node_ip",
                 "kv_settings")


@dataclass
class Member:
    worker_id: str
    role: str
    handle: WorkerHandle
    state: str = STARTING
    grpc_address: str = ""
    transport_address: str = ""
    pid: int | None = None
    node_id: str = ""  # the Ray node the worker runs on (hex id) and its IP
    node_ip: str = ""
    kv_settings: dict[str, Any] = field(default_factory=dict)  # what its start reported
    healthy: bool = False
    stats: WorkerStats | None = None  # the last Stats answer (None before one)
    stats_time: float | None = None  # when the last successful poll was sent
    consecutive_failures: int = 0
    last_error: str | None = None
    launched_at: float = 0.0
    ready_at: float | None = None
    drain_started: float | None = None
    handed_over: bool = False  # its streams were handed over (drain_grace_s)
    routers_clear_at: float | None = None  # first time every live router reported nothing in flight
    start_task: asyncio.Task | None = None

    @property
    def load(self) -> int:
        return self.stats.running + self.stats.waiting if self.stats is not None else 0


@dataclass
class _RouterReport:
    time: float
    workers: dict[str, dict[str, Any]]  # address -> {"inflight": int, "draining": bool}


@dataclass
class PoolController:
    config: ControllerConfig
    launcher: Launcher
    clock: Any = time.monotonic
    store: StateStore | None = None
    targets: PoolTargets = field(init=False)
    _members: dict[str, Member] = field(default_factory=dict, init=False)
    _routers: dict[str, _RouterReport] = field(default_factory=dict, init=False)
    _events: collections.deque = field(init=False)
    _backoff: dict[str, tuple[int, float]] = field(default_factory=dict, init=False)
    _prefer_drain: set[str] = field(default_factory=set, init=False)
    _start_failures: list[str] | None = field(default=None, init=False)  # while start(wait=True) waits
    _saved: dict[str, Any] | None = field(default=None, init=False)  # what the store holds
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False)  # set (and replaced) on a change
    _tasks: set[asyncio.Task] = field(default_factory=set, init=False)
    _loop_task: asyncio.Task | None = field(default=None, init=False)
    _next_id: int = field(default=1, init=False)
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.targets = self.config.targets
        self._events = collections.deque(maxlen=self.config.max_events)
        self.planner = Planner(self.config.planner) if self.config.planner is not None else None

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self, wait: bool = True) -> None:
        """Launch the initial pools and the health loop; with `wait`, return once every pool is at
        its target, or raise RuntimeError naming the first worker that failed to start."""
        if self._loop_task is not None:
            raise RuntimeError("the controller is already started")
        self._start_failures = [] if wait else None
        self._reconcile()
        self._loop_task = asyncio.get_running_loop().create_task(self._health_loop(), name="pdserve-controller")
        if not wait:
            return
        try:
            if not await self._wait_for(self._start_done, self.config.start_timeout_s):
                raise RuntimeError(f"the pools did not reach {self.targets} within {self.config.start_timeout_s} s")
        finally:
            failures, self._start_failures = self._start_failures, None
        if self._closed:
            raise RuntimeError("the controller was shut down while the pools were starting")
        if failures:
            raise RuntimeError(failures[0])

    def _start_done(self) -> bool:
        return self._closed or bool(self._start_failures) or self.settled()

    async def _wait_for(self, condition, timeout_s: float) -> bool:
        """Wait until `condition()` holds (checked at every change), at most `timeout_s`."""
        deadline = self.clock() + timeout_s
        while True:
            changed = self._changed
            if condition():
                return True
            remaining = deadline - self.clock()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def _notify(self) -> None:
        """Wake whoever waits for a change (of targets, membership or a worker's state)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def shutdown(self) -> None:
        """Stop every worker (grace), then forget them. The controller cannot be restarted."""
        self._closed = True
        self._notify()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        members = list(self._members.values())
        for member in members:
            if member.state != STOPPING:
                self._stop(member, "shutting down")
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self.store is not None:
            self.store.clear()

    async def recover(self) -> bool:
        """After a restart of the controller: reload and adopt (see the module docstring), then
        run as before. False (nothing done) when the store holds nothing."""
        state = self.store.load() if self.store is not None else None
        if state is None:
            return False
        if self._loop_task is not None:
            raise RuntimeError("the controller is already running")
        self.targets = PoolTargets.from_counts(state["targets"])
        self._next_id = int(state["next_id"])
        now = self.clock()
        for saved in state["members"]:
            info = {name: saved[name] for name in _SAVED_FIELDS}
            handle = self.launcher.find(saved["role"], saved["worker_id"], info)
            if handle is None:
                self._event(f"{saved['worker_id']} at {saved['grpc_address']} is gone", logging.WARNING)
            elif saved["state"] not in (READY, DRAINING):
                self._spawn(self._quiet_stop(handle, 0.0))
                self._event(f"{saved['worker_id']} was {saved['state']}: stopped")
            else:
                member = Member(saved["worker_id"], saved["role"], handle, state=saved["state"],
                                grpc_address=saved["grpc_address"], transport_address=saved["transport_address"],
                                pid=saved["pid"], node_id=saved.get("node_id", ""), node_ip=saved.get("node_ip", ""),
                                kv_settings=saved["kv_settings"], healthy=True, launched_at=now, ready_at=now,
                                drain_started=now if saved["state"] == DRAINING else None)
                self._members[member.worker_id] = member
                self._spawn(self._watch(member))
        for worker_id in self.launcher.live_worker_ids():
            if worker_id not in self._members:
                handle = self.launcher.find("", worker_id, None)
                if handle is not None:
                    self._spawn(self._quiet_stop(handle, 0.0))
                    self._event(f"{worker_id} is not in the membership (an orphan): stopped")
        self._event(f"controller restarted: {len(self._members)} worker(s) adopted, targets {self.targets.counts()}",
                    logging.WARNING)
        self._loop_task = asyncio.get_running_loop().create_task(self._health_loop(), name="pdserve-controller")
        self._reconcile()
        return True

    def _save(self) -> None:
        """Write targets and membership to the store when they changed (checked every reconcile:
        each health tick; the write is a blocking GCS call)."""
        if self.store is None or self._closed:
            return
        members = [{name: getattr(m, name) for name in _SAVED_FIELDS} for m in self._members.values()
                   if m.state != STOPPING]
        state = {"targets": self.targets.counts(), "next_id": self._next_id, "members": members}
        if state != self._saved:
            self.store.save(state)
            self._saved = state

    # ---- the public interface ------------------------------------------------------------------

    def scale(self, prefill: int | None = None, decode: int | None = None, colocated: int | None = None,
              drain: list[str] | tuple[str, ...] = ()) -> dict[str, int]:
        """Set new pool targets (None keeps a pool's size); `drain` names workers (gRPC
        addresses) to remove first when a pool shrinks. Returns the targets. The work happens
        in the background: follow it with `settled()` / `wait_settled()`."""
        if self._closed:
            raise ValueError("the controller is shutting down")
        targets = self.targets.replace(prefill, decode, colocated)
        known = {m.grpc_address for m in self._members.values() if m.grpc_address}
        unknown = [address for address in drain if address not in known]
        if unknown:
            raise ValueError(f"no worker at {', '.join(unknown)}; workers: {', '.join(sorted(known)) or 'none'}")
        if targets != self.targets and self.planner is not None:
            self.planner.targets_changed(self.clock())  # not undone from numbers measured before it
        self.targets = targets
        self._prefer_drain = set(drain)
        self._backoff.clear()
        self._event(f"scale to {targets.prefill} prefill, {targets.decode} decode, {targets.colocated} colocated")
        self._reconcile()
        return targets.counts()

    def settled(self) -> bool:
        """Every pool has exactly its target of READY workers and nothing is starting, draining or stopping."""
        for role, target in self.targets.counts().items():
            members = [m for m in self._members.values() if m.role == role]
            if len(members) != target or any(m.state != READY for m in members):
                return False
        return True

    async def wait_settled(self, timeout_s: float) -> bool:
        return await self._wait_for(self.settled, timeout_s)

    def membership(self) -> list[dict[str, Any]]:
        """The routable workers: READY ones, and DRAINING ones flagged `draining`."""
        return [{"worker_id": m.worker_id, "role": m.role, "address": m.grpc_address,
                 "transport_address": m.transport_address, "draining": m.state == DRAINING}
                for m in self._sorted_members() if m.state in (READY, DRAINING)]

    def router_sync(self, router_id: str, workers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """A router reports what it holds (address -> {"inflight", "draining"}) and gets the membership."""
        self._routers = self._live_routers()  # a router gone quiet (stopped, restarted under a new id) is forgotten
        self._routers[router_id] = _RouterReport(self.clock(), dict(workers))
        return self.membership()

    def status(self) -> dict[str, Any]:
        now = self.clock()
        routers = self._live_routers()
        workers = []
        for m in self._sorted_members():
            stats = m.stats or WorkerStats()  # zeros before the first answer
            total, free = stats.kv_blocks_total, stats.kv_blocks_free
            workers.append({
                "worker_id": m.worker_id, "role": m.role, "state": m.state, "address": m.grpc_address,
                "tensor_parallel_size": self.config.worker.tp(m.role),
                "transport_address": m.transport_address, "pid": m.pid, "node_id": m.node_id,
                "node_ip": m.node_ip, "kv_settings": m.kv_settings, "healthy": m.healthy, "running": stats.running,
                "waiting": stats.waiting, "kv_blocks_total": total, "kv_blocks_free": free,
                "kv_bytes_sent": stats.kv_bytes_sent, "kv_bytes_received": stats.kv_bytes_received,
                "rss_bytes": stats.rss_bytes, "weight_bytes": stats.weight_bytes,
                "kv_usage": (total - free) / total if total else None,
                "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
                "router_inflight": sum(int(r.workers.get(m.grpc_address, {}).get("inflight", 0))
                                       for r in routers.values()),
                "last_error": m.last_error, "age_s": round(now - m.launched_at, 1)})
        live_routers = [{"router_id": router_id, "last_sync_s": round(now - r.time, 1),
                         "inflight": sum(int(held.get("inflight", 0)) for held in r.workers.values())}
                        for router_id, r in sorted(self._live_routers().items())]
        planner = self.planner.status() if self.planner is not None else None
        return {"targets": self.targets.counts(), "settled": self.settled(), "workers": workers,
                "routers": len(routers), "live_routers": live_routers, "events": list(self._events),
                "planner": planner}

    # ---- reconciling membership with the targets -----------------------------------------------

    def _reconcile(self) -> None:
        if self._closed:
            return
        self._adjust_pools()
        self._save()
        self._notify()

    def _adjust_pools(self) -> None:
        for role, target in self.targets.counts().items():
            members = [m for m in self._members.values() if m.role == role]
            live = [m for m in members if m.state in (STARTING, READY)]
            if len(live) < target:
                # Taking back a draining worker is cheaper than starting one (its cache is warm).
                for member in sorted((m for m in members if m.state == DRAINING), key=lambda m: m.launched_at):
                    if len(live) == target:
                        break
                    member.state, member.drain_started, member.routers_clear_at = READY, None, None
                    member.handed_over = False
                    live.append(member)
                    self._event(f"{member.worker_id} at {member.grpc_address} kept: the pool grew again")
                missing = target - len(live)
                failures, not_before = self._backoff.get(role, (0, 0.0))
                if missing > 0 and self.clock() >= not_before:
                    for _ in range(missing):
                        self._launch(role)
            elif len(live) > target:
                for member in self._pick_victims(live, len(live) - target):
                    if member.state == STARTING:
                        self._stop(member, "not needed any more (scaled down before it was ready)")
                    else:
                        member.state, member.drain_started = DRAINING, self.clock()
                        self._event(f"{member.worker_id} at {member.grpc_address} draining")

    def _pick_victims(self, live: list[Member], count: int) -> list[Member]:
        def order(m: Member):
            preferred = m.grpc_address in self._prefer_drain
            return (m.state != STARTING, not preferred, m.healthy, m.load, -(m.ready_at or m.launched_at))
        return sorted(live, key=order)[:count]

    def _launch(self, role: str) -> None:
        worker_id = f"{pool_name(role)}-{self._next_id}"
        self._next_id += 1
        member = Member(worker_id, role, self.launcher.launch(role, worker_id), launched_at=self.clock())
        self._members[worker_id] = member
        self._event(f"{worker_id} starting")
        member.start_task = self._spawn(self._start_member(member))

    async def _start_member(self, member: Member) -> None:
        try:
            info = await asyncio.wait_for(member.handle.start(), self.config.start_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed start: forget it, back off, retry from the health loop
            reason = _describe(exc)
            if self._members.get(member.worker_id) is member:
                del self._members[member.worker_id]
                failures = self._backoff.get(member.role, (0, 0.0))[0] + 1
                delay = min(self.config.max_start_backoff_s, 2.0 ** (failures - 1))
                self._backoff[member.role] = (failures, self.clock() + delay)
                message = f"{member.worker_id} failed to start: {reason}"
                if self._start_failures is not None:
                    self._start_failures.append(message)
                self._event(f"{message} (next try in {delay:.0f} s)", logging.WARNING)
                self._notify()
            self._spawn(self._quiet_stop(member.handle, 0.0))
            return
        if self._members.get(member.worker_id) is not member or member.state != STARTING:
            return
        member.grpc_address = info["grpc_address"]
        member.transport_address = info.get("transport_address", "")
        member.pid, member.node_id, member.node_ip = info.get("pid"), info.get("node_id", ""), info.get("node_ip", "")
        member.kv_settings = info.get("kv_settings", {})
        member.state, member.healthy, member.ready_at = READY, True, self.clock()
        self._backoff.pop(member.role, None)
        self._event(f"{member.worker_id} ready at {member.grpc_address} (pid {member.pid})")
        self._spawn(self._watch(member))
        self._reconcile()

    async def _watch(self, member: Member) -> None:
        reason = await member.handle.wait_dead()
        if self._members.get(member.worker_id) is not member or member.state == STOPPING:
            return
        del self._members[member.worker_id]
        self._event(f"{member.worker_id} at {member.grpc_address} died ({reason}); "
                    f"removed from routing", logging.WARNING)
        self._spawn(self._quiet_stop(member.handle, 0.0))
        self._reconcile()

    def _stop(self, member: Member, reason: str) -> None:
        member.state = STOPPING
        self._event(f"{member.worker_id}{' at ' + member.grpc_address if member.grpc_address else ''} "
                    f"stopping: {reason}")
        if member.start_task is not None and not member.start_task.done():
            member.start_task.cancel()

        async def stop() -> None:
            await self._quiet_stop(member.handle, self.config.stop_grace_s)
            if self._members.get(member.worker_id) is member:
                del self._members[member.worker_id]
            self._reconcile()
        self._spawn(stop())

    async def _quiet_stop(self, handle: WorkerHandle, grace_s: float) -> None:
        try:
            await asyncio.wait_for(handle.stop(grace_s), grace_s + 30.0)
        except Exception as exc:  # it may be dead already; stop() kills what is left
            logger.info("stopping a worker: %s", _describe(exc))

    # ---- health and draining -------------------------------------------------------------------

    async def _health_loop(self) -> None:
        """`tick()` every `health_interval_s` until `shutdown()` cancels it. Nothing a tick raises
        ends it, a CancelledError from a cancelled gRPC call included: it alone polls workers
        and finishes drains, so a loop that ended would leave every drain to `drain_timeout_s`."""
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                if self._closed:  # shutdown() cancels this loop, and nothing else does
                    raise
                logger.exception("controller tick failed")
            except Exception:  # a bug in one tick must not end health checking
                logger.exception("controller tick failed")
            await asyncio.sleep(self.config.health_interval_s)

    async def tick(self) -> None:
        """One round: poll READY/DRAINING workers, finish drains, reconcile (the health loop's body)."""
        polled = [m for m in self._members.values() if m.state in (READY, DRAINING)]
        await asyncio.gather(*(self._poll(m) for m in polled))
        self._check_drains()
        self._plan()
        self._reconcile()  # and saves

    def _plan(self) -> None:
        """Feed the planner the ready workers' Stats; apply its decision once the pools are settled,
        cut to what the cluster can place."""
        if self.planner is None or self._closed or not (self.targets.prefill or self.targets.decode):
            return  # colocated workers only: nothing for the planner to size
        now = self.clock()
        self.planner.observe(now, [(m.grpc_address, m.role, m.stats) for m in self._members.values()
                                   if m.state == READY and m.stats is not None and m.role in KV_ROLES])
        if not self.settled():  # a change under way: its workers' numbers are not in yet
            self.planner.restart_interval(now)
            return
        decision = self.planner.decide(now, self.targets.prefill, self.targets.decode)
        if decision is None or decision.target is None:
            return
        prefill, decode = self._placeable(*decision.target)
        if (prefill, decode) == (self.targets.prefill, self.targets.decode):
            self._event(f"planner wants {decision.target[0]} prefill, {decision.target[1]} decode; the cluster "
                        f"has no room: {self.launcher.capacity_shortfall(self.targets.replace(*decision.target))}",
                        logging.WARNING)
            return
        if self.config.planner.dry_run:
            self._event(f"planner (dry run) would scale to {prefill} prefill, {decode} decode: {decision.reason}")
            return
        self._event(f"planner: {decision.reason}")
        self.scale(prefill=prefill, decode=decode)

    def _placeable(self, prefill: int, decode: int) -> tuple[int, int]:
        """The planner's target with the pools it grows cut back, one worker at a time (the one
        that grew most first), until the cluster can place them all or they are back at their size."""
        current = (self.targets.prefill, self.targets.decode)
        while self.launcher.capacity_shortfall(self.targets.replace(prefill, decode)) is not None:
            grown = (prefill - current[0], decode - current[1])
            if max(grown) <= 0:
                break
            if grown[0] >= grown[1]:
                prefill -= 1
            else:
                decode -= 1
        return prefill, decode

    async def _poll(self, member: Member) -> None:
        """One Stats poll. Anything but an answer is a failed poll, a call cancelled under it
        included (stopping a worker's handle closes its gRPC channel, and gRPC cancels the calls
        still open on it); only shutdown's cancellation propagates."""
        sent = self.clock()
        try:
            stats = await asyncio.wait_for(member.handle.stats(self.config.rpc_timeout_s),
                                           self.config.rpc_timeout_s + 1.0)
        except asyncio.CancelledError:
            if self._closed:  # shutdown() cancelled the loop that runs this poll
                raise
            self._poll_failed(member, "the Stats call was cancelled")
            return
        except Exception as exc:
            self._poll_failed(member, _describe(exc))
            return
        if not member.healthy and member.consecutive_failures:
            self._event(f"{member.worker_id} at {member.grpc_address} healthy again")
        member.stats, member.stats_time = stats, sent
        member.healthy, member.consecutive_failures, member.last_error = True, 0, None

    def _poll_failed(self, member: Member, error: str) -> None:
        """Unhealthy after `unhealthy_after_failures` failed polls in a row; stopped after
        `replace_after_failures` (replaced if READY; a DRAINING one, even one that never
        answered a poll, leaves as if drained, so no drain waits on a worker that cannot answer)."""
        member.consecutive_failures += 1
        member.last_error = error
        if member.healthy and member.consecutive_failures >= self.config.unhealthy_after_failures:
            member.healthy = False
            self._event(f"{member.worker_id} at {member.grpc_address} unhealthy: {error}", logging.WARNING)
        if (member.consecutive_failures >= self.config.replace_after_failures
                and self._members.get(member.worker_id) is member and member.state != STOPPING):
            outcome = "replacing it" if member.state == READY else "its drain ends here"
            self._stop(member, f"unresponsive for {member.consecutive_failures} polls; {outcome}")

    def _check_drains(self) -> None:
        now = self.clock()
        routers = self._live_routers()
        for member in [m for m in self._members.values() if m.state == DRAINING]:
            if now - member.drain_started > self.config.drain_timeout_s:
                self._stop(member, f"drain timed out after {self.config.drain_timeout_s:.0f} s "
                                   f"({member.load} request(s) still on it)")
                continue
            grace = self.config.drain_grace_s
            if (grace is not None and not member.handed_over and member.role != "prefill"
                    and now - member.drain_started >= grace):
                member.handed_over = True
                self._spawn(self._hand_over(member))
            if not all(self._router_released(router, member.grpc_address) for router in routers.values()):
                member.routers_clear_at = None
                continue
            if member.routers_clear_at is None:
                member.routers_clear_at = now
            fresh = member.stats_time is not None and member.stats_time > member.routers_clear_at
            if fresh and member.load == 0:
                self._stop(member, "drained")

    async def _hand_over(self, member: Member) -> None:
        try:
            streams = await asyncio.wait_for(member.handle.hand_over(), self.config.rpc_timeout_s)
        except Exception as exc:  # it may be dying; the drain ends at its timeout or failed polls
            self._event(f"{member.worker_id} at {member.grpc_address}: handing its streams over failed: "
                        f"{_describe(exc)}", logging.WARNING)
            return
        if streams:
            self._event(f"{member.worker_id} at {member.grpc_address} handed {streams} stream(s) over "
                        f"after a {self.config.drain_grace_s:g} s drain grace")

    @staticmethod
    def _router_released(router: _RouterReport, address: str) -> bool:
        held = router.workers.get(address)
        return held is None or (bool(held.get("draining")) and int(held.get("inflight", 0)) == 0)

    def _live_routers(self) -> dict[str, _RouterReport]:
        """router id -> its last report, for routers that synced within `router_stale_after_s`."""
        horizon = self.clock() - self.config.router_stale_after_s
        return {router_id: r for router_id, r in self._routers.items() if r.time >= horizon}

    # ---- helpers -------------------------------------------------------------------------------

    def _sorted_members(self) -> list[Member]:
        rank = {role: i for i, role in enumerate(ROLES)}
        return sorted(self._members.values(), key=lambda m: (rank[m.role], m.launched_at, m.worker_id))

    def _event(self, message: str, level: int = logging.INFO) -> None:
        logger.log(level, "%s", message)
        self._events.append({"time": time.time(), "message": message})

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".rstrip(": ")


class ControllerActor:
    """The Ray actor around `PoolController` (async: one event loop runs the health loop and
    every call). Errors a caller can fix come back as {"error": message}, not as exceptions."""

    def __init__(self, config: ControllerConfig) -> None:
        configure_logging(logging.INFO)
        from deploy.actors import RayWorkerLauncher
        self.config = config
        self.controller = PoolController(config, RayWorkerLauncher(config.worker, config.name, config.namespace),
                                         store=GcsStateStore(config.name, config.namespace))
        # `pdserve serve` clears the record before it creates the controller, so a record here
        # means Ray restarted this actor after its process died: recover before the first answer.
        self._restarted = self.controller.store.load() is not None
        self._recovery: asyncio.Future | None = None

    async def _resume(self) -> None:
        if self._restarted and self._recovery is None:
            self._recovery = asyncio.ensure_future(self.controller.recover())
        if self._recovery is not None:
            recovery = self._recovery
            try:
                await asyncio.shield(recovery)
            except Exception:
                if self._recovery is recovery and recovery.done():
                    self._recovery = None  # e.g. the GCS not answering yet: the next call tries again
                raise

    async def start(self) -> dict[str, Any]:
        await self._resume()
        if self._restarted:
            return self.controller.status()
        try:
            await self.controller.start(wait=True)
        except RuntimeError as exc:
            return {"error": str(exc)}
        return self.controller.status()

    async def scale(self, prefill: int | None = None, decode: int | None = None, colocated: int | None = None,
                    drain: list[str] | None = None) -> dict[str, Any]:
        await self._resume()
        try:
            targets = self.controller.scale(prefill, decode, colocated, drain or ())
        except ValueError as exc:
            return {"error": str(exc)}
        result: dict[str, Any] = {"targets": targets}
        shortfall = self.controller.launcher.capacity_shortfall(self.controller.targets)
        if shortfall:
            result["warning"] = f"{shortfall}; the workers that do not fit wait until resources free up"
            self.controller._event(result["warning"], logging.WARNING)
        return result

    async def wait_settled(self, timeout_s: float) -> dict[str, Any]:
        await self._resume()
        await self.controller.wait_settled(timeout_s)
        return self.controller.status()

    async def status(self) -> dict[str, Any]:
        await self._resume()
        return self.controller.status()

    async def membership(self) -> list[dict[str, Any]]:
        await self._resume()
        return self.controller.membership()

    async def router_sync(self, router_id: str, workers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        await self._resume()
        return self.controller.router_sync(router_id, workers)

    async def planner_status(self) -> dict[str, Any] | None:
        """The goodput planner's counts and recent decisions, with the current targets (None: no planner)."""
        await self._resume()
        if self.controller.planner is None:
            return None
        return {**self.controller.planner.status(), "targets": self.controller.targets.counts()}

    async def shutdown(self) -> None:
        await self._resume()
        await self.controller.shutdown()

    async def ping(self) -> str:
        return self.config.name
