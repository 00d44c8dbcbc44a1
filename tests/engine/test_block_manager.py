import os
import subprocess
import sys

import pytest

import engine.block_manager as block_manager_module
from engine.block_hash import CacheSalt, hash_block, hash_full_blocks
from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def managers_fixture(build):
    """A fixture factory: `build(**options)` makes a block manager; at teardown each one made must
    hold nothing, have every usable block free and pass check_integrity()."""
    created = []

    def factory(**options):
        bm = build(**options)
        created.append(bm)
        return bm

    yield factory
    for bm in created:
        bm.check_integrity()
        assert bm.holder_ids() == [], "a test left blocks held"
        assert bm.num_free_blocks == bm.num_blocks - bm.num_reserved


@pytest.fixture
def make_bm():
    yield from managers_fixture(lambda num_blocks=16, enable_prefix_caching=True:
                                BlockManager(num_blocks, BS, enable_prefix_caching))


def req(request_id, tokens, salt=None):
    return Request(request_id, list(tokens), SamplingParams(), cache_salt=salt)


def compute(bm, request, num_tokens=None):
    """Allocate and 'compute' the request's tokens (as the scheduler does after a step)."""
    num_tokens = request.num_tokens if num_tokens is None else num_tokens
    assert bm.allocate_slots(request, num_tokens)
    request.num_computed_tokens = num_tokens
    bm.cache_computed_blocks(request)


def admit(bm, request):
    """Prefix lookup + allocation for the whole request, like the scheduler's admission."""
    blocks, num_cached = bm.find_cached_prefix(request)
    assert bm.allocate_slots(request, request.num_tokens, blocks)
    request.num_computed_tokens = num_cached
    return blocks, num_cached


# ---- block hashes ----------------------------------------------------------------------------

def test_block_hash_is_chained_salted_and_stable_across_processes():
    tokens = list(range(100, 112))
    hashes = hash_full_blocks(tokens + [1, 2], BS)  # trailing partial block gets no hash
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    assert hash_full_blocks(tokens, BS, start_block=1, parent=hashes[0]) == hashes[1:]
    assert hash_block(None, tokens[:4], "salt-a") != hash_block(None, tokens[:4], "salt-b") != hashes[0]
    assert hash_block(hashes[0], tokens[:4]) != hash_block(None, tokens[:4])
    assert hash_block(None, tokens[:4], algorithm="xxh3_128") != hashes[0]
    assert len(hash_block(None, tokens[:4], algorithm="xxh3_128")) == 16
    code = "from engine.block_hash import hash_full_blocks; print(hash_full_blocks(list(range(100, 112)), 4)[-1].hex())"
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, cwd=os.getcwd())
        assert out.stdout.strip() == hashes[-1].hex()


def test_block_hash_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown block hash algorithm"):
        hash_block(None, [1], algorithm="md5")
    with pytest.raises(ValueError, match="token ids must be integers"):
        hash_block(None, [-1])
    with pytest.raises(ValueError, match="unknown block hash algorithm"):
        BlockManager(4, BS, hash_algorithm="crc")


# ---- allocation --------------------------------------------------------------------------------

def test_allocate_is_all_or_nothing_and_free_returns_blocks(make_bm):
    bm = make_bm(num_blocks=4)
    a, b = req("a", range(10)), req("b", range(10))
    assert bm.allocate_slots(a, 10)  # 3 blocks
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 1
    assert not bm.allocate_slots(b, 10)
    assert b.block_ids == [] and bm.num_free_blocks == 1
    assert bm.allocate_slots(a, 12) and len(a.block_ids) == 3  # still fits in 3 blocks
    assert bm.allocate_slots(a, 13) and len(a.block_ids) == 4 and bm.num_free_blocks == 0
    bm.check_integrity()
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 4


def test_check_integrity_names_the_broken_invariant(make_bm):
    bm = make_bm(num_blocks=4)
    a = req("a", range(8))
    compute(bm, a)
    bm._ref_counts[a.block_ids[0]] += 1
    with pytest.raises(AssertionError, match="ref count 2 but 1 holders"):
        bm.check_integrity()
    bm._ref_counts[a.block_ids[0]] -= 1
    bm._free[a.block_ids[1]] = None
    with pytest.raises(AssertionError, match="in the free list"):
        bm.check_integrity()
    del bm._free[a.block_ids[1]]
    stolen_hash = bm._block_hash[a.block_ids[0]]
    bm._cached[stolen_hash] = a.block_ids[1]
    with pytest.raises(AssertionError, match="maps elsewhere"):
        bm.check_integrity()
    bm._cached[stolen_hash] = a.block_ids[0]
    bm.check_integrity()
    bm.free(a)


# ---- prefix cache ------------------------------------------------------------------------------

def test_prefix_hit_shares_blocks_and_is_capped_below_the_last_token(make_bm):
    bm = make_bm()
    a = req("a", range(12))
    compute(bm, a)
    assert bm.num_cached_blocks == 3
    b = req("b", list(range(12)) + [99])  # 3 full shared blocks, then its own token
    blocks, num_cached = admit(bm, b)
    assert blocks == a.block_ids and num_cached == 12
    assert all(bm.ref_count(block) == 2 for block in a.block_ids)
    c = req("c", range(12))  # identical prompt: the last token must be computed, so 2 blocks only
    blocks, num_cached = admit(bm, c)
    assert blocks == a.block_ids[:2] and num_cached == 8
    d = req("d", list(range(6)) + [7, 7, 7, 7, 7])  # diverges inside block 1
    assert bm.find_cached_prefix(d) == (a.block_ids[:1], 4)
    for r in (a, b, c):
        bm.free(r)


def test_salt_separates_caches_and_disabled_caching_finds_nothing(make_bm):
    bm = make_bm()
    a = req("a", range(12), salt="tenant-1")
    compute(bm, a)
    assert bm.find_cached_prefix(req("b", range(12), salt="tenant-2")) == ([], 0)
    assert bm.find_cached_prefix(req("c", range(12)))[1] == 0
    assert bm.find_cached_prefix(req("d", range(12), salt="tenant-1"))[1] == 8
    bm.free(a)

    off = make_bm(enable_prefix_caching=False)
    e = req("e", range(12))
    compute(off, e)
    assert off.num_cached_blocks == 0
    off.free(e)
    assert off.find_cached_prefix(req("f", range(12))) == ([], 0)


def test_a_shared_salt_shares_the_shared_prefix_blocks_only(make_bm):
    """Two tenants that opt into one shared salt for their first 9 tokens: the 2 blocks wholly
    inside it are shared, the third (partly shared, partly their own) and on are not."""
    tenant = {name: CacheSalt(name, "org", 9) for name in ("t1", "t2")}
    assert [tenant["t1"].of_block(i, BS) for i in range(4)] == ["org", "org", "t1", "t1"]
    shared = hash_full_blocks(range(16), BS, "org")[:2]
    assert hash_full_blocks(range(16), BS, tenant["t1"])[:2] == shared
    assert hash_full_blocks(range(16), BS, tenant["t1"])[2:] != hash_full_blocks(range(16), BS, tenant["t2"])[2:]
    bm = make_bm()
    a = req("a", range(16), salt=tenant["t1"])
    compute(bm, a)
    assert bm.find_cached_prefix(req("b", range(16), salt=tenant["t2"]))[1] == 8
    assert bm.find_cached_prefix(req("c", range(16), salt=tenant["t1"]))[1] == 12  # (the last block is left to compute)
    assert bm.find_cached_prefix(req("d", range(16), salt="t2"))[1] == 0  # not opted in: nothing shared
    bm.free(a)
    with pytest.raises(ValueError, match="shared salt"):
        CacheSalt("t1", None, 4)


def test_only_computed_full_blocks_are_cached_including_decoded_ones(make_bm):
    bm = make_bm()
    a = req("a", range(6))
    assert bm.allocate_slots(a, 6)
    a.num_computed_tokens = 3
    bm.cache_computed_blocks(a)
    assert bm.num_cached_blocks == 0
    a.num_computed_tokens = 6
    bm.cache_computed_blocks(a)
    assert bm.num_cached_blocks == 1  # block 1 holds 2 tokens: not full
    for token in (50, 51, 52):  # generated tokens fill block 1 and start block 2
        a.append_output(token)
    compute(bm, a)
    assert bm.num_cached_blocks == 2
    follow_up = req("b", [0, 1, 2, 3, 4, 5, 50, 51, 60])
    assert bm.find_cached_prefix(follow_up) == (a.block_ids[:2], 8)
    bm.free(a)


def test_freed_blocks_stay_findable_until_reused_in_lru_order(make_bm):
    bm = make_bm(num_blocks=8)
    scratch = req("scratch", range(4))
    assert bm.allocate_slots(scratch, 4)  # never computed: its block gets no hash
    a, b = req("a", range(100, 112)), req("b", range(200, 208))
    compute(bm, a)
    compute(bm, b)
    assert (scratch.block_ids, a.block_ids, b.block_ids) == ([0], [1, 2, 3], [4, 5])
    bm.free(a)
    bm.free(b)
    bm.free(scratch)
    # Hashless blocks first, then never-used ones, then a's blocks tail first, then b's (freed later).
    assert bm.free_block_order() == [0, 6, 7, 3, 2, 1, 5, 4]
    assert bm.find_cached_prefix(req("a2", list(range(100, 112)) + [1])) == ([1, 2, 3], 12)

    hit = req("hit", list(range(200, 208)) + [1])
    assert admit(bm, hit) == ([4, 5], 8)  # cached-free blocks leave the free list
    assert hit.block_ids == [4, 5, 0] and bm.free_block_order() == [6, 7, 3, 2, 1]
    filler = req("filler", range(500, 516))
    assert bm.allocate_slots(filler, 16)
    assert filler.block_ids == [6, 7, 3, 2] and bm.free_block_order() == [1]
    assert bm.find_cached_prefix(req("a3", list(range(100, 112)) + [1])) == ([1], 4)
    assert bm.num_cached_blocks == 3
    for r in (hit, filler):
        bm.free(r)


def test_lru_eviction_order_is_exact(make_bm):
    bm = make_bm(num_blocks=6)
    a, b = req("a", range(100, 108)), req("b", range(200, 212))
    compute(bm, a)  # blocks 0, 1
    compute(bm, b)  # blocks 2, 3, 4
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3, 4])
    bm.free(b)
    bm.free(a)
    assert bm.free_block_order() == [5, 4, 3, 2, 1, 0]
    evicted_by = req("x", range(900, 916))
    assert bm.allocate_slots(evicted_by, 16)
    assert evicted_by.block_ids == [5, 4, 3, 2]
    assert bm.find_cached_prefix(req("b2", list(range(200, 212)) + [1])) == ([], 0)
    assert bm.find_cached_prefix(req("a2", list(range(100, 108)) + [1])) == ([0, 1], 8)
    bm.free(evicted_by)


def test_hash_collision_with_other_tokens_is_a_miss(make_bm, monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent, tokens, extra, algo: b"same")
    bm = make_bm()
    a = req("a", range(100, 112))
    compute(bm, a)
    assert bm.num_cached_blocks == 1  # every block "hashes" alike: only the first is registered
    assert bm.find_cached_prefix(req("b", range(200, 212))) == ([], 0)
    assert bm.find_cached_prefix(req("c", list(range(100, 104)) + list(range(300, 309)))) == (a.block_ids[:1], 4)
    bm.free(a)


def test_hash_collision_with_equal_tokens_but_another_prefix_is_a_miss(make_bm, monkeypatch):
    # A hash that ignores the parent: block 1 of [x, y] and of [z, y] collide.
    monkeypatch.setattr(block_manager_module, "hash_block",
                        lambda parent, tokens, extra, algo: bytes(str(tuple(tokens)), "ascii"))
    bm = make_bm()
    x, y, z = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    first = req("first", x + y)
    compute(bm, first)
    second = req("second", z + y)
    compute(bm, second)  # its block 1 collides with first's and stays private
    assert bm.num_cached_blocks == 3
    assert bm.find_cached_prefix(req("probe", z + y + [9])) == (second.block_ids[:1], 4)
    bm.free(first)
    bm.free(second)


def test_request_hashes_equal_what_the_router_computes(make_bm):
    bm = make_bm()
    tokens = list(range(300, 318))
    a = req("a", tokens, salt="s")
    compute(bm, a)
    assert a.block_hashes == hash_full_blocks(tokens, BS, extra_key="s")
    bm.free(a)


def test_reset_prefix_cache_forgets_only_evictable_blocks(make_bm):
    bm = make_bm(num_blocks=8)
    kept, dropped = req("kept", range(8)), req("dropped", range(100, 108))
    compute(bm, kept)
    compute(bm, dropped)
    bm.free(dropped)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 2 and bm.free_block_order()[:2] == [2, 3]
    assert bm.find_cached_prefix(req("probe", list(range(100, 108)) + [1])) == ([], 0)
    assert bm.find_cached_prefix(req("probe2", list(range(8)) + [1])) == ([0, 1], 8)
    bm.free(kept)
