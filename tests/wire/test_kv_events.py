"""KV-cache events on the wire (wire/kv_events.py): every event shape round-trips, and a whole
cache's snapshot goes in parts that each stay far below the message limit and, applied in
order, give a router's index the same state as the batch (the worker counted as followed only
once the last part is in)."""
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.kv_index import KVIndex, Match
from serving import KV_EVENTS_PER_MESSAGE
from wire.kv_events import kv_event_batch_from_wire, kv_event_batch_to_wire

BLOCK = 16


def block_hash(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_every_event_shape_round_trips():
    batch = KVEventBatch(7, 123.5, [AllBlocksCleared(),
                                    BlockStored((block_hash(1), block_hash(2)), None, tuple(range(32)), BLOCK, "device"),
                                    BlockStored((block_hash(3),), block_hash(2), tuple(range(16)), BLOCK, "host"),
                                    BlockRemoved((block_hash(1),), "device", "evicted")], snapshot=True)
    assert kv_event_batch_from_wire(kv_event_batch_to_wire(batch)) == batch


def test_a_large_snapshot_goes_in_parts_that_rebuild_the_same_index():
    blocks = 3 * KV_EVENTS_PER_MESSAGE + 5  # a 180k-block GPU cache would be one 24 MB message
    events = [AllBlocksCleared()] + [
        BlockStored.of_block(block_hash(i), (block_hash(i - 1) if i else None, None, tuple(range(BLOCK))),
                             "device" if i % 3 else "host") for i in range(blocks)]
    batch = KVEventBatch(42, 1.0, events, snapshot=True)
    parts = batch.parts(KV_EVENTS_PER_MESSAGE)
    assert len(parts) == 4 and [p.more for p in parts] == [True, True, True, False]
    assert all(p.seq == 42 and p.snapshot for p in parts)
    messages = [kv_event_batch_to_wire(part) for part in parts]
    assert max(m.ByteSize() for m in messages) < 1 << 20

    whole, in_parts = KVIndex(10.0, 1024), KVIndex(10.0, 1024)
    whole.apply("w", batch)
    for message in messages:
        in_parts.apply("w", kv_event_batch_from_wire(message))
        assert in_parts.followed("w") == (message is messages[-1])
    hashes = [block_hash(i) for i in range(blocks)]
    assert in_parts.match("w", hashes[1:]) == whole.match("w", hashes[1:]) == Match(2, 1)  # 1, 2 device; 3 host
    for tier in ("device", "host"):
        assert in_parts.size(tier) == whole.size(tier) > 0
    small = KVEventBatch(43, 2.0, [BlockRemoved((block_hash(1),), "device", "evicted")])
    assert small.parts(KV_EVENTS_PER_MESSAGE) == [small]
