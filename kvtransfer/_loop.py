"""An asyncio event loop running on its own thread, owned by one sender or receiver."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable, TypeVar

from ._common import cancel_and_wait

T = TypeVar("T")


class LoopThread:
    """Runs an event loop on a daemon thread so the caller's thread never blocks on I/O.

    `call` runs a plain function on the loop thread and waits for it: everything that
    writes into KV blocks runs on this thread, so a `call` that flips a flag is ordered
    against every write. A `call` or `submit` from another thread either runs, or raises
    RuntimeError once `stop()` began to stop the loop: never left waiting (`_lock` orders the
    scheduling against the loop's own stop).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._started.wait()
        self._stopped = False
        self._lock = threading.Lock()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self.name} is closed")
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result (never from the loop thread)."""
        if self.in_loop_thread():
            raise RuntimeError("LoopThread.run() called from its own loop thread")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self.name}: no result within {timeout} s") from None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the loop thread and return its result."""
        if self.in_loop_thread():
            return fn(*args)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def invoke() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller's thread
                future.set_exception(exc)

        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self.name} is closed")
            self.loop.call_soon_threadsafe(invoke)  # ahead of the loop's stop, so it runs
        return future.result()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule `fn(*args)` on the loop thread without waiting."""
        if self.in_loop_thread():
            self.loop.call_soon(fn, *args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every task still on the loop, stop it and join the thread."""
        if self._stopped:
            return
        if self.in_loop_thread():
            raise RuntimeError("LoopThread.stop() called from its own loop thread")
        try:
            self.run(self._cancel_tasks(), timeout)
        finally:
            with self._lock:
                self._stopped = True
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.loop.close()

    async def _cancel_tasks(self) -> None:
        current = asyncio.current_task()
        await cancel_and_wait([task for task in asyncio.all_tasks() if task is not current])
        await self.loop.shutdown_default_executor()


def pick_loop(transports, name: str) -> tuple[LoopThread, list]:
    """The shared loop of a transport that needs one (ucx), else a new loop of our own; with
    the transports whose shared loop was acquired (release each when done)."""
    shared, users = None, []
    try:
        for transport in transports:
            loop = transport.acquire_shared_loop()
            if loop is not None:
                shared = shared or loop
                users.append(transport)
    except BaseException:
        for transport in users:
            transport.release_shared_loop()
        raise
    return (shared or LoopThread(name)), users
