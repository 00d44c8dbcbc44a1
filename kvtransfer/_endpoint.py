"""What a KVSender and a KVReceiver share: the transfer records of one side, keyed by request id
under one lock (its condition wakes `wait()`ers on every change), the I/O thread's event loop
(its own, or one a transport shares), and the engine-thread calls that only read a record
(`poll`, `wait`) or hop to the loop (`cancel`), and `close()`.

A side defines `_start()` / `_shutdown()` (on the loop: listen or connect, then close it all),
`_cancel_on_loop(request_id)`, and may extend `_unbind_locked(record)` (drop what binds an
ended record to a connection). A record has `request_id`, `state`, `error`, `active` and
`status()`.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch

from ._common import TaskSet
from ._loop import pick_loop
from ._payload import CacheViews
from .config import TransferConfig
from .layout import KVLayout, PackedBlocks
from .status import TransferError, TransferState, TransferStatus
from .transports.base import Transport


class TransferEndpoint:
    side = ""  # "sender" or "receiver": in messages and the I/O thread's name
    unknown_hint = ""  # why a request id may be unknown, for the KeyError

    def __init__(self, transports: Sequence[Transport], layer_caches: Sequence[torch.Tensor],
                 config: TransferConfig | None, on_transfer_end: Callable[[str], None] | None,
                 packed: PackedBlocks | None, transport_name: str | None = None,
                 layer_windows: Sequence[int] = ()) -> None:
        self.config = config or TransferConfig()
        self._on_transfer_end = on_transfer_end
        self.layout = KVLayout.from_caches(layer_caches, packed, layer_windows)
        if self.layout.chunk_nbytes > self.config.max_message_bytes:
            raise ValueError(f"one KV chunk is {self.layout.chunk_nbytes} bytes, above "
                             f"max_message_bytes={self.config.max_message_bytes}")
        self.transport = transport_name or "+".join(t.name for t in transports)
        self._transports = list(transports)
        self._views = CacheViews(layer_caches, self.layout)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._transfers: dict[str, Any] = {}  # request id -> the side's record
        self._total_bytes = 0
        self._closed = False
        self._loop_thread, self._shared_loop_users = pick_loop(self._transports, f"kvtransfer-{self.side}")
        self._tasks = TaskSet()

    def _run_start(self, timeout: float) -> None:
        """Run `_start()` on the loop (the subclass's constructor, last); on failure release the loop."""
        try:
            self._loop_thread.run(self._start(), timeout=timeout)
        except BaseException:
            self._release_loop()
            raise

    # ---- public API (engine thread) -------------------------------------------------------

    def poll(self, request_id: str) -> TransferStatus:
        """The transfer's current status; KeyError if it is unknown or was cancelled."""
        with self._lock:
            return self._get(request_id).status()

    def wait(self, request_id: str, timeout: float | None = None) -> TransferStatus:
        """Block until the transfer ends or `timeout` passes; return its status. For tools and
        tests: an engine loop polls instead."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                record = self._get(request_id)
                remaining = None if deadline is None else deadline - time.monotonic()
                if record.state.is_terminal or (remaining is not None and remaining <= 0):
                    return record.status()
                self._changed.wait(remaining)

    def cancel(self, request_id: str) -> None:
        """Stop the transfer in whatever state and forget it (also the way to drop the record of
        a finished one); the peer is told. Idempotent. Once it returns this side does not touch
        the transfer's blocks any more: a receiver writes no byte into them, a sender reads none
        (a cross-memory shm receiver may still be copying them, but never counts a copy that
        ended after the cancel), and they go back to their owner."""
        if self._closed:
            return
        self._loop_thread.call(self._cancel_on_loop, request_id)

    def close(self) -> None:
        """Fail every live transfer, close listeners and connections, stop the I/O thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop_thread.run(self._shutdown(), timeout=max(30.0, 3 * self.config.timeout_s))
        finally:
            with self._changed:
                for record in self._transfers.values():
                    self._end_locked(record, TransferState.FAILED, f"{self.side} closed")
                self._changed.notify_all()
            self._release_loop()
            self._views.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- what the sides define ------------------------------------------------------------

    async def _start(self) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError

    def _cancel_on_loop(self, request_id: str) -> None:
        raise NotImplementedError

    def _unbind_locked(self, record: Any) -> None:
        """An ended record leaves its connection's bookkeeping (caller holds the lock)."""

    # ---- helpers ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.side} is closed")

    def _get(self, request_id: str) -> Any:
        record = self._transfers.get(request_id)
        if record is None:
            raise KeyError(f"unknown request id {request_id!r} ({self.unknown_hint})")
        return record

    def _release_loop(self) -> None:
        if not self._shared_loop_users:
            self._loop_thread.stop()
        for transport in self._shared_loop_users:
            transport.release_shared_loop()

    def _end_locked(self, record: Any, state: TransferState, error: str | None) -> bool:
        """Move a live transfer to SUCCESS or FAILED (caller holds the lock); False if it had
        ended already. Wakes waiters and tells `on_transfer_end`."""
        if record.state.is_terminal:
            record.active = False
            return False
        record.state, record.error, record.active = state, error, False
        self._unbind_locked(record)
        self._changed.notify_all()
        if self._on_transfer_end is not None:
            self._on_transfer_end(record.request_id)
        return True
