"""AsyncEngine: runs `LLMEngine.step()` on one background thread and streams outputs to asyncio.

Only the engine thread touches scheduler state: `generate()` and `abort()` post commands to an
inbox that the thread drains before every step, so the event loop never waits for a forward
pass. Each request gets an asyncio queue; a caller that stops iterating (client disconnect,
cancellation) aborts its request, which frees its blocks at the next step boundary.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from engine.engine import LLMEngine, Prompt
from engine.outputs import StreamDelta
from engine.request import Request
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) -------------------------------------------------------

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None, detokenize: bool = True
                       ) -> AsyncIterator[StreamDelta]:
        """Yields deltas until one has `finished`. Raises ValueError for an invalid request."""
        request = self.engine.make_request(prompt, params, request_id, priority, cache_salt)
        async for delta in self.submit(request, detokenize):
            yield delta

    async def submit(self, request: Request, detokenize: bool = True) -> AsyncIterator[StreamDelta]:
        if self._stopped.is_set():
            raise RuntimeError("engine is shut down")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if request.request_id in self._streams:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._streams[request.request_id] = stream
        self._post(("add", request, detokenize))
        finished = False
        try:
            while True:
                delta = await stream.queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            if not finished:
                self._post(("abort", request.request_id))
            with self._streams_lock:
                self._streams.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

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

    # ---- engine thread ----------------------------------------------------------------------

    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    def _deliver(self, delta: StreamDelta | BaseException, request_id: str) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, request, detokenize = command
                try:
                    self.engine.add(request, detokenize)
                except Exception as exc:  # validation the caller could not do (e.g. duplicate id)
                    self._deliver(exc, request.request_id)
            elif kind == "abort":
                final = self.engine.abort(command[1])
                if final is not None:
                    self._deliver(final, final.request_id)
            elif kind == "call":
                _, fn, args, future = command
                try:
                    future.set_result(fn(self.engine, *args))
                except Exception as exc:
                    future.set_exception(exc)

    def _wait_for_work(self, timeout: float) -> None:
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wait_for_work(self._idle_wait_s)
                    continue
                for delta in self.engine.step():
                    self._deliver(delta, delta.request_id)
                if self.engine.last_step_idle:  # e.g. every request waits for its KV transfer
                    self._wait_for_work(0.002)
        except BaseException as exc:  # a bug in the loop: fail every open stream rather than hang it
            logger.exception("engine loop died")
            with self._streams_lock:
                ids = list(self._streams)
            for request_id in ids:
                self._deliver(RuntimeError(f"engine loop died: {exc}"), request_id)
