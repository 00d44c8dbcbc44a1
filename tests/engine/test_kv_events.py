"""KV-cache events (engine/kv_events.py): replaying a worker's events gives exactly the blocks its
prefix cache holds in each tier (fake runner, random workload with shared prefixes, a small
device pool and a host tier); the async engine's feeds: a snapshot first, then every batch, and
an end instead of unbounded memory for a reader that does not read."""
import asyncio
import random

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine, KVEventsOverflow
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.request import Request
from engine.scheduler import Scheduler
from tests.engine.fake_runner import FakeModelRunner, step
from tests.engine.tiny_models import save_tiny_model, tiny_config

BS = 4


class Mirror:
    """What a router's index keeps of one worker: the block hashes per tier, from events."""

    def __init__(self):
        self.tiers = {"device": set(), "host": set()}

    def apply(self, events):
        for event in events:
            if isinstance(event, BlockStored):
                assert event.block_size == len(event.token_ids) == BS
                self.tiers[event.tier].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.tiers[event.tier], "a removal of a block never stored"
                self.tiers[event.tier].difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.tiers = {"device": set(), "host": set()}

    @classmethod
    def of(cls, events):
        mirror = cls()
        mirror.apply(events)
        return mirror


def test_replaying_the_events_gives_the_cache_in_both_tiers():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4),
                          CacheConfig(block_size=BS, kv_events=True), 24, 256, num_host_slots=12)
    runner = FakeModelRunner(24, BS)
    rng = random.Random(3)
    systems = [[rng.randrange(1000) for _ in range(3 * BS)] for _ in range(4)]
    mirror = Mirror()
    kinds = set()
    for i in range(40):
        if scheduler.num_waiting + scheduler.num_running < 4:
            prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 6),
                                                                          temperature=0.0)))
        step(scheduler, runner)
        events = scheduler.block_manager.take_kv_events()
        kinds |= {(type(e).__name__, getattr(e, "tier", ""), getattr(e, "reason", "")) for e in events}
        mirror.apply(events)
        assert mirror.tiers == Mirror.of(scheduler.block_manager.kv_snapshot()).tiers, f"after step {i}"
    assert {("BlockStored", "device", ""), ("BlockRemoved", "device", "evicted"), ("BlockStored", "host", ""),
            ("BlockRemoved", "host", "evicted")} <= kinds
    scheduler.block_manager.reset_prefix_cache()
    mirror.apply(scheduler.block_manager.take_kv_events())
    assert mirror.tiers == Mirror.of(scheduler.block_manager.kv_snapshot()).tiers
    assert not mirror.tiers["host"]


def test_no_events_are_kept_unless_asked():
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=BS), 16, 64)
    scheduler.add_request(Request("a", list(range(9)), SamplingParams(max_tokens=2, temperature=0.0)))
    step(scheduler, FakeModelRunner(16, BS))
    assert scheduler.block_manager.take_kv_events() == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), tiny_config())


def test_a_feed_is_a_snapshot_then_every_batch_in_order(tiny):
    llm = LLM(tiny, num_blocks=32, block_size=BS, kv_events=True)
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def main():
        async def run(prompt):
            async for _ in engine.generate(prompt, params):
                pass
        await run(list(range(2, 30)))
        first = await engine.subscribe_kv_events()
        await asyncio.gather(*(run([5 + i] * 20 + list(range(40, 60))) for i in range(6)))
        second = await engine.subscribe_kv_events()
        snapshot = await asyncio.wait_for(anext(second), 10)
        batches = [await asyncio.wait_for(anext(first), 10)]
        while batches[-1].seq < snapshot.seq:
            batches.append(await asyncio.wait_for(anext(first), 10))
        first.close()
        second.close()
        return snapshot, batches

    try:
        snapshot, batches = asyncio.run(main())
    finally:
        engine.shutdown()
    assert batches[0].snapshot and not any(b.snapshot for b in batches[1:]) and snapshot.snapshot
    assert [b.seq for b in batches[1:]] == list(range(batches[0].seq + 1, snapshot.seq + 1))
    assert Mirror.of(batches[0].events).tiers["device"]  # the first request's blocks
    replayed = Mirror.of([e for b in batches for e in b.events])
    assert replayed.tiers == Mirror.of(snapshot.events).tiers
    assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events)  # 32 blocks: evictions


def test_a_reader_too_far_behind_is_ended_not_buffered(tiny):
    llm = LLM(tiny, num_blocks=64, block_size=BS, kv_events=True)
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def main():
        feed = await engine.subscribe_kv_events(max_pending=2)  # the snapshot is one
        for i in range(4):
            async for _ in engine.generate([3 + i] * 12, params):
                pass
        with pytest.raises(KVEventsOverflow, match="more than 2 batches behind"):
            while True:
                await asyncio.wait_for(anext(feed), 10)

    plain = AsyncEngine(LLM(tiny, num_blocks=16, block_size=BS).engine)
    try:
        asyncio.run(main())
        with pytest.raises(ValueError, match="does not record KV-cache events"):
            asyncio.run(plain.subscribe_kv_events())
    finally:
        engine.shutdown()
        plain.shutdown()


def test_a_subscription_cancelled_while_it_registers_is_not_left_subscribed(tiny):
    """A KVEvents call cancelled (its router gone) while the engine thread registers its feed:
    the feed is closed, never left receiving batches that no one reads."""
    engine = AsyncEngine(LLM(tiny, num_blocks=16, block_size=BS, kv_events=True).engine)

    async def main():
        for _ in range(5):
            subscribing = asyncio.ensure_future(engine.subscribe_kv_events())
            await asyncio.sleep(0)  # the registration is posted to the engine thread
            subscribing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await subscribing
        kept = await engine.subscribe_kv_events()  # after the 5 registrations ran
        subscribed = len(engine._kv_feeds)
        kept.close()
        return subscribed

    try:
        assert asyncio.run(main()) == 1
    finally:
        engine.shutdown()
