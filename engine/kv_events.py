"""KV-cache events: what a worker's prefix cache stores and removes, per tier, for routers.

The shapes are vLLM's (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, in batches), with the
tier named: `device` (the KV pool the model reads) or `host` (the host-memory tier,
engine/host_cache.py). Block hashes are the chained hashes of `engine.block_hash`, the ones a
router computes for a prompt, so an index of events answers "which workers hold this prompt's
first n blocks, and in which tier".

Contract:
- The block manager records an event for every change of the set of blocks a prefix lookup can
  find: a block registered in the device cache (`BlockStored`, tier device), evicted from it
  (`BlockRemoved`, reason `evicted`, or `cleared` by a cache reset), saved to the host tier
  (`BlockStored`, tier host) or dropped from it (`BlockRemoved`: `evicted` for room, `replaced`
  by a colliding hash, `cleared`). A block can be in both tiers (the host tier is inclusive).
- Events are taken in order (`BlockManager.take_kv_events`) and published in one batch per
  engine step or command (engine/async_engine.py), numbered by `seq`.
- A subscriber's first batch is a snapshot: `AllBlocksCleared`, then one `BlockStored` per block
  cached in each tier. Applying it, then every later batch in order, gives the worker's state.
  On the wire a large batch goes in parts (`KVEventBatch.parts`, `more` on all but the last).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

TIERS: tuple[str, ...] = ("device", "host")


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]  # the tokens of every block, in order
    block_size: int
    tier: str

    @classmethod
    def of_block(cls, block_hash: bytes, content: tuple, tier: str) -> "BlockStored":
        """One block, from its content key as the block manager keeps it (parent hash, extra key,
        token ids)."""
        parent, _, token_ids = content
        return cls((block_hash,), parent, tuple(token_ids), len(token_ids), tier)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    tier: str
    reason: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """Forget every block this worker reported (the start of a snapshot)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class KVEventBatch:
    seq: int  # batches of one engine are numbered 1, 2, ...; a snapshot carries the last one's seq
    ts: float  # time.time() when published
    events: list[KVEvent] = field(default_factory=list)
    snapshot: bool = False
    more: bool = False  # a part of a batch sent in parts: the next part (same seq) continues it

    def parts(self, max_events: int) -> list["KVEventBatch"]:
        """The batch in parts of at most `max_events` events (a whole cache's snapshot is too
        large for one message), every one but the last with `more`. Applied in order, the parts
        give the same state as the batch."""
        if len(self.events) <= max_events:
            return [self]
        chunks = [self.events[i:i + max_events] for i in range(0, len(self.events), max_events)]
        return [KVEventBatch(self.seq, self.ts, chunk, self.snapshot, more=index < len(chunks) - 1)
                for index, chunk in enumerate(chunks)]
