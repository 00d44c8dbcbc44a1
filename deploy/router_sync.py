"""Keeps a router's `WorkerPool` equal to the controller's membership (no static worker lists).

Every `interval_s` the router reports what it holds (address -> in-flight requests, draining)
and receives the membership (role, address, draining) in the same call:

- a new address is added (`add_worker`; the pool polls it and routes to it once healthy);
- `draining=True` stops new requests to it (`drain_worker`); `draining=False` on a worker the
  pool was draining takes it back (`add_worker` clears the flag);
- an address no longer listed is taken out of routing at once (`mark_unhealthy`) and removed
  (`remove_worker`: the pool closes its channel when nothing is in flight).

The report is what lets the controller finish a drain: a worker leaves only after every live
router has applied its draining flag and has nothing in flight on it. If the controller cannot
be reached or does not answer within `timeout_s`, the pool keeps its last membership and the next
round tries again.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Awaitable, Callable

from deploy.config import SYNC_INTERVAL_S, SYNC_TIMEOUT_S
from router.pool import WorkerPool

logger = logging.getLogger(__name__)

FetchMembership = Callable[[str, dict[str, dict[str, Any]]], Awaitable[list[dict[str, Any]]]]


class MembershipSync:
    def __init__(self, pool: WorkerPool, fetch: FetchMembership, interval_s: float = SYNC_INTERVAL_S,
                 router_id: str | None = None, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        for name, value in (("interval_s", interval_s), ("timeout_s", timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.pool = pool
        self.fetch = fetch
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:12]}"
        self.last_error: str | None = None
        self._retiring: set[str] = set()
        self._task: asyncio.Task | None = None

    def report(self) -> dict[str, dict[str, Any]]:
        return {w.address: {"inflight": w.inflight_requests, "draining": w.draining, "role": w.role}
                for w in self.pool.workers()}

    async def sync_once(self) -> None:
        try:
            membership = await asyncio.wait_for(self.fetch(self.router_id, self.report()), self.timeout_s)
        except asyncio.TimeoutError:  # a hung controller: say so, rather than wait on it forever
            raise TimeoutError(f"the controller did not answer within {self.timeout_s:g} s") from None
        self.apply(membership)

    def apply(self, membership: list[dict[str, Any]]) -> None:
        listed = {entry["address"]: entry for entry in membership}
        self._retiring &= {w.address for w in self.pool.workers()}
        for address, entry in listed.items():
            existing = self.pool.get(address)
            if existing is not None and existing.role != entry["role"]:
                # The address now belongs to a different worker (a port reused): retire the old one
                # first; the new one joins once the old one has left the pool.
                if address not in self._retiring:
                    self._retire(address, f"replaced by a {entry['role']} worker")
                continue
            if entry.get("draining"):
                if existing is not None and not existing.draining:
                    self.pool.drain_worker(address)
                    logger.info("worker %s (%s) draining", address, entry["role"])
                continue  # never add a worker that is already leaving
            if existing is None or existing.draining:
                try:
                    self.pool.add_worker(entry["role"], address)
                except ValueError as exc:
                    logger.warning("cannot add worker %s: %s", address, exc)
                    continue
                self._retiring.discard(address)
                logger.info("worker %s (%s) joined the pool", address, entry["role"])
        for worker in self.pool.workers():
            if worker.address not in listed and worker.address not in self._retiring:
                self._retire(worker.address, "removed by the controller")

    def _retire(self, address: str, reason: str) -> None:
        self.pool.mark_unhealthy(address, reason)
        self.pool.remove_worker(address)
        self._retiring.add(address)
        logger.info("worker %s left the pool: %s", address, reason)

    async def run(self) -> None:
        while True:
            try:
                await self.sync_once()
                if self.last_error is not None:
                    logger.info("controller reachable again")
                self.last_error = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.last_error is None:
                    logger.warning("cannot sync workers from the controller (keeping the last membership): %s", exc)
                self.last_error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(self.interval_s)

    def start(self) -> asyncio.Task:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="pdserve-membership-sync")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
