"""Routing policies (unit, on WorkerInfo objects) and routing through a real router (prefill
affinity among two prefill workers, load spreading, colocated workers, pool membership)."""
import asyncio

import httpx
import pytest

from engine.block_hash import hash_full_blocks
from router.config import RouterConfig
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.kv_index import KVIndex, Match
from router.policies import Choice, PowerOfTwoDecode, PrefixAffinityPrefill, RoundRobin, prefill_locally
from router.pool import WorkerInfo, WorkerPool
from tests.helpers import wait_until
from tests.router.harness import reply_script
import wire
from wire.stats import WorkerStats


def hashes(tokens, block_size=4):
    return hash_full_blocks(tokens, block_size)


def workers(role, count):
    return [WorkerInfo(role=role, address=f"10.0.0.{i}:5000", healthy=True) for i in range(count)]


# ---- unit: policies ---------------------------------------------------------------------------

def test_routed_blocks_match_the_leading_run_and_the_oldest_are_forgotten():
    """A worker without KV events: the index holds what was routed there (bounded)."""
    index = KVIndex(pending_ttl_s=10.0, pending_capacity_blocks=4)
    a = hashes(list(range(16)))  # 4 blocks
    index.note_routed("w", a)
    assert index.match("w", a) == Match(4, 0)
    assert index.match("w", hashes(list(range(8)) + [99] * 8)).blocks == 2
    assert index.match("w", hashes([99] + list(range(1, 16)))).blocks == 0  # chained: a first-block miss ends it
    assert index.match("other", a).blocks == 0
    index.note_routed("w", hashes([50] * 8))  # 2 new blocks push out the 2 oldest
    assert index.size("pending") == 4
    assert index.match("w", a).blocks == 0
    index.forget("w")
    assert index.size("pending") == 0
    with pytest.raises(ValueError, match="pending_capacity_blocks"):
        KVIndex(pending_ttl_s=10.0, pending_capacity_blocks=0)


def stored(block_hashes, tier="device"):
    return BlockStored(tuple(block_hashes), None, (), 4, tier)


def test_events_make_the_index_exact_per_tier():
    """Reported blocks by tier; a device run then a host run (what the worker's lookup finds);
    removals, a snapshot replacing the state, and routed blocks that count only until their TTL
    while the worker's events flow."""
    now = [0.0]
    index = KVIndex(pending_ttl_s=5.0, pending_capacity_blocks=1024, clock=lambda: now[0])
    prompt = hashes(list(range(24)))  # 6 blocks
    index.apply("w", KVEventBatch(1, 0.0, [AllBlocksCleared(), stored(prompt[:2]), stored(prompt[2:5], "host")],
                                  snapshot=True))
    assert index.followed("w") and index.match("w", prompt) == Match(2, 3)
    index.apply("w", KVEventBatch(2, 0.0, [stored(prompt[2:4])]))  # reloaded: now on the device too
    assert index.match("w", prompt) == Match(4, 1)
    index.apply("w", KVEventBatch(3, 0.0, [BlockRemoved((prompt[1],), "device", "evicted")]))
    assert index.match("w", prompt) == Match(1, 0)  # the device run stops at block 1; host holds 2..4 only
    assert index.match("w", prompt[:1] + prompt[1:]) == Match(1, 0)
    index.apply("w", KVEventBatch(4, 0.0, [BlockRemoved(tuple(prompt[2:5]), "host", "evicted")]))
    assert (index.size("device"), index.size("host")) == (3, 0)
    other = hashes([7] * 12)
    index.note_routed("w", other)  # routed, not yet reported: counts for 5 s
    assert index.match("w", other) == Match(3, 0)
    now[0] = 6.0
    assert index.match("w", other) == Match(0, 0)
    index.note_routed("w", other)
    index.apply("w", KVEventBatch(5, 0.0, [stored(other)]))  # the report replaces the routed entries
    assert index.size("pending") == 0 and index.match("w", other) == Match(3, 0)
    index.apply("w", KVEventBatch(5, 0.0, [AllBlocksCleared(), stored(prompt[:1], "host")], snapshot=True))
    assert index.match("w", other) == Match(0, 0) and index.match("w", prompt) == Match(0, 1)
    index.unfollow("w")  # the stream broke: nothing reported counts until the next snapshot
    assert not index.followed("w") and index.match("w", prompt) == Match(0, 0)


def test_routed_blocks_expire_while_a_publishing_workers_stream_reconnects():
    """A worker that publishes events and whose stream broke (it restarted with an empty cache,
    or its stream overflowed): what was routed there still expires after the TTL; the expired
    entries also leave the pending count without another request routed there."""
    now = [0.0]
    index = KVIndex(pending_ttl_s=5.0, pending_capacity_blocks=1024, clock=lambda: now[0])
    index.apply("w", KVEventBatch(1, 0.0, [AllBlocksCleared()], snapshot=True))
    routed = hashes(list(range(32)))  # 8 blocks
    index.note_routed("w", routed)
    index.unfollow("w")
    assert index.match("w", routed) == Match(8, 0)  # within the TTL: a burst still lands together
    now[0] = 100.0
    assert index.match("w", routed) == Match(0, 0)
    index.note_routed("w", routed)
    now[0] = 200.0
    assert index.size("pending") == 0


def test_a_host_tier_hit_attracts_the_prefill_weighted_by_its_reload_cost():
    index = KVIndex(pending_ttl_s=10.0, pending_capacity_blocks=1024)
    policy = PrefixAffinityPrefill(RouterConfig(block_size=4, host_hit_cost=0.25), index)
    p0, p1 = workers("prefill", 2)
    prompt = hashes(list(range(32)))  # 8 blocks
    index.apply(p0.address, KVEventBatch(1, 0.0, [stored(prompt[:5])], snapshot=True))
    index.apply(p1.address, KVEventBatch(1, 0.0, [stored(prompt[:2]), stored(prompt[2:8], "host")], snapshot=True))
    choice = policy.choose([p0, p1], prompt)  # 2 + 0.75 * 6 = 6.5 beats 5
    assert (choice.worker, choice.reason, choice.match) == (p1, "prefix_affinity", Match(2, 6))
    expensive = PrefixAffinityPrefill(RouterConfig(block_size=4, host_hit_cost=0.6), index)
    assert expensive.choose([p0, p1], prompt).worker is p0  # 2 + 0.4 * 6 = 4.4 < 5


def test_prefix_affinity_prefers_the_longest_cached_prefix():
    policy = PrefixAffinityPrefill(RouterConfig(block_size=4))
    p0, p1 = workers("prefill", 2)
    shared = list(range(40))
    policy.record(p0, hashes(shared[:16]))
    policy.record(p1, hashes(shared[:36]))
    choice = policy.choose([p0, p1], hashes(shared))
    assert (choice.worker, choice.reason, choice.matched_blocks) == (p1, "prefix_affinity", 9)


def test_prefix_affinity_yields_to_load_when_imbalanced():
    policy = PrefixAffinityPrefill(RouterConfig(block_size=4, affinity_max_imbalance_tokens=1000))
    p0, p1 = workers("prefill", 2)
    prompt = list(range(32))
    policy.record(p0, hashes(prompt))
    p0.outstanding_prefill_tokens = 1000
    assert policy.choose([p0, p1], hashes(prompt)).worker is p0  # exactly at the threshold: still affinity
    p0.outstanding_prefill_tokens = 1001
    choice = policy.choose([p0, p1], hashes(prompt))
    assert (choice.worker, choice.reason) == (p1, "load")


def test_prefix_affinity_needs_a_large_enough_share_of_the_prompt():
    policy = PrefixAffinityPrefill(RouterConfig(block_size=4, affinity_min_match_ratio=0.5))
    p0, p1 = workers("prefill", 2)
    system = list(range(8))  # a shared 2-block "system prompt"
    policy.record(p0, hashes(system))
    p0.num_routed = 1
    short_tail = policy.choose([p0, p1], hashes(system + [90, 91, 92, 93]))
    assert (short_tail.worker, short_tail.reason) == (p0, "prefix_affinity")  # 2 of 3 blocks
    long_tail = policy.choose([p0, p1], hashes(system + list(range(100, 124))))
    assert (long_tail.worker, long_tail.reason) == (p1, "load")  # 2 of 8 blocks: load decides


def test_prefill_load_uses_queued_tokens_then_requests_sent():
    policy = PrefixAffinityPrefill(RouterConfig())
    p0, p1, p2 = workers("prefill", 3)
    p0.outstanding_prefill_tokens = 10
    p1.stats = WorkerStats(prefill_tokens_queued=5)  # the worker's own count
    assert policy.choose([p0, p1, p2], []).worker is p2
    p2.outstanding_prefill_tokens = 10
    assert policy.choose([p0, p1, p2], []).worker is p1
    p1.outstanding_prefill_tokens = 10
    p1.stats = WorkerStats()
    p0.num_routed, p1.num_routed, p2.num_routed = 3, 1, 2
    assert policy.choose([p0, p1, p2], []).worker is p1


def Stats(running=0, waiting=0, kv_blocks_total=100, kv_blocks_free=100) -> WorkerStats:
    return WorkerStats(running=running, waiting=waiting, kv_blocks_total=kv_blocks_total,
                       kv_blocks_free=kv_blocks_free)


def test_power_of_two_takes_the_less_loaded_of_two():
    policy = PowerOfTwoDecode(RouterConfig(seed=3))
    d0, d1 = workers("decode", 2)
    d0.stats, d1.stats = Stats(running=5), Stats(running=1)
    assert {policy.choose([d0, d1], []).worker.address for _ in range(20)} == {d1.address}
    d1.stats = Stats(running=1, kv_blocks_free=2)  # short of KV blocks beats fewer requests
    assert policy.choose([d0, d1], []).worker is d0
    d0.inflight_requests = 0
    d0.stats = d1.stats = Stats()
    picked = {policy.choose([d0, d1], []).worker.address for _ in range(50)}
    assert picked == {d0.address, d1.address}  # equal load: both get picked


def test_conversation_affinity_sends_a_follow_up_turn_back():
    policy = PowerOfTwoDecode(RouterConfig(block_size=4, affinity_max_imbalance_requests=2))
    d0, d1, d2 = workers("decode", 3)
    first_turn = list(range(24))
    policy.record(d2, hashes(first_turn + [7, 7, 7, 7]))  # prompt + reply, recorded at the end
    follow_up = first_turn + [7, 7, 7, 7] + [8] * 8
    choice = policy.choose([d0, d1, d2], hashes(follow_up))
    assert (choice.worker, choice.reason, choice.matched_blocks) == (d2, "conversation_affinity", 7)
    d2.inflight_requests = 3  # 3 more than the least loaded (> 2): load wins
    assert policy.choose([d0, d1, d2], hashes(follow_up)).reason == "power_of_two"
    d2.inflight_requests = 0
    d2.stats = Stats(kv_blocks_free=1)
    assert policy.choose([d0, d1, d2], hashes(follow_up)).worker is not d2


def test_prefill_locally_weighs_the_prefill_wait_against_the_decode_batch():
    (d,), (p,) = workers("decode", 1), workers("prefill", 1)
    local = lambda n, weight=8.0, d_matched=0, p_matched=0: prefill_locally(  # noqa: E731
        Choice(d, "power_of_two", Match(d_matched)), Choice(p, "load", Match(p_matched)), n, 16, weight)
    assert not local(256)  # both idle: disaggregate
    p.outstanding_prefill_tokens = 1024  # a long prompt ahead on the prefill worker
    assert local(90)  # an idle decode worker takes a short prompt rather than let it queue
    assert local(1024)  # a long one too: the prefill worker is a whole prompt behind
    d.inflight_requests = 1  # one stream running there: 90 + 8 * 90 < 1024 + 90...
    assert local(90)
    d.inflight_requests = 2  # ...two make the stall dearer than the wait
    assert not local(90) and local(90, weight=2.0)
    assert not local(90, weight=float("inf"))
    d.stats = WorkerStats(running=2)  # the worker's own count (other routers' streams) counts too
    d.inflight_requests = 0
    assert not local(90)
    d.stats = WorkerStats()
    p.stats = WorkerStats(prefill_chunk_tokens=512)  # chunks: a newcomer waits for one, not the whole prompt
    d.inflight_requests = 1
    assert not local(90)  # 90 + 720 > 512 + 90
    d.inflight_requests = 0
    assert local(90)  # 90 < 512 + 90
    d.outstanding_prefill_tokens = 600  # the decode worker's own queue is its wait
    assert not local(90)
    p.outstanding_prefill_tokens, p.stats, d.outstanding_prefill_tokens = 0, WorkerStats(), 0
    assert local(256, d_matched=8)  # the decode worker holds half the prompt (a second turn), no stream runs
    assert not local(256, d_matched=8, p_matched=8)


def test_a_local_prefill_counts_on_the_decode_workers_queue():
    pool = WorkerPool(RouterConfig(decode=["127.0.0.1:5001"], prefill=["127.0.0.1:5002"]))
    d, p = pool.get("127.0.0.1:5001"), pool.get("127.0.0.1:5002")
    local, remote = pool.assign(d, None, 300), pool.assign(d, p, 200)
    assert (d.outstanding_prefill_tokens, p.outstanding_prefill_tokens) == (300, 200)
    assert (d.inflight_requests, p.inflight_requests) == (2, 1)
    local.prefill_done()
    remote.release()
    local.release()
    assert (d.outstanding_prefill_tokens, p.outstanding_prefill_tokens) == (0, 0)
    assert (d.inflight_requests, p.inflight_requests) == (0, 0)


def test_a_polled_queue_does_not_count_this_routers_finished_prefills():
    """The worker's queued count is a snapshot: the router's own requests in it are already in its
    outstanding count, and must not keep counting after their prefill is done."""
    class Client:
        queued = 0

        async def health(self, timeout):
            return type("Health", (), {"ok": True, "role": "prefill", "model": "m", "transport_address": ""})()

        async def stats(self, timeout):
            return wire.messages().WorkerStats(role="prefill", prefill_tokens_queued=Client.queued)

    pool = WorkerPool(RouterConfig(decode=["127.0.0.1:5001"], prefill=["127.0.0.1:5002"]),
                      client_factory=lambda address, role: Client())
    d, p = pool.get("127.0.0.1:5001"), pool.get("127.0.0.1:5002")
    first = pool.assign(d, p, 140)
    Client.queued = 140  # the worker reports the router's own request
    asyncio.run(pool.poll_worker(p))
    assert p.prefill_load_tokens == 140  # counted once
    first.release()  # its first token came back; the snapshot still shows it queued
    assert p.prefill_load_tokens == 0
    Client.queued = 140 + 500  # another router's 500 tokens as well
    second = pool.assign(d, p, 140)
    asyncio.run(pool.poll_worker(p))
    assert p.prefill_load_tokens == 640
    second.release()
    assert p.prefill_load_tokens == 500


def test_concurrent_status_requests_share_one_poll():
    """`GET /status` polls every worker: callers arriving during a poll wait for it rather than
    each polling every worker again; a later caller polls afresh."""
    calls = []

    class Client:
        async def health(self, timeout):
            await asyncio.sleep(0.05)
            return type("Health", (), {"ok": True, "role": "decode", "model": "m", "transport_address": ""})()

        async def stats(self, timeout):
            calls.append(timeout)
            return wire.messages().WorkerStats(role="decode")

    pool = WorkerPool(RouterConfig(decode=["127.0.0.1:5001", "127.0.0.1:5003"]),
                      client_factory=lambda address, role: Client())

    async def main():
        await asyncio.gather(*(pool.poll_all_shared() for _ in range(10)))
        assert len(calls) == 2  # one poll of each worker
        assert all(w.healthy for w in pool.workers())
        await pool.poll_all_shared()
        assert len(calls) == 4

    asyncio.run(main())


def test_round_robin_cycles_in_address_order():
    policy = RoundRobin()
    ws = workers("decode", 3)
    assert [policy.choose(list(reversed(ws)), []).worker for _ in range(6)] == ws + ws


def test_pool_membership_changes():
    config = RouterConfig(prefill=["127.0.0.1:7001"], decode=["127.0.0.1:7002"])
    forgotten = []
    pool = WorkerPool(config, on_removed=forgotten.append)
    assert [w.role for w in pool.workers()] == ["prefill", "decode"]
    assert not pool.ready  # nothing polled yet
    for w in pool.workers():
        w.healthy = True
    assert pool.ready
    added = pool.add_worker("both", "127.0.0.1:7003")
    assert pool.add_worker("both", "127.0.0.1:7003") is added
    with pytest.raises(ValueError, match="already registered as a both worker"):
        pool.add_worker("decode", "127.0.0.1:7003")
    with pytest.raises(ValueError, match="unknown worker role"):
        pool.add_worker("router", "127.0.0.1:7004")
    with pytest.raises(ValueError, match="host:port"):
        pool.add_worker("decode", "localhost")
    decode = pool.get("127.0.0.1:7002")
    assignment = pool.assign(decode, pool.get("127.0.0.1:7001"), 100)
    pool.remove_worker("127.0.0.1:7002")  # drained: stays until its request is done
    assert pool.get("127.0.0.1:7002") is decode and not decode.routable
    assert pool.get("127.0.0.1:7001").outstanding_prefill_tokens == 100
    assignment.release()
    assignment.release()  # idempotent
    assert pool.get("127.0.0.1:7002") is None and forgotten == ["127.0.0.1:7002"]
    assert pool.get("127.0.0.1:7001").outstanding_prefill_tokens == 0
    pool.mark_unhealthy("127.0.0.1:7001", "test")
    assert not pool.ready and pool.get("127.0.0.1:7001").last_error == "test"
    with pytest.raises(ValueError, match="no worker with address"):
        pool.drain_worker("127.0.0.1:9999")


def test_config_validation():
    with pytest.raises(ValueError, match="listed more than once"):
        RouterConfig(prefill=["127.0.0.1:1"], decode=["127.0.0.1:1"])
    with pytest.raises(ValueError, match="host:port"):
        RouterConfig(decode=["127.0.0.1"])
    with pytest.raises(ValueError, match="unknown prefill policy"):
        RouterConfig(prefill_policy="random")
    with pytest.raises(ValueError, match="api_key must be non-empty"):
        RouterConfig(api_key="")
    with pytest.raises(ValueError, match="affinity_min_match_ratio"):
        RouterConfig(affinity_min_match_ratio=1.5)
    with pytest.raises(ValueError, match="local_prefill_weight must be >= 0"):
        RouterConfig(local_prefill_weight=-1.0)
    assert RouterConfig(local_prefill_weight=float("inf")).local_prefill_weight == float("inf")
    assert RouterConfig(model="m").served_model_name == "m"
    assert RouterConfig().host == "127.0.0.1"


# ---- through the router -----------------------------------------------------------------------

SHARED = ("You are reviewing the following document. It is long, and every question about it "
          "shares it as a prefix, which is what prefix affinity is for. " * 3)


def test_shared_prefix_goes_to_the_same_prefill_worker(router, decode, prefills, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    for question in ["What is it about?", "Who wrote it?", "Summarize.", "Is it long?", "Why?"]:
        r = httpx.post(router.url + "/v1/completions",
                       json={"model": "tiny", "prompt": SHARED + question, "max_tokens": 4})
        assert r.status_code == 200
    used = {request.prefill_address for request in decode.requests}
    assert len(used) == 1 and used <= {p.address for p in prefills}
    metrics = httpx.get(router.url + "/metrics").text
    assert 'pdserve:routing_decisions_total{reason="prefix_affinity",role="prefill"} 4.0' in metrics


def test_load_spreads_when_prefixes_differ(router, decode, prefills, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    prompts = [f"Story number {i}: " + "a dog, a cat and a fox went to town. " * (i + 1) for i in range(6)]
    for prompt in prompts:
        assert httpx.post(router.url + "/v1/completions",
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 2}).status_code == 200
    counts = {p.address: 0 for p in prefills}
    for request in decode.requests:
        counts[request.prefill_address] += 1
    assert sorted(counts.values()) == [3, 3]


def test_busy_prefill_worker_is_avoided_for_new_prefixes(make_router, decode, prefills, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    prefills[0].queued_tokens = 50_000  # reported through Stats
    router = make_router(decode=[decode.address], prefill=[p.address for p in prefills])
    for i in range(3):
        httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": f"{i} fresh", "max_tokens": 2})
    assert {r.prefill_address for r in decode.requests} == {prefills[1].address}


def test_decode_worker_prefills_locally_when_the_prefill_pool_is_backed_up(make_router, decode, prefills,
                                                                           tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    for prefill in prefills:
        prefill.queued_tokens = 50_000  # reported through Stats
    router = make_router(decode=[decode.address], prefill=[p.address for p in prefills])
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "a fresh prompt", "max_tokens": 2})
    assert r.status_code == 200
    assert decode.requests[-1].prefill_address == ""  # no prefill worker named: the decode worker prefills
    metrics = httpx.get(router.url + "/metrics").text
    assert 'pdserve:routing_decisions_total{reason="local_queue",role="prefill"} 1.0' in metrics
    for prefill in prefills:
        prefill.queued_tokens = 0
    wait_until(lambda: all(router.state.pool.get(p.address).stats.prefill_tokens_queued == 0 for p in prefills),
               timeout=30, what="the prefill workers' queues to drain")
    httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "another prompt", "max_tokens": 2})
    assert decode.requests[-1].prefill_address in {p.address for p in prefills}


def test_colocated_worker_prefills_locally(make_router, decode, prefills, tokenizer):
    decode.role = "both"
    decode.script = reply_script(tokenizer, "ok")
    router = make_router(colocated=[decode.address], prefill=[prefills[0].address])
    r = httpx.post(router.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    assert decode.requests[-1].prefill_address == ""


def test_unhealthy_prefill_worker_is_skipped_and_comes_back(router, decode, prefills, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    prefills[0].ok = False
    wait_until(lambda: not router.state.pool.get(prefills[0].address).healthy, timeout=30, what="worker 0 unhealthy")
    for i in range(4):
        httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": f"{i} other", "max_tokens": 2})
    assert {r.prefill_address for r in decode.requests} == {prefills[1].address}
    status = httpx.get(router.url + "/status").json()
    by_address = {w["address"]: w for w in status["workers"]}
    assert by_address[prefills[0].address]["healthy"] is False
    assert "not ok" in by_address[prefills[0].address]["last_error"]
    prefills[0].ok = True
    wait_until(lambda: router.state.pool.get(prefills[0].address).healthy, timeout=30, what="worker 0 healthy again")


def test_worker_added_at_run_time_gets_traffic(make_router, loop, decode, prefills, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    router = make_router(decode=[decode.address], prefill=[prefills[0].address], prefill_policy="round_robin")
    loop.run(_add(router.state.pool, "prefill", prefills[1].address))
    wait_until(lambda: router.state.pool.get(prefills[1].address).healthy, timeout=30,
               what="the new worker to be polled")
    for i in range(4):
        httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": f"{i}", "max_tokens": 2})
    assert {r.prefill_address for r in decode.requests} == {p.address for p in prefills}
    loop.run(_remove(router.state.pool, prefills[1].address))
    assert router.state.pool.get(prefills[1].address) is None


async def _add(pool, role, address):
    pool.add_worker(role, address)


async def _remove(pool, address):
    pool.remove_worker(address)


def test_a_sequences_hashes_continue_from_its_prompts(make_router, decode):
    """The hashes of prompt + output, recorded for conversation affinity as a request ends, are
    the prompt's (computed at admission) and the output blocks' only, and equal a full rehash."""
    dispatcher = make_router(decode=[decode.address]).state.dispatcher
    block = dispatcher.pool.block_size()
    prompt, output = list(range(5 * block + 3)), list(range(1000, 1000 + 4 * block))
    for salt in (None, "tenant-a"):
        known = dispatcher.block_hashes(prompt, salt)
        continued = dispatcher.block_hashes(prompt + output, salt, known)
        assert continued == dispatcher.block_hashes(prompt + output, salt) and len(continued) == 9
    # the known hashes are taken as they are, not recomputed: only the blocks after them are hashed
    sentinel = [b"k" * 32] * 5
    assert dispatcher.block_hashes(prompt + output, None, sentinel)[:5] == sentinel
