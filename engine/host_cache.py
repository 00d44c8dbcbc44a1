"""Host-memory tier of the prefix cache (KV offload): evicted blocks live on in host slots.

The device KV pool is small next to host memory, and an agent session sits idle between turns
(a tool runs, a person types) while other traffic evicts its blocks. With a host tier, a cached
block that the block manager evicts is first copied to a host slot under the same content hash;
a later prefix lookup that misses on the device goes on in the host tier, and every block found
there is copied back into a new device block instead of being recomputed.

This module is the host tier's index only: which slot holds which hash (with the block's content
key, so a collision is a miss), LRU order, and the copies the runner must make. The block
manager calls it; the runner (`ModelRunner.offload` / `reload`) moves the bytes.

Contract for the copies (`take_copies()`, drained by the scheduler into each `Batch`, and by the
engine right after a decode-role import allocates blocks):
- `offloads` (device block -> slot) read blocks that were just evicted: they run before anything
  writes into those blocks (swap-ins, reloads, the forward, a KV import);
- `reloads` (slot -> device block) run after the offloads of the same batch (a reload target may
  be a block evicted, and offloaded, in the same pass);
- a slot named by a queued copy (a reload reading it, or an offload writing it) is pinned until
  the copies are taken, so no offload reuses it first and no slot is written twice in one batch.
  Whoever takes the copies does them at once, on the same thread, before anything else touches
  the cache (the scheduler's caller, in `LLMEngine.step` and `LLMEngine.add_imported`); when
  every slot is pinned, an evicted block is simply not saved.
The tier is inclusive: a reloaded block keeps its host copy, so evicting it again costs no copy.
With a `kv_events` list, every entry saved or dropped appends its event (engine/kv_events.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from engine.kv_events import BlockRemoved, BlockStored, KVEvent


class HostCache:
    def __init__(self, num_slots: int, kv_events: list[KVEvent] | None = None) -> None:
        """`kv_events`: where to record what the tier stores and drops (None: nowhere)."""
        if num_slots < 1:
            raise ValueError(f"a host cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._content: dict[int, Hashable] = {}  # slot -> content key of the block it holds
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: low slots first
        self._pinned: set[int] = set()
        self._offloads: list[tuple[int, int]] = []
        self._reloads: list[tuple[int, int]] = []
        self.offloaded_blocks = 0  # cumulative
        self.reloaded_blocks = 0  # cumulative
        self._kv_events = kv_events

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def save(self, block_hash: bytes, content: Hashable, block_id: int) -> None:
        """A cached device block is being evicted: keep its KV (copy queued) unless the tier
        already holds that content, or every slot is pinned."""
        slot = self._lru.get(block_hash)
        if slot is not None and self._content[slot] == content:
            self._lru.move_to_end(block_hash)
            return
        if slot is not None:  # a colliding hash: the newer content replaces it, unless being read
            if slot in self._pinned:
                return
            self._drop(block_hash, "replaced")
        slot = self._take_slot()
        if slot is None:
            return
        self._lru[block_hash] = slot
        self._content[slot] = content
        self._pinned.add(slot)
        self._offloads.append((block_id, slot))
        self.offloaded_blocks += 1
        if self._kv_events is not None:
            self._kv_events.append(BlockStored.of_block(block_hash, content, "host"))

    def lookup(self, block_hash: bytes, content: Hashable) -> int | None:
        """The slot holding this block's KV, or None (a hash whose content differs is a miss)."""
        slot = self._lru.get(block_hash)
        if slot is None or self._content[slot] != content:
            return None
        return slot

    def pin(self, block_hash: bytes) -> int:
        """Keep a looked-up entry (most recently used, not evictable until the copies are taken):
        done before allocating its device block, whose evictions may need host slots."""
        slot = self._lru[block_hash]
        self._lru.move_to_end(block_hash)
        self._pinned.add(slot)
        return slot

    def reload(self, slot: int, block_id: int) -> None:
        """Queue the copy of a pinned slot back into device block `block_id`."""
        assert slot in self._pinned, "reload of a slot that was not pinned"
        self._reloads.append((slot, block_id))
        self.reloaded_blocks += 1

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(offloads, reloads) queued since the last call, for the runner to do now (in that order)."""
        copies = (self._offloads, self._reloads)
        self._offloads, self._reloads = [], []
        self._pinned.clear()
        return copies

    def clear(self) -> None:
        """Forget every entry (queued copies stay: they may already be depended on)."""
        for block_hash in [h for h, slot in self._lru.items() if slot not in self._pinned]:
            self._drop(block_hash, "cleared")

    def entries(self) -> list[tuple[bytes, Hashable]]:
        """(hash, content key) of every block the tier holds, least recently used first."""
        return [(block_hash, self._content[slot]) for block_hash, slot in self._lru.items()]

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._lru.items():  # least recently used first
            if slot not in self._pinned:
                self._drop(block_hash, "evicted")
                return self._free.pop()
        return None

    def _drop(self, block_hash: bytes, reason: str) -> None:
        slot = self._lru.pop(block_hash)
        del self._content[slot]
        self._free.append(slot)
        if self._kv_events is not None:
            self._kv_events.append(BlockRemoved((block_hash,), "host", reason))

    def check_integrity(self) -> None:
        slots = list(self._lru.values())
        if len(set(slots)) != len(slots):
            raise AssertionError("host cache: a slot holds two hashes")
        if sorted(slots + self._free) != list(range(self.num_slots)):
            raise AssertionError("host cache: slots are not free xor used exactly once")
        if set(self._content) != set(slots):
            raise AssertionError("host cache: stored contents do not match the used slots")
