"""The worker registry: who serves, where, how healthy and how loaded.

`WorkerPool` holds one `WorkerInfo` (and one gRPC client) per worker address. It starts from the
static lists in `RouterConfig`; the Ray controller (deploy/) feeds it through the same methods:

    add_worker(role, address)        a new worker; polled at once, routable once it answers
    drain_worker(address)            no new requests; in-flight ones finish
    remove_worker(address)           drain, then close the channel when nothing is in flight
    mark_unhealthy(address, reason)  out of routing until a poll succeeds again

A background task polls every worker's Health and Stats each `stats_interval_s`; a worker is
routable when its last `unhealthy_after_failures` polls did not all fail and Health said ok.
With `config.kv_events`, another task per worker follows its KVEvents stream into `kv_index`
(router/kv_index.py), reopening it (a new snapshot) after any break while the worker is in the pool.
Besides the polled stats, the pool counts what this router has in flight on each worker (open
Generate streams, prompt tokens not yet prefilled), which is fresher than any poll.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from engine.config import ROLES
from router.client import WorkerClient
from router.config import RouterConfig, check_grpc_address
from router.kv_index import KVIndex
from wire.kv_events import kv_event_batch_from_wire
from wire.stats import WorkerStats, worker_stats_from_wire

logger = logging.getLogger(__name__)

KV_EVENTS_RETRY_S = 0.5  # first wait before reopening a broken KVEvents stream (doubles, ...)
KV_EVENTS_MAX_RETRY_S = 5.0  # (... up to this)
KV_SNAPSHOT_WAIT_S = 5.0  # at start, how long to wait for the healthy workers' first snapshots


@dataclass
class WorkerInfo:
    role: str  # "prefill", "decode" or "both" (colocated)
    address: str  # gRPC host:port
    healthy: bool = False
    draining: bool = False
    stats: WorkerStats = field(default_factory=WorkerStats)  # the last Stats answer (zeros before one)
    model: str = ""
    transport_address: str = ""
    consecutive_failures: int = 0
    last_error: str | None = None
    last_poll_time: float | None = None
    inflight_requests: int = 0  # this router's requests on this worker
    outstanding_prefill_tokens: int = 0  # prompt tokens sent here whose first token has not come back
    outstanding_at_poll: int = 0  # this router's share of `stats.prefill_tokens_queued` (see prefill_load_tokens)
    num_routed: int = 0  # requests this router has sent here, ever

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def prefill_load_tokens(self) -> int:
        """Queued prefill tokens: this router's outstanding ones, exact and current, plus the rest of
        the worker's own count at the last poll (other routers' work). The polled count alone goes
        stale as soon as a request it counted finishes its prefill: a sequence of requests would
        each see the previous one still queued. So this router's outstanding tokens at poll time
        (the larger of the counts at sending and at answering) come off the polled count."""
        others = max(0, self.stats.prefill_tokens_queued - self.outstanding_at_poll)
        return self.outstanding_prefill_tokens + others

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {"role": self.role, "address": self.address, "healthy": self.healthy, "draining": self.draining,
                "model": self.model, "transport_address": self.transport_address,
                "running": s.running, "waiting": s.waiting,
                "kv_blocks_total": s.kv_blocks_total, "kv_blocks_free": s.kv_blocks_free,
                "kv_blocks_cached": s.kv_blocks_cached, "block_size": s.block_size,
                "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
                "prefix_cache_hits": s.prefix_cache_hits,
                "prompt_tokens_computed": s.prompt_tokens_computed,
                "prefill_tokens_queued": s.prefill_tokens_queued,
                "num_preemptions": s.num_preemptions,
                "host_cache_blocks_total": s.host_cache_blocks_total,
                "host_cache_blocks_used": s.host_cache_blocks_used,
                "host_cache_hits": s.host_cache_hits,
                "kv_bytes_sent": s.kv_bytes_sent, "kv_bytes_received": s.kv_bytes_received,
                "spec_drafts": s.spec_drafts, "spec_draft_tokens": s.spec_draft_tokens,
                "spec_accepted_tokens": s.spec_accepted_tokens,
                "spec_acceptance_rate": s.spec_acceptance_rate,
                "router_inflight_requests": self.inflight_requests,
                "router_outstanding_prefill_tokens": self.outstanding_prefill_tokens,
                "router_num_routed": self.num_routed,
                "last_error": self.last_error, "last_poll_time": self.last_poll_time}


@dataclass
class Assignment:
    """One request's place in the pool; releases its load counts exactly once. Its prompt tokens
    count as outstanding prefill work on the worker that prefills it: the prefill worker, or the
    decode (or colocated) worker itself when none is named."""
    pool: "WorkerPool"
    decode: WorkerInfo
    prefill: WorkerInfo | None
    num_prompt_tokens: int
    _prefill_released: bool = False
    _released: bool = False

    @property
    def prefill_address(self) -> str:
        return self.prefill.address if self.prefill is not None else ""

    @property
    def prefilled_on(self) -> WorkerInfo:
        return self.prefill if self.prefill is not None else self.decode

    def prefill_done(self) -> None:
        if self._prefill_released:
            return
        self._prefill_released = True
        self.prefilled_on.outstanding_prefill_tokens -= self.num_prompt_tokens
        if self.prefill is not None:
            self.prefill.inflight_requests -= 1
            self.pool._maybe_close(self.prefill)

    def release(self) -> None:
        if self._released:
            return
        self.prefill_done()
        self._released = True
        self.decode.inflight_requests -= 1
        self.pool._maybe_close(self.decode)


@dataclass
class WorkerPool:
    config: RouterConfig
    # (address, role) -> a worker's client; None: a `WorkerClient` secured by the config's cluster secret
    client_factory: Callable[[str, str], Any] | None = None
    _workers: dict[str, WorkerInfo] = field(default_factory=dict)
    _clients: dict[str, Any] = field(default_factory=dict)
    _removed: set[str] = field(default_factory=set)
    _poll_task: asyncio.Task | None = None
    _background: set[asyncio.Task] = field(default_factory=set)
    _no_kv_events: set[str] = field(default_factory=set)  # workers whose KVEvents is UNIMPLEMENTED
    _shared_poll: asyncio.Future | None = None  # the poll_all_shared() under way
    _snapshots_in: asyncio.Event | None = None  # at start: set once every healthy worker's snapshot is in
    # Where prompt blocks are cached, per worker and tier, from the workers' KV events (the policies
    # route on it); None: a new one.
    kv_index: KVIndex | None = None
    # Called with a worker's address once it has left the pool (policies forget it).
    on_removed: Callable[[str], None] | None = None
    # Called with a worker's address when it stops answering polls (not when it reports "not ok":
    # a draining worker still finishes what it runs); its streams are cut, so they migrate.
    on_unreachable: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        if self.client_factory is None:
            self.client_factory = functools.partial(WorkerClient, auth=self.config.cluster_auth())
        if self.kv_index is None:
            self.kv_index = KVIndex.for_router(self.config)
        for role, addresses in self.config.workers_by_role().items():
            for address in addresses:
                self.add_worker(role, address)

    # ---- membership (the controller's interface) -----------------------------------------------

    def add_worker(self, role: str, address: str) -> WorkerInfo:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; choose one of {', '.join(ROLES)}")
        check_grpc_address(address, f"{role} worker")
        existing = self._workers.get(address)
        if existing is not None:
            if existing.role != role:
                raise ValueError(f"worker {address} is already registered as a {existing.role} worker")
            existing.draining = False
            self._removed.discard(address)
            return existing
        self._removed.discard(address)
        worker = WorkerInfo(role=role, address=address)
        self._workers[address] = worker
        if self._poll_task is not None:
            self._spawn(self.poll_worker(worker))
            self._follow(worker)
        return worker

    def drain_worker(self, address: str) -> None:
        self._get(address).draining = True

    def remove_worker(self, address: str) -> None:
        worker = self._get(address)
        worker.draining = True
        self._removed.add(address)
        self._maybe_close(worker)

    def mark_unhealthy(self, address: str, reason: str) -> None:
        worker = self._workers.get(address)
        if worker is not None and worker.healthy:
            logger.warning("worker %s (%s) taken out of routing: %s", address, worker.role, reason)
            worker.healthy = False
        if worker is not None:
            worker.last_error = reason

    def workers(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def get(self, address: str) -> WorkerInfo | None:
        return self._workers.get(address)

    def client(self, address: str) -> Any:
        """The worker's gRPC client, created on first use (grpc.aio channels bind to the running loop)."""
        client = self._clients.get(address)
        if client is None:
            worker = self._get(address)
            client = self._clients[address] = self.client_factory(address, worker.role)
        return client

    def has_role(self, role: str) -> bool:
        """Whether the pool holds a worker of `role`, healthy or not."""
        return any(worker.role == role for worker in self._workers.values())

    def routable(self, *roles: str) -> list[WorkerInfo]:
        return [w for w in self._workers.values() if w.role in roles and w.routable]

    @property
    def ready(self) -> bool:
        """One prefill and one decode worker answer, or one colocated worker does."""
        return bool(self.routable("both")) or (bool(self.routable("prefill")) and bool(self.routable("decode")))

    def block_size(self) -> int:
        """The KV block size the workers report (the config's until one has)."""
        for worker in self._workers.values():
            size = worker.stats.block_size
            if size:
                return size
        return self.config.block_size

    # ---- load accounting -----------------------------------------------------------------------

    def assign(self, decode: WorkerInfo, prefill: WorkerInfo | None, num_prompt_tokens: int) -> Assignment:
        decode.inflight_requests += 1
        decode.num_routed += 1
        if prefill is not None:
            prefill.inflight_requests += 1
            prefill.num_routed += 1
        assignment = Assignment(self, decode, prefill, num_prompt_tokens)
        assignment.prefilled_on.outstanding_prefill_tokens += num_prompt_tokens
        return assignment

    def _maybe_close(self, worker: WorkerInfo) -> None:
        address = worker.address
        if address in self._removed and worker.inflight_requests == 0 and self._workers.get(address) is worker:
            del self._workers[address]
            self._removed.discard(address)
            client = self._clients.pop(address, None)
            if client is not None:
                self._spawn(client.close())
            if self.on_removed is not None:
                self.on_removed(address)
            logger.info("worker %s (%s) removed from the pool", address, worker.role)

    # ---- polling -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Poll every worker once (so routing starts informed), then keep polling in the background."""
        await self.poll_all()
        self._poll_task = asyncio.create_task(self._poll_forever(), name="pdserve-router-pool-poll")
        for worker in self.workers():
            self._follow(worker)
        if self.config.kv_events:  # route the first request on what the workers hold
            self._snapshots_in = asyncio.Event()
            self._note_snapshot()
            try:
                await asyncio.wait_for(self._snapshots_in.wait(), KV_SNAPSHOT_WAIT_S)
            except asyncio.TimeoutError:
                pass
            finally:
                self._snapshots_in = None

    def _note_snapshot(self) -> None:
        """While start() waits: wake it once no healthy worker's snapshot is missing."""
        if self._snapshots_in is not None and not any(
                w.healthy and not self.kv_index.followed(w.address) and w.address not in self._no_kv_events
                for w in self.workers()):
            self._snapshots_in.set()

    async def stop(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
            self._poll_task = None
        if self._shared_poll is not None:
            self._shared_poll.cancel()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(client.close() for client in self._clients.values()), return_exceptions=True)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll_worker(worker) for worker in self.workers()))

    async def poll_all_shared(self) -> None:
        """`poll_all` for callers that only read the result (`GET /status`): callers arriving while
        one runs wait for that one instead of each polling every worker again."""
        if self._shared_poll is None or self._shared_poll.done():
            self._shared_poll = asyncio.ensure_future(self.poll_all())
        await asyncio.shield(self._shared_poll)

    async def poll_worker(self, worker: WorkerInfo) -> None:
        if self._workers.get(worker.address) is not worker:
            return
        client = self.client(worker.address)
        timeout = self.config.rpc_timeout_s
        outstanding_at_send = worker.outstanding_prefill_tokens
        try:
            health, stats = await asyncio.gather(client.health(timeout), client.stats(timeout))
        except (grpc.RpcError, asyncio.TimeoutError, OSError) as exc:
            was_healthy = worker.healthy
            self._poll_failed(worker, _describe_rpc_error(exc))
            # Unreachable once per run of failed polls: when they take it out of routing, or when
            # they reach the limit on a worker taken out before (mark_unhealthy: another stream
            # broke), whose streams would otherwise wait on a silent worker for good.
            lost = ((was_healthy and not worker.healthy)
                    or worker.consecutive_failures == self.config.unhealthy_after_failures)
            if lost and self.on_unreachable is not None:
                self.on_unreachable(worker.address)
            return
        worker.last_poll_time = time.time()
        worker.model, worker.transport_address = health.model, health.transport_address
        reported = health.role or stats.role
        if reported and (reported == "prefill") != (worker.role == "prefill"):
            self._poll_failed(worker, f"registered as a {worker.role} worker but reports role {reported!r}",
                              at_once=True)
            return
        worker.stats = worker_stats_from_wire(stats)
        worker.outstanding_at_poll = max(outstanding_at_send, worker.outstanding_prefill_tokens)
        if not health.ok:
            self._poll_failed(worker, "the worker reports it is not ok", at_once=True)
            return
        if not worker.healthy:
            logger.info("worker %s (%s) is healthy", worker.address, worker.role)
        worker.healthy = True
        worker.consecutive_failures = 0
        worker.last_error = None

    def _poll_failed(self, worker: WorkerInfo, reason: str, at_once: bool = False) -> None:
        worker.consecutive_failures += 1
        worker.last_error = reason
        if worker.healthy and (at_once or worker.consecutive_failures >= self.config.unhealthy_after_failures):
            logger.warning("worker %s (%s) is unhealthy: %s", worker.address, worker.role, reason)
            worker.healthy = False

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            try:
                await self.poll_all()
            except Exception:  # a poll bug must not stop polling
                logger.exception("worker poll failed")

    # ---- KV events -----------------------------------------------------------------------------

    def _follow(self, worker: WorkerInfo) -> None:
        if self.config.kv_events:
            self._spawn(self._follow_kv_events(worker))

    async def _follow_kv_events(self, worker: WorkerInfo) -> None:
        """Keep `kv_index` equal to the worker's prefix cache while it is in the pool. A worker
        without the RPC (UNIMPLEMENTED) is routed on what this router sent it."""
        delay = KV_EVENTS_RETRY_S
        while self._workers.get(worker.address) is worker:
            call = self.client(worker.address).kv_events()
            try:
                async for message in call:
                    if self._workers.get(worker.address) is not worker:  # removed from the pool meanwhile:
                        call.cancel()  # a late batch must not bring it back into the index
                        break
                    self.kv_index.apply(worker.address, kv_event_batch_from_wire(message))
                    self._note_snapshot()
                    delay = KV_EVENTS_RETRY_S
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("worker %s publishes no KV events; routing on what was sent there", worker.address)
                    self.kv_index.unfollow(worker.address)
                    self._no_kv_events.add(worker.address)
                    self._note_snapshot()
                    return
                logger.debug("KV events of %s: %s", worker.address, exc.details())
            except asyncio.CancelledError:
                call.cancel()
                raise
            self.kv_index.unfollow(worker.address)
            await asyncio.sleep(delay)
            delay = min(2 * delay, KV_EVENTS_MAX_RETRY_S)

    def _spawn(self, coroutine) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coroutine)
        except RuntimeError:  # no loop (construction outside the server): nothing to poll yet
            coroutine.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _get(self, address: str) -> WorkerInfo:
        worker = self._workers.get(address)
        if worker is None:
            raise ValueError(f"no worker with address {address} in the pool")
        return worker


def _describe_rpc_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"
