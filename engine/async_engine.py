"""AsyncEngine: runs `LLMEngine.step()` on one background thread and streams outputs to asyncio.
A step's KV-transfer outcomes (`apply_kv_transfers`: an imported request's first token, a
prefill worker's finished send) go out before its batch runs, not one model step later; and an
imported request's first token goes out as the prefill worker's answer arrives
(`report_kv_producer`), before the engine thread sees it.

Only the engine thread touches scheduler state: `generate()` and `abort()` post commands to an
inbox that the thread drains before every step, so the event loop never waits for a forward
pass. The thread sleeps while it has nothing to run (every request waiting for a KV transfer, or
no request at all) until a command arrives, a KV transfer ends (`LLMEngine.wakeup`) or a KV
deadline passes. The thread also publishes a snapshot of the engine's counters after every
step, which `stats()` returns at once: a health poll never waits behind a long prefill. Each request gets an asyncio queue; a caller that stops iterating (client disconnect,
cancellation) aborts its request, which frees its blocks at the next step boundary.

KV-cache events (engine/kv_events.py; `cache.kv_events` on): after every step and command the
thread takes the engine's new events and publishes them as one numbered batch to every
`subscribe_kv_events()` feed. A feed starts with a snapshot taken on the engine thread between two
batches, so snapshot + batches is exactly the cache's history from then on.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from engine.engine import LLMEngine, Prompt, token_logprobs
from engine.kv_hooks import ProducerReport
from engine.kv_events import KVEventBatch
from engine.outputs import StreamDelta
from engine.request import Request
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Put on a stream by `hand_over()`: it ends without its finished delta (see RequestStream).
_HANDED_OVER = object()


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        # Decode role: the prefill worker's answers go to it; any role: its failure counters
        # join the stats snapshot, its deadlines wake the engine thread.
        self._connector = engine.kv_connector
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._wakeup = engine.wakeup  # commands and KV transfers that end both set it
        self._stopped = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._died: BaseException | None = None
        self._aborts_before_add: set[str] = set()  # engine thread: aborted while its stream waits for the add
        self._snapshot = self._engine_stats()  # (SchedulerStats, queued prompt tokens), replaced whole
        self._kv_feeds: set[KVEventFeed] = set()
        self._kv_lock = threading.Lock()
        self._kv_seq = 0  # the last published batch (engine thread)
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) -------------------------------------------------------

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None, detokenize: bool = True
                       ) -> AsyncIterator[StreamDelta]:
        """Yields deltas until one has `finished`. Raises ValueError for an invalid request."""
        if params is not None and params.structured_output is not None:  # compiles a grammar: off the loop
            request = await asyncio.to_thread(self.engine.make_request, prompt, params, request_id, priority,
                                              cache_salt)
        else:
            request = self.engine.make_request(prompt, params, request_id, priority, cache_salt)
        async for delta in self.submit(request, detokenize):
            yield delta

    async def submit(self, request: Request, detokenize: bool = True) -> AsyncIterator[StreamDelta]:
        stream = self.open_stream(request.request_id)
        self.add(request, detokenize)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def open_stream(self, request_id: str) -> "RequestStream":
        """Register the output stream of a request that the caller adds itself, e.g. through
        `call(LLMEngine.add_imported, ...)`. Call from the event loop that reads it;
        `close()` it when done (an unfinished request is then aborted)."""
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        return RequestStream(self, request_id, stream)

    def is_open(self, request_id: str) -> bool:
        """Whether a stream is registered for `request_id` (its request may not be added yet)."""
        with self._streams_lock:
            return request_id in self._streams

    def make_request(self, *args, **kwargs) -> Request:
        """`LLMEngine.make_request`: any thread may call it (it changes no engine state)."""
        return self.engine.make_request(*args, **kwargs)

    @property
    def block_size(self) -> int:
        return self.engine.config.cache.block_size

    @property
    def weight_bytes(self) -> int:
        return self.engine.runner.weight_bytes

    def add(self, request: Request, detokenize: bool = True) -> None:
        """Queue a request whose stream was opened with `open_stream` (an invalid one's
        ValueError is raised to that stream's reader)."""
        self._post(("add", request, detokenize))

    def report_kv_producer(self, request: Request, report: ProducerReport | None, error: str | None = None) -> None:
        """Decode role, on the stream's event loop: the prefill worker answered for `request`
        (added with `call(LLMEngine.add_imported, ...)`): its report, or why it failed. The
        report's first token goes to the request's stream at once when the connector allows it
        (`KVConnector.stream_first_token`: sampled from this prompt), rather than when the engine
        thread next takes commands (after the model step in progress: up to a decode step later);
        the engine's own delta for it then carries no token. The answer goes to the engine thread
        either way, which checks the KV and admits the request, or falls back."""
        request_id = request.request_id
        # A first token that may end the request (an EOS or stop token id) goes out with the
        # engine's finished delta instead: that delta decides its text (left out when it ends it).
        may_end = report is not None and (report.first_token.token_id in request.eos_token_ids
                                          or report.first_token.token_id in request.sampling_params.stop_token_ids)
        if report is not None and error is None and not may_end:
            token = report.first_token
            delta = StreamDelta(request_id, [token.token_id], new_logprobs=token_logprobs([token.token_id], [token]),
                                num_cached_tokens=request.num_cached_tokens,
                                num_prompt_tokens=request.num_prompt_tokens)
            self._connector.stream_first_token(request_id, report, lambda: self._deliver(delta, request_id))
        self.call(lambda _: self._connector.report_producer(request_id, report, error))

    def _close_stream(self, request_id: str, abort: bool) -> None:
        if abort:
            self._post(("abort", request_id))
        with self._streams_lock:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def hand_over(self) -> int:
        """End every open stream now, without its finished delta: a draining worker's callers
        resume their requests elsewhere. Each request is aborted (its blocks freed) as its reader
        closes the stream. Returns how many streams were open."""
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, _HANDED_OVER)
        return len(streams)

    async def subscribe_kv_events(self, max_pending: int = 1024) -> "KVEventFeed":
        """A feed of this engine's KV-cache events: a snapshot, then every batch. ValueError
        when the engine does not record them (`cache.kv_events` off)."""
        self._check_alive()
        if not self.engine.config.cache.kv_events:
            raise ValueError("this engine does not record KV-cache events (cache.kv_events is off)")
        feed = KVEventFeed(self, asyncio.get_running_loop(), max_pending)

        def register(engine: LLMEngine) -> None:
            self._publish_kv_events()  # what happened before goes to the feeds that were there
            feed._offer(KVEventBatch(self._kv_seq, time.time(), engine.kv_snapshot(), snapshot=True))
            with self._kv_lock, feed._lock:
                if not feed._ended:  # closed meanwhile (its caller gave up): never subscribed
                    self._kv_feeds.add(feed)
        try:
            await asyncio.wrap_future(self.call(register))
        except BaseException:  # cancelled while the engine thread registers it: not left subscribed
            feed.close()
            raise
        return feed

    def _unsubscribe(self, feed: "KVEventFeed") -> None:
        with self._kv_lock:
            self._kv_feeds.discard(feed)

    def stats(self):
        """`LLMEngine.stats()`, with the KV connector's failures by reason, as of the end of the
        last step (or inbox drain), without waiting
        for the engine thread. Raises EngineUnavailable once the engine cannot take requests, so a
        health check built on it fails instead of reporting stale numbers (`last_stats` has them)."""
        self._check_alive()
        return self._snapshot

    def last_stats(self):
        """The last `stats()` snapshot, also once the engine is down (its numbers then stay put)."""
        return self._snapshot

    @property
    def down_reason(self) -> str | None:
        """Why the engine cannot take requests (its loop died, it shut down, its tensor-parallel
        group broke), or None while it can."""
        if self._died is not None:
            return f"engine loop died: {self._died}"
        if self._stopped.is_set():
            return "engine is shut down"
        if self.engine.broken is not None:
            return f"engine cannot step: {self.engine.broken}"
        return None

    def _check_alive(self) -> None:
        reason = self.down_reason
        if reason is not None:
            raise EngineUnavailable(reason)

    def call(self, fn, *args):
        """Run `fn(engine, *args)` on the engine thread; returns a concurrent Future (for stats, admin)."""
        import concurrent.futures
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", fn, args, future))
        return future

    def shutdown(self) -> None:
        self._stopped.set()
        self._wakeup.set()
        self._thread.join(timeout=30)
        if self._thread.is_alive():  # never close under a step still running
            logger.error("the engine thread did not stop within 30 s; its model runner is left running")
            return
        self.engine.close()

    # ---- engine thread ----------------------------------------------------------------------

    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wakeup.set()
        if self._died is not None or self._stopped.is_set():  # nobody will run it: fail it now
            self._fail_inbox(self._end_message())

    def _end_message(self) -> str:
        return f"engine loop died: {self._died}" if self._died is not None else "engine is shut down"

    def _fail_inbox(self, message: str) -> None:
        """After the loop ended: fail every queued call and the stream of every queued request."""
        for command in self._queued_commands():
            error = EngineUnavailable(message)
            if command[0] == "call" and command[3].set_running_or_notify_cancel():
                command[3].set_exception(error)
            elif command[0] == "add":
                self._deliver(error, command[1].request_id)

    def _queued_commands(self):
        """Take commands off the inbox until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, delta: StreamDelta | BaseException, request_id: str) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody reads it any more
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _drain_inbox(self) -> None:
        # The stats snapshot is refreshed after each command and before its result or output is
        # handed out, so whoever reacts to that result sees counters at least that new.
        for command in self._queued_commands():
            kind = command[0]
            if kind == "add":
                _, request, detokenize = command
                try:
                    self.engine.add(request, detokenize)
                except Exception as exc:  # validation the caller could not do (e.g. duplicate id)
                    self._refresh_snapshot()
                    self._deliver(exc, request.request_id)
                    continue
                self._abort_added()
                self._refresh_snapshot()
            elif kind == "abort":
                request_id = command[1]
                final = self.engine.abort(request_id)
                self._refresh_snapshot()
                if final is not None:
                    self._deliver(final, final.request_id)
                elif self.is_open(request_id) and self.engine.scheduler.get_request(request_id) is None:
                    self._aborts_before_add.add(request_id)  # its add (or add_imported call) is on the way
            elif kind == "call":
                _, fn, args, future = command
                # The call runs even if its caller gave up waiting (its effects, e.g. a finished
                # import, must happen); marking the future running first means a cancel can no
                # longer race with setting its result, which would raise here and stop the loop.
                wanted = future.set_running_or_notify_cancel()
                try:
                    try:
                        result = fn(self.engine, *args)
                    except Exception as exc:
                        self._refresh_snapshot()
                        if wanted:
                            future.set_exception(exc)
                            wanted = False
                        continue
                    self._abort_added()
                    self._refresh_snapshot()
                    if wanted:
                        future.set_result(result)
                        wanted = False
                finally:
                    if wanted:  # the loop failed around the call (it dies now): its caller must not wait for good
                        future.set_exception(EngineUnavailable("engine loop died during this call"))

    def _abort_added(self) -> None:
        """Abort the requests whose abort arrived before they were added, once they are."""
        for request_id in list(self._aborts_before_add):
            final = self.engine.abort(request_id)
            if final is not None or not self.is_open(request_id):
                self._aborts_before_add.discard(request_id)
            if final is not None:
                self._deliver(final, request_id)

    def _refresh_snapshot(self) -> None:
        """After each step and command: the stats snapshot, and the KV events it caused."""
        self._snapshot = self._engine_stats()
        self._publish_kv_events()

    def _engine_stats(self):
        stats, queued = self.engine.stats()
        if self._connector is not None:
            stats = dataclasses.replace(stats, kv_transfer_failures=dict(self._connector.failures))
        return stats, queued

    def _publish_kv_events(self) -> None:
        events = self.engine.take_kv_events()
        if not events:
            return
        self._kv_seq += 1
        batch = KVEventBatch(self._kv_seq, time.time(), events)
        with self._kv_lock:
            feeds = list(self._kv_feeds)
        for feed in feeds:
            feed._offer(batch)

    def _wait_for_work(self, timeout: float) -> None:
        deadline = self._connector.next_deadline() if self._connector is not None else None
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wait_for_work(self._idle_wait_s)
                    continue
                # The step in its two halves, the first one's outputs out before the batch runs.
                transfers = self.engine.apply_kv_transfers()
                if transfers:
                    self._refresh_snapshot()  # before the outputs go out (see _drain_inbox)
                    for delta in transfers:
                        self._deliver(delta, delta.request_id)
                deltas = self.engine.run_batch()
                self._refresh_snapshot()
                for delta in deltas:
                    self._deliver(delta, delta.request_id)
                if self.engine.last_step_idle:  # e.g. every request waits for its KV transfer
                    self._wait_for_work(self._idle_wait_s)
        except BaseException as exc:  # a bug in the loop: fail every open stream and call rather than hang them
            self._died = exc
            logger.exception("engine loop died")
        self._fail_everything(self._end_message())  # (shut down: the same for what was still open)

    def _fail_everything(self, message: str) -> None:
        with self._streams_lock:
            ids = list(self._streams)
        for request_id in ids:
            self._deliver(EngineUnavailable(message), request_id)
        with self._kv_lock:
            feeds, self._kv_feeds = list(self._kv_feeds), set()
        for feed in feeds:
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody reads it any more
                feed._fail(EngineUnavailable(message))
        self._fail_inbox(message)


class RequestStream:
    """The deltas of one request, as an async iterator that ends after the finished delta (or
    earlier, unfinished, when the engine hands its streams over: `AsyncEngine.hand_over`).

    An exception the engine thread delivers (e.g. an invalid request) is raised to the reader.
    `close(abort=True)` aborts the request unless its finished delta was read.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self._engine = engine
        self.request_id = request_id
        self._stream = stream
        self.finished = False
        self.handed_over = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished or self.handed_over:
            raise StopAsyncIteration
        delta = await self._stream.queue.get()
        if delta is _HANDED_OVER:
            self.handed_over = True
            raise StopAsyncIteration
        if isinstance(delta, BaseException):
            raise delta
        self.finished = delta.finished
        return delta

    def close(self, abort: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine._close_stream(self.request_id, abort and not self.finished)


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests: its loop died, it shut down, or its tensor-parallel group
    broke (`AsyncEngine.down_reason`). Raised to new calls and streams, and to the open ones as
    the loop ends; servers answer UNAVAILABLE, so callers try another worker."""


class KVEventsOverflow(RuntimeError):
    """A KV event feed's reader fell too far behind; it must subscribe again (a new snapshot)."""


class KVEventFeed:
    """One subscriber's KV event batches (engine/kv_events.py), as an async iterator: the
    snapshot first, then every published batch in order. A reader more than `max_pending`
    batches behind gets `KVEventsOverflow` instead of unbounded memory; a dead engine ends the
    feed with RuntimeError. `close()` unsubscribes."""

    def __init__(self, engine: AsyncEngine, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self._ended = False

    def _offer(self, batch: KVEventBatch) -> None:
        """Engine thread: queue a batch, or end the feed when its reader is too far behind."""
        with self._lock:
            if self._ended:
                return
            self._pending += 1
            overflow = self._pending > self._max_pending
        if overflow:
            self._fail(KVEventsOverflow(f"the reader fell more than {self._max_pending} batches behind"))
            return
        self._loop.call_soon_threadsafe(self._queue.put_nowait, batch)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._engine._unsubscribe(self)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, error)

    def __aiter__(self) -> "KVEventFeed":
        return self

    async def __anext__(self) -> KVEventBatch:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        with self._lock:
            self._pending -= 1
        return item

    def close(self) -> None:
        with self._lock:
            self._ended = True
        self._engine._unsubscribe(self)
