"""KVPusher: the prefill worker's `KVExporter`, pushing a prompt's blocks to a decode worker.

One export, after its destination was registered with `expect()`:

    export(request, block_ids)   engine thread: the scheduler pinned the prompt's blocks; the
                                 blocks [first_block_index, ...) are handed to the sender
    watcher thread               polls the sender; when the transfer ends (or its lease runs out)
                                 it forgets the transfer, posts `release_export` to the engine
                                 thread and resolves the export's future
    abort(request_id)            any thread: the sender stops reading the blocks, then the
                                 engine aborts the request (which releases them)
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.request import Request

logger = logging.getLogger(__name__)


@dataclass
class ExportResult:
    ok: bool
    bytes_sent: int
    error: str | None = None


@dataclass
class _Export:
    sender: Any
    address: str
    dst_block_ids: list[int]
    first_block_index: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    src_block_ids: list[int] = field(default_factory=list)
    deadline: float = 0.0
    started: bool = False


class KVPusher:
    """Each export names its kvtransfer sender (over this worker's caches); `release(request_id)` must
    unpin the request's blocks on the engine thread (e.g. `AsyncEngine.call(release_export)`).
    `lease_s` bounds how long blocks stay pinned for one transfer; `hold_s` delays every send
    (fault injection for tests: it makes the SENDING_KV state observable)."""

    def __init__(self, lease_s: float = 60.0, hold_s: float = 0.0, poll_s: float = 0.002) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.lease_s = lease_s
        self.hold_s = hold_s
        self.poll_s = poll_s
        self.release: Callable[[str], None] = lambda request_id: None
        self.abort_in_engine: Callable[[str], None] = lambda request_id: None
        self._lock = threading.Lock()
        self._expected: dict[str, _Export] = {}
        self._active: dict[str, _Export] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name="pdserve-kv-pusher", daemon=True)
        self._thread.start()

    # ---- prefill handler side -------------------------------------------------------------

    def expect(self, request_id: str, sender: Any, address: str, dst_block_ids: list[int],
               first_block_index: int) -> concurrent.futures.Future:
        """Register where `request_id`'s KV goes and which sender pushes it; the future resolves
        to an ExportResult."""
        export = _Export(sender, address, list(dst_block_ids), first_block_index)
        with self._lock:
            if request_id in self._expected or request_id in self._active:
                raise ValueError(f"request id {request_id!r} already has an export")
            self._expected[request_id] = export
        return export.future

    def forget(self, request_id: str) -> None:
        """The request ended before its export began (error, abort)."""
        with self._lock:
            self._expected.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """Stop an export in any state; the engine then aborts the request. True if it was known."""
        with self._lock:
            export = self._active.pop(request_id, None) or self._expected.pop(request_id, None)
        if export is not None and export.started:
            self._cancel_transfer(export, request_id)
        self.abort_in_engine(request_id)
        if export is not None and not export.future.done():
            export.future.set_result(ExportResult(False, 0, "aborted"))
        return export is not None

    # ---- KVExporter (engine thread) -------------------------------------------------------

    def export(self, request: Request, block_ids: list[int]) -> None:
        request_id = request.request_id
        with self._lock:
            export = self._expected.pop(request_id, None)
            if export is None:
                raise RuntimeError(f"no KV destination registered for request {request_id!r}")
            end = export.first_block_index + len(export.dst_block_ids)
            if end != len(block_ids):
                raise RuntimeError(f"the destination covers prompt blocks [{export.first_block_index}, {end}) "
                                   f"but the prompt has {len(block_ids)} blocks")
            export.deadline = time.monotonic() + self.hold_s
            self._active[request_id] = export
        export.src_block_ids = block_ids[export.first_block_index:end]
        self._wakeup.set()

    # ---- watcher thread -------------------------------------------------------------------

    def _watch(self) -> None:
        timeout = 0.5
        while not self._stopped:
            self._wakeup.wait(timeout)
            self._wakeup.clear()
            with self._lock:
                items = list(self._active.items())
            now = time.monotonic()
            timeout = min([self.poll_s if export.started else max(self.poll_s, export.deadline - now)
                           for _, export in items], default=0.5)
            for request_id, export in items:
                try:
                    self._advance(request_id, export, now)
                except Exception as exc:  # a broken transfer must not stop the others
                    logger.exception("export of %s failed", request_id)
                    self._end(request_id, export, ExportResult(False, 0, f"KV send failed: {exc}"))

    def _advance(self, request_id: str, export: _Export, now: float) -> None:
        if not export.started:
            if now < export.deadline:
                return
            with self._lock:  # under the lock, so that abort() cancels a send that has started
                if self._active.get(request_id) is not export:
                    return
                export.started = True
                export.deadline = now + self.lease_s
                export.sender.send(request_id, export.address, export.src_block_ids, export.dst_block_ids)
            return
        status = export.sender.poll(request_id)
        if status.done:
            self._end(request_id, export, ExportResult(status.ok, status.bytes_transferred, status.error))
        elif now > export.deadline:
            self._end(request_id, export, ExportResult(False, status.bytes_transferred,
                                                       f"KV transfer lease of {self.lease_s} s expired"))

    def _end(self, request_id: str, export: _Export, result: ExportResult) -> None:
        with self._lock:
            if self._active.get(request_id) is not export:
                return  # aborted meanwhile: abort() owns the cleanup
            del self._active[request_id]
        if export.started:
            self._cancel_transfer(export, request_id)
        self.release(request_id)
        if not export.future.done():
            export.future.set_result(result)

    @staticmethod
    def _cancel_transfer(export: _Export, request_id: str) -> None:
        try:
            export.sender.cancel(request_id)
        except Exception:
            logger.exception("cancelling the transfer of %s failed", request_id)

    def close(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=5)
