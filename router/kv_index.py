"""Where each prompt block is cached, per worker and tier: the routers' index of the workers'
KV-cache events (engine/kv_events.py, the workers' KVEvents streams).

Per worker the index holds:
- the blocks the worker reported, by tier (`device`, `host`): exact, as of its last batch. A
  stream starts with a snapshot, so a router that (re)connects knows the state at once.
- the blocks this router sent there and the worker has not reported yet (`note_routed`): a burst
  of requests sharing a prefix must land together before the first one's prefill reports it.
  For a worker that publishes events these count for `pending_ttl_s` only (its report replaces
  them), also while its stream reconnects (a restarted worker's cache is empty); for a worker
  without a KVEvents stream (or a router run with --no-kv-events) they are all there is
  (bounded, least recently routed forgotten first): the estimate routers used before events.

`match(address, hashes)` is what the worker's own lookup would find for a prompt: the leading
blocks on the device (or pending), then the run after them in the host tier, which the worker
copies back instead of recomputing (engine/block_manager.py).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from engine.block_hash import BlockHash
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

if TYPE_CHECKING:
    from router.config import RouterConfig


@dataclass(frozen=True)
class Match:
    device: int = 0  # leading blocks on the device tier (or routed there, not yet reported)
    host: int = 0  # the blocks right after those that the host tier holds

    @property
    def blocks(self) -> int:
        return self.device + self.host


@dataclass
class _Worker:
    device: set[BlockHash] = field(default_factory=set)
    host: set[BlockHash] = field(default_factory=set)
    pending: OrderedDict[BlockHash, float] = field(default_factory=OrderedDict)  # hash -> when routed
    followed: bool = False  # its KVEvents stream is live (its sets are exact)
    publishes: bool = False  # it has had a stream: its pending entries expire (its reports replace them)


class KVIndex:
    def __init__(self, pending_ttl_s: float, pending_capacity_blocks: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if pending_capacity_blocks < 1:
            raise ValueError(f"pending_capacity_blocks must be >= 1, got {pending_capacity_blocks}")
        self.pending_ttl_s = pending_ttl_s
        self.pending_capacity_blocks = pending_capacity_blocks
        self._clock = clock
        self._workers: dict[str, _Worker] = {}

    @classmethod
    def for_router(cls, config: RouterConfig) -> KVIndex:
        return cls(config.kv_pending_ttl_s, config.affinity_capacity_blocks)

    # ---- events ------------------------------------------------------------------------------

    def apply(self, address: str, batch: KVEventBatch) -> None:
        """One batch of the worker's KVEvents stream, in order (a snapshot replaces its state)."""
        worker = self._workers.setdefault(address, _Worker())
        worker.publishes = True
        if not batch.more:  # a snapshot in parts is exact once its last part is in
            worker.followed = True
        for event in batch.events:
            if isinstance(event, BlockStored):
                tier = worker.device if event.tier == "device" else worker.host
                tier.update(event.block_hashes)
                if event.tier == "device":
                    for block_hash in event.block_hashes:
                        worker.pending.pop(block_hash, None)
            elif isinstance(event, BlockRemoved):
                tier = worker.device if event.tier == "device" else worker.host
                tier.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                worker.device.clear()
                worker.host.clear()

    def unfollow(self, address: str) -> None:
        """The worker's stream ended: what it reported may be stale, forget it (routing falls
        back to what this router sent there, until a new stream's snapshot)."""
        worker = self._workers.get(address)
        if worker is not None:
            worker.device.clear()
            worker.host.clear()
            worker.followed = False

    def note_routed(self, address: str, hashes: Sequence[BlockHash]) -> None:
        """This router sent a request with these blocks to the worker (they will be cached there)."""
        worker = self._workers.setdefault(address, _Worker())
        now = self._clock()
        for block_hash in hashes:
            if block_hash not in worker.device:
                worker.pending[block_hash] = now
                worker.pending.move_to_end(block_hash)
        while len(worker.pending) > self.pending_capacity_blocks:
            worker.pending.popitem(last=False)
        self._expire(worker, now)

    def _expire(self, worker: _Worker, now: float) -> None:
        """Drop a publishing worker's pending entries older than the TTL, from the front (the
        entries are in the order they were last routed)."""
        if worker.publishes:
            while worker.pending and now - next(iter(worker.pending.values())) > self.pending_ttl_s:
                worker.pending.popitem(last=False)

    def forget(self, address: str) -> None:
        """The worker left the pool."""
        self._workers.pop(address, None)

    # ---- queries -----------------------------------------------------------------------------

    def match(self, address: str, hashes: Sequence[BlockHash]) -> Match:
        worker = self._workers.get(address)
        if worker is None or not hashes:
            return Match()
        self._expire(worker, self._clock())
        device = 0
        for block_hash in hashes:
            if block_hash in worker.device or block_hash in worker.pending:
                device += 1
            else:
                break
        host = 0
        for block_hash in hashes[device:]:
            if block_hash not in worker.host:
                break
            host += 1
        return Match(device, host)

    def followed(self, address: str) -> bool:
        worker = self._workers.get(address)
        return worker is not None and worker.followed

    def size(self, tier: str) -> int:
        """Blocks reported in `tier` ("device", "host") or routed and not yet reported ("pending"),
        summed over the workers."""
        if tier == "pending":
            now = self._clock()
            for worker in self._workers.values():
                self._expire(worker, now)
            return sum(len(w.pending) for w in self._workers.values())
        return sum(len(w.device if tier == "device" else w.host) for w in self._workers.values())
