"""Sending a request to the workers: admission, worker choice, the Generate stream, cleanup.

A `Generation` is one request's life on the cluster, as the router sees it:

    NEW        admitted (counts against max_inflight_requests, and a priority > 0 request against
               its class's batch_share of it; beyond either a 429 whose Retry-After is the wait
               for a slot at the recent finish rate), no worker chosen yet
    STARTING   decode (+ prefill) worker chosen, Generate opened, waiting for the first chunk;
               a decode worker that does not answer (UNAVAILABLE) is marked unhealthy and the
               request goes to another one (max_dispatch_retries times), as it does when the
               stream ends before its first chunk (a draining worker handing its streams over)
    STREAMING  chunks flow; `cancel()` (client gone) or `abort()` (stop string) end it early.
               If the decode worker fails mid-stream (UNAVAILABLE, the stream ends before a
               finish reason: also a draining worker handing its streams over, or the worker
               stops answering health polls while the stream is silent: a hung process), it is
               marked unhealthy and the generation MIGRATES: back to
               STARTING on another worker with the prompt plus the tokens already delivered as
               `num_resumed_tokens`, which the engine counts as outputs (max_tokens, penalties,
               seeded draws by output position), so the client's stream simply goes on with the
               tokens the first worker would have produced (max_migrations times)
    CLOSED     `close()`: load counts released, affinity recorded, metrics observed, the stream
               cancelled if it was still open (the decode worker then aborts and frees blocks)

Every path ends in CLOSED exactly once (the HTTP layer calls `close()` in a `finally`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import Any, Sequence

import grpc

from engine.block_hash import DEFAULT_HASH_ALGORITHM, CacheSalt, hash_full_blocks
from engine.config import DECODE_ROLES
from engine.sampling_params import SamplingParams
from router.config import RouterConfig
from router.engagement import classify
from router.errors import APIError, invalid_request, overloaded, unavailable, upstream_failed
from router.metrics import RequestTimer, RouterMetrics
from router.policies import Choice, Policy, prefill_locally
from router.pool import Assignment, WorkerPool
from router.traces import watch as watch_traced_call
from wire import tracing

logger = logging.getLogger(__name__)

DRAIN_WINDOW_S = 30.0  # the finish rate behind a full router's Retry-After is measured over this
MAX_RETRY_AFTER_S = 60


class ClientGone(Exception):
    """The HTTP client went away; its request was cancelled on the workers."""


class WorkerLost(Exception):
    """The decode worker stopped answering health polls; its stream was cancelled."""


# Stream failures that mean "the worker is gone", not "the worker refused or failed the request".
MIGRATABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


def rpc_error_to_api(exc: grpc.aio.AioRpcError, retry_after_s: int) -> APIError:
    """A worker's gRPC status as the HTTP error the client should see."""
    code, details = exc.code(), exc.details() or exc.code().name
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        error = invalid_request(details)
        if "context" in details:
            error.code = "context_length_exceeded"
        return error
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return overloaded(f"the decode worker is at capacity: {details}", retry_after_s)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return unavailable(f"no decode worker could take the request: {details}", retry_after_s)
    return upstream_failed(f"the decode worker failed the request ({code.name}): {details}")


class LiveGenerations:
    """The generations in flight, so that a decode worker that stops answering cuts theirs (each
    then migrates, see Generation). Built before the pool, which reports such a worker here."""

    def __init__(self) -> None:
        self._generations: set[Generation] = set()

    def add(self, generation: "Generation") -> None:
        self._generations.add(generation)

    def discard(self, generation: "Generation") -> None:
        self._generations.discard(generation)

    def worker_unreachable(self, address: str) -> None:
        for generation in list(self._generations):
            if generation.decode_address == address:
                generation.worker_lost()


class Dispatcher:
    def __init__(self, config: RouterConfig, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy,
                 metrics: RouterMetrics, live: LiveGenerations) -> None:
        self.config = config
        self.pool = pool
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.metrics = metrics
        self.inflight = 0
        self.inflight_batch = 0  # of them, priority > 0 (see RouterConfig.batch_share)
        self.batch_limit = max(1, int(config.max_inflight_requests * config.batch_share))
        self._finished: collections.deque[float] = collections.deque()  # when requests closed (monotonic)
        self._finished_batch: collections.deque[float] = collections.deque()  # of them, priority > 0
        self._background: set[asyncio.Task] = set()
        self._live = live

    def generation(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                   timer: RequestTimer, cache_salt: CacheSalt | None = None, priority: int = 0) -> "Generation":
        """Admit a request (429 when the router is full, 503 when no worker can serve it)."""
        if not self.pool.routable(*DECODE_ROLES):
            raise unavailable("no healthy decode worker is available; try again shortly", self.config.retry_after_s)
        priority_class = "batch" if priority > 0 else "interactive"
        message, batch_share_full = None, False
        if self.inflight >= self.config.max_inflight_requests:
            message = (f"the router already has {self.inflight} requests in flight "
                       f"(max_inflight_requests={self.config.max_inflight_requests})")
        elif priority_class == "batch" and self.inflight_batch >= self.batch_limit:
            message = (f"the router already has {self.inflight_batch} requests of priority > 0 in flight, their "
                       f"share of the limit (batch_share={self.config.batch_share:g} of max_inflight_requests="
                       f"{self.config.max_inflight_requests}); priority <= 0 requests are still admitted")
            batch_share_full = True
        if message is not None:
            self.metrics.shed.labels(priority_class).inc()
            # the wait for a slot it may take: any slot, or one its class frees
            window = self._finished_batch if batch_share_full else self._finished
            raise overloaded(message, self.admission_retry_after(time.monotonic(), window))
        # Built before it is counted: a constructor that raises must not hold a slot for good.
        generation = Generation(self, request_id, list(prompt_token_ids), params, timer, cache_salt, priority)
        self.inflight += 1
        self.inflight_batch += priority_class == "batch"
        self._live.add(generation)
        return generation

    def admission_retry_after(self, now: float, finished: collections.deque[float] | None = None) -> int:
        """Retry-After for a request refused because the router (or its class's share) is full:
        the seconds until a slot frees at the rate requests (of the class) finished over the last
        DRAIN_WINDOW_S (1 to MAX_RETRY_AFTER_S), or `retry_after_s` when none finished (nothing to
        go by)."""
        finished = _forget_before(self._finished if finished is None else finished, now - DRAIN_WINDOW_S)
        if not finished:
            return self.config.retry_after_s
        rate = len(finished) / max(1.0, now - finished[0])
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(1.0 / rate)))

    def record_finished(self, now: float, batch: bool) -> None:
        for finished in (self._finished, self._finished_batch) if batch else (self._finished,):
            _forget_before(finished, now - DRAIN_WINDOW_S).append(now)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: CacheSalt | None,
                     known: Sequence[bytes] = ()) -> list[bytes]:
        """The chained hashes the workers' prefix caches use (engine/block_hash.py's default).
        `known`: those of a prefix of `token_ids` at this block size, continued from (a prompt's,
        for the prompt and its output: the output's blocks only are hashed on the event loop)."""
        known = list(known)
        return known + hash_full_blocks(token_ids, self.pool.block_size(), cache_salt, DEFAULT_HASH_ALGORITHM,
                                        parent=known[-1] if known else None, start_block=len(known))

    def wire_request(self, generation: "Generation", prefill_address: str, resumed: Sequence[int] = ()) -> Any:
        import wire
        pb = wire.messages()
        return pb.GenerateRequest(request_id=generation.request_id,
                                  prompt_token_ids=list(generation.prompt_token_ids) + list(resumed),
                                  sampling=wire.sampling_to_wire(generation.params), prefill_address=prefill_address,
                                  priority=generation.priority, num_resumed_tokens=len(resumed),
                                  **wire.cache_salt_to_wire(generation.cache_salt))

    def send_abort(self, address: str, request_id: str) -> None:
        """Fire-and-forget Abort on a worker (idempotent on the worker's side)."""
        client = self.pool.client(address) if self.pool.get(address) is not None else None
        if client is None:
            return

        async def abort() -> None:
            try:
                await client.abort(request_id, self.config.rpc_timeout_s)
            except (grpc.RpcError, asyncio.TimeoutError) as exc:
                logger.debug("Abort(%s) on %s failed: %s", request_id, address, exc)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class Generation:
    trace: Any = None  # with tracing on, the request's RequestTrace (router/traces.py), which records dispatches

    def __init__(self, dispatcher: Dispatcher, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, timer: RequestTimer, cache_salt: CacheSalt | None, priority: int) -> None:
        self.dispatcher = dispatcher
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.timer = timer
        self.cache_salt = cache_salt
        self.priority = priority
        self.hashes = dispatcher.block_hashes(prompt_token_ids, cache_salt)
        self._hashes_block_size = dispatcher.pool.block_size()  # (the pool's changes when workers report theirs)
        self.assignment: Assignment | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._cancelled = False
        self._closed = False
        self._stream_ended = False
        self.delivered: list[int] = []  # output token ids received so far (what a migration resumes from)
        self.migrations = 0
        self._worker_lost = False
        # How the prompt got its KV (router/engagement.py), from the first dispatch and the chunks
        self._fill_eligible: bool | None = None
        self._prefilled_remotely = False
        self._kv_failure_reason = ""
        self._kv_bytes = 0

    @property
    def decode_address(self) -> str | None:
        return self.assignment.decode.address if self.assignment else None

    @property
    def prefill_address(self) -> str | None:
        return self.assignment.prefill_address if self.assignment else None

    async def start(self, beside: str | None = None) -> Any:
        """Choose workers, open Generate and return the first TokenChunk (see the module docstring).
        `beside`: a decode worker whose prefix cache already holds this prompt (another choice of
        the same `n > 1` request): the request goes there and prefills there, reading the prompt's
        full blocks from that cache, while the worker is routable."""
        return await self._dispatch(set(), beside)

    async def _dispatch(self, tried: set[str], beside: str | None = None) -> Any:
        """Open Generate on a worker not in `tried` (resuming after `self.delivered`); returns the
        first TokenChunk."""
        d = self.dispatcher
        resumed = list(self.delivered)
        hashes = d.block_hashes(self.prompt_token_ids + resumed, self.cache_salt, self._prompt_hashes()) \
            if resumed else self.hashes
        last_error = ""
        for attempt in range(d.config.max_dispatch_retries + 1):
            if self._cancelled:
                raise ClientGone()
            candidates = [w for w in d.pool.routable(*DECODE_ROLES) if w.address not in tried]
            if not candidates:
                break
            routed_ns = time.time_ns() if self.trace is not None else 0
            sibling = next((w for w in candidates if w.address == beside), None) if attempt == 0 else None
            decode = Choice(sibling, "sibling") if sibling else d.decode_policy.choose(candidates, hashes)
            prefill = considered = None  # (considered: the prefill worker weighed, for the trace)
            num_tokens = len(self.prompt_token_ids) + len(resumed)
            # prompt_logprobs are computed where the prompt is prefilled: on the decode worker here.
            if decode.worker.role == "decode" and sibling is None and self.params.prompt_logprobs is None:
                prefill_candidates = d.pool.routable("prefill")
                if prefill_candidates:
                    prefill = considered = d.prefill_policy.choose(prefill_candidates, hashes)
                    if prefill_locally(decode, prefill, num_tokens, d.pool.block_size(), d.config.local_prefill_weight):
                        prefill = None
                        d.metrics.routing.labels("prefill", "local_queue").inc()
                    else:
                        d.metrics.routing.labels("prefill", prefill.reason).inc()
                        d.metrics.routing_hits.labels("prefill", _hit_tier(prefill)).inc()
                        d.prefill_policy.record(prefill.worker, hashes)
            if self._fill_eligible is None:  # could a prefill worker have taken it? (the first dispatch's answer)
                self._fill_eligible = (decode.worker.role == "decode" and sibling is None
                                       and self.params.prompt_logprobs is None and d.pool.has_role("prefill"))
            d.metrics.routing.labels("decode", decode.reason).inc()
            d.metrics.routing_hits.labels("decode", _hit_tier(decode)).inc()
            d.decode_policy.record(decode.worker, hashes)
            self.assignment = d.pool.assign(decode.worker, prefill.worker if prefill else None, num_tokens)
            request = d.wire_request(self, self.assignment.prefill_address, resumed)
            span = None if self.trace is None else self.trace.generate_started(
                self, routed_ns, decode, prefill, considered, attempt, len(resumed))
            self._call = d.pool.client(decode.worker.address).generate(
                request, None if span is None else tracing.metadata(span))
            if span is not None:
                watch_traced_call(span, self._call)
            self._stream_ended = False
            self._worker_lost = False
            if attempt == 0 and not resumed:
                self.timer.dispatched()
            try:
                chunk = await self._read()
            except (grpc.aio.AioRpcError, WorkerLost) as exc:
                self.assignment.release()
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise rpc_error_to_api(exc, d.config.retry_after_s) from None
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "stopped answering health polls"
                last_error = f"{decode.worker.address}: {detail}"
                d.pool.mark_unhealthy(decode.worker.address, f"Generate failed: {detail}")
                tried.add(decode.worker.address)
                continue
            if chunk is None:  # e.g. a draining worker handed its streams over: try another one
                self.assignment.release()
                last_error = f"{decode.worker.address}: it closed the stream before sending a token"
                tried.add(decode.worker.address)
                continue
            return chunk
        detail = f" (last error: {last_error})" if last_error else ""
        raise unavailable(f"no decode worker could take the request{detail}", d.config.retry_after_s)

    async def next_chunk(self) -> Any | None:
        """The next TokenChunk; None when the stream has ended. A worker failing mid-stream is
        replaced (see MIGRATES in the module docstring) before the error would reach the client."""
        try:
            chunk = await self._read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in MIGRATABLE_CODES or not self._may_migrate():
                raise rpc_error_to_api(exc, self.dispatcher.config.retry_after_s) from None
            return await self._migrate(f"{exc.code().name}: {exc.details()}")
        except WorkerLost:
            if not self._may_migrate():
                raise unavailable("the decode worker stopped answering mid-stream",
                                  self.dispatcher.config.retry_after_s) from None
            return await self._migrate("it stopped answering health polls")
        if chunk is None and self._may_migrate():
            return await self._migrate("the stream ended before the request finished")
        return chunk

    def _may_migrate(self) -> bool:
        return (not self._cancelled and self.assignment is not None
                and self.migrations < self.dispatcher.config.max_migrations)

    async def _migrate(self, reason: str) -> Any:
        d = self.dispatcher
        failed = self.assignment.decode.address
        logger.warning("request %s: decode worker %s failed after %d tokens (%s); resuming on another worker",
                       self.request_id, failed, len(self.delivered), reason)
        d.pool.mark_unhealthy(failed, f"Generate stream broke: {reason}")
        d.send_abort(failed, self.request_id)  # if it still runs there, free its blocks
        self.assignment.release()
        self.migrations += 1
        d.metrics.migrations.inc()
        if self.trace is not None:
            self.trace.migration(self, failed, reason)
        if len(self.delivered) >= self.params.max_tokens:  # it broke right after the last token
            self._stream_ended = True
            import wire
            return wire.messages().TokenChunk(finish_reason="length")
        return await self._dispatch({failed})

    async def _read(self) -> Any | None:
        try:
            chunk = await self._call.read()
        except asyncio.CancelledError:
            if self._cancelled:
                raise ClientGone() from None
            if self._worker_lost:
                raise WorkerLost() from None
            raise
        if chunk is grpc.aio.EOF:
            self._stream_ended = True
            return None
        if self.migrations:
            chunk.num_cached_tokens = 0  # usage reports the first worker's prefix-cache hit
        if chunk.prefilled_remotely:  # the chunk that says how the KV arrived (not always the first
            # token's: a decode worker streams that one as the prefill worker answers)
            self.timer.kv_transfer(chunk.kv_bytes_received, chunk.kv_transfer_seconds)
            self._prefilled_remotely = True
        if chunk.kv_failure_reason:
            self._kv_failure_reason = chunk.kv_failure_reason
        self._kv_bytes += chunk.kv_bytes_received
        if chunk.token_ids:
            self.delivered.extend(chunk.token_ids)
            self.assignment.prefill_done()
            self.timer.tokens(len(chunk.token_ids))
        if chunk.finish_reason:
            self._stream_ended = True
        return chunk

    def worker_lost(self) -> None:
        """The decode worker stopped answering polls: cut the stream; the reader migrates."""
        if self._closed or self._cancelled or self._stream_ended or self._call is None:
            return
        self._worker_lost = True
        self._call.cancel()

    def cancel(self) -> None:
        """The client is gone: cancel the stream (the decode worker aborts the request)."""
        if self._closed or self._cancelled:
            return
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def abort(self) -> None:
        """The router ended the request (a stop string): cancel the stream and send Abort."""
        if self._call is not None and not self._stream_ended:
            self._call.cancel()
            self.dispatcher.send_abort(self.assignment.decode.address, self.request_id)
        self._stream_ended = True

    def _prompt_hashes(self) -> list[bytes]:
        """The prompt's hashes, to continue from; none if the pool's block size changed since."""
        return self.hashes if self._hashes_block_size == self.dispatcher.pool.block_size() else []

    def withdraw(self) -> None:
        """Undo the admission of a generation that never started, its request refused as a whole
        (a later sequence of it got a 429): nothing finished, so the drain rate behind
        Retry-After and the finish metrics do not count it."""
        if not self._closed:
            assert self.assignment is None and self._call is None, "withdraw() is for a generation never started"
            self._release_slot()

    def _release_slot(self) -> None:
        self._closed = True
        d = self.dispatcher
        d.inflight -= 1
        d.inflight_batch -= self.priority > 0
        d._live.discard(self)

    def close(self, finish_reason: str, output_token_ids: Sequence[int] = (), num_cached_tokens: int = 0) -> None:
        if self._closed:
            return
        self._release_slot()
        d = self.dispatcher
        d.record_finished(time.monotonic(), self.priority > 0)
        if self._call is not None and not self._stream_ended:
            self._call.cancel()
        if self.assignment is not None:
            self.assignment.release()
            if finish_reason in ("stop", "length", "tool_calls") and output_token_ids:
                sequence = self.prompt_token_ids + list(output_token_ids)
                d.decode_policy.record(self.assignment.decode,
                                       d.block_hashes(sequence, self.cache_salt, self._prompt_hashes()))
            if self.delivered:  # the prompt was filled somewhere
                fill = classify(self._prefilled_remotely, self._kv_failure_reason, len(self.prompt_token_ids),
                                num_cached_tokens, d.pool.block_size(), bool(self._fill_eligible),
                                d.config.engagement_min_prompt_tokens)
                self.timer.prompt_filled(fill, len(self.prompt_token_ids), self._kv_bytes)
        self.timer.finish(finish_reason, len(self.prompt_token_ids), num_cached_tokens)


def _forget_before(finished: collections.deque[float], horizon: float) -> collections.deque[float]:
    """`finished` without its entries older than `horizon` (so it stays the window's size)."""
    while finished and finished[0] < horizon:
        finished.popleft()
    return finished


def _hit_tier(choice: Choice) -> str:
    """The deepest tier the chosen worker holds the prompt's prefix in."""
    return "host" if choice.match.host else "device" if choice.match.device else "none"
