"""A worker's KV-cache events (engine/kv_events.py) on the wire: the KVEvents stream that routers
follow into their routing index. Torch-free, like wire/stats.py: the router imports both."""
from __future__ import annotations

from typing import Any

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from wire.schema import messages


def kv_event_batch_to_wire(batch: KVEventBatch) -> Any:
    pb = messages()
    events = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(pb.KVCacheEvent(stored=pb.BlockStored(
                block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash or b"",
                token_ids=list(event.token_ids), block_size=event.block_size, tier=event.tier)))
        elif isinstance(event, BlockRemoved):
            events.append(pb.KVCacheEvent(removed=pb.BlockRemoved(block_hashes=list(event.block_hashes),
                                                                  tier=event.tier, reason=event.reason)))
        else:
            events.append(pb.KVCacheEvent(cleared=pb.AllBlocksCleared()))
    return pb.KVEventBatch(seq=batch.seq, ts=batch.ts, events=events, snapshot=batch.snapshot, more=batch.more)


def kv_event_batch_from_wire(message: Any) -> KVEventBatch:
    events = []
    for event in message.events:
        kind = event.WhichOneof("event")
        if kind == "stored":
            stored = event.stored
            events.append(BlockStored(tuple(stored.block_hashes), stored.parent_block_hash or None,
                                      tuple(stored.token_ids), stored.block_size, stored.tier))
        elif kind == "removed":
            events.append(BlockRemoved(tuple(event.removed.block_hashes), event.removed.tier, event.removed.reason))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
    return KVEventBatch(message.seq, message.ts, events, message.snapshot, message.more)
