"""The grouped KV cache's layer groups (engine/kv_groups.py) and its block manager
(engine/block_groups.py): a sliding group gives back the blocks behind its window, prefix hits
need what each group still reads, and the invariants of check_integrity() hold throughout."""
from __future__ import annotations

import pytest

from engine.block_groups import GroupedBlockManager
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.kv_groups import NULL_BLOCK, KVGroups, kv_groups_for
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.test_block_manager import managers_fixture

BS = 4
WINDOW = 8  # two blocks: the token at position p reads p-7 .. p
GROUPS = KVGroups.from_windows([WINDOW, 0, WINDOW, 0])  # two groups of two layers


def gemma3_270m_windows() -> list[int]:
    return [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]


def test_gemma3_270m_splits_into_five_sliding_groups_and_one_full_of_three_layers():
    groups = KVGroups.from_windows(gemma3_270m_windows())
    assert groups.windows == (512,) * 5 + (0,)
    assert groups.num_slots == 3 and groups.grouped
    assert [groups.layer_group[i] for i in (5, 11, 17)] == [5, 5, 5]
    assert [groups.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    # each (group, slot) holds exactly one layer
    assert len({(g, s) for g, s in zip(groups.layer_group, groups.layer_slot)}) == 18
    assert groups.describe() == "5 group(s) of 3 layers with a 512-token window, 1 group(s) of 3 layers with full attention"


def test_layouts_uniform_where_nothing_slides_or_a_feature_needs_it_and_grouped_refused_naming_it():
    assert kv_groups_for((), 4, "auto", []) == KVGroups.uniform(4)
    assert kv_groups_for([WINDOW, 0, WINDOW, 0], 4, "uniform", []) == KVGroups.uniform(4)
    assert kv_groups_for([WINDOW, 0, WINDOW, 0], 4, "auto", []) == GROUPS
    assert kv_groups_for([WINDOW, 0, WINDOW, 0], 4, "auto", ["host_cache_gb"]) == KVGroups.uniform(4)
    with pytest.raises(ValueError, match="does not work with host_cache_gb, tensor parallelism yet"):
        kv_groups_for([WINDOW, 0, WINDOW, 0], 4, "grouped", ["host_cache_gb", "tensor parallelism"])
    with pytest.raises(ValueError, match="kv_layout must be one of auto, grouped, uniform"):
        kv_groups_for((), 4, "hybrid", [])
    assert KVGroups.from_windows([WINDOW] * 3).windows == (WINDOW,)  # a window on every layer: one group


@pytest.fixture
def make_bm():
    """Grouped managers, checked at teardown (every block but the null one free)."""
    yield from managers_fixture(lambda num_blocks=32, groups=GROUPS, enable_prefix_caching=True:
                                GroupedBlockManager(num_blocks, BS, groups, enable_prefix_caching))


def req(request_id, tokens):
    return Request(request_id, list(tokens), SamplingParams())


def step(bm, request, num_tokens):
    """Allocate and compute up to `num_tokens`, as the scheduler does."""
    assert bm.allocate_slots(request, num_tokens)
    request.num_computed_tokens = num_tokens
    bm.cache_computed_blocks(request)
    bm.check_integrity()


def held(table):
    return [b for b in table if b != NULL_BLOCK]


def test_a_sliding_group_holds_at_most_its_window_while_the_full_group_grows(make_bm):
    bm = make_bm()
    request = req("a", range(100, 140))
    for end in range(1, 41):  # one token per step, like a decode
        step(bm, request, end)
        sliding, full = request.block_tables
        assert len(sliding) == len(full) == -(-end // BS)
        assert len(held(full)) == len(full)
        # the next token (position `end`) reads end-7 .. end: at most three blocks of four
        first = max(0, end - WINDOW + 1) // BS
        assert sliding[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in sliding[first:]
        assert len(held(sliding)) <= 3
    assert bm.num_free_blocks == 31 - 10 - 2  # ten full blocks, the sliding group's last two
    bm.free(request)
    assert request.block_tables == [[], []]


def test_a_long_prompt_takes_new_blocks_only_where_its_chunk_reads(make_bm):
    bm = make_bm()
    request = req("a", range(100, 140))
    step(bm, request, 12)  # a first chunk of 12 tokens: every block of both groups, then
    assert request.block_tables[0][0] == NULL_BLOCK  # position 12 reads 5..12: block 0 given back
    assert bm.new_blocks_for(request, 24) == 3 + 3  # blocks 3-5 of each group
    free = bm.num_free_blocks
    step(bm, request, 24)
    sliding, full = request.block_tables
    assert sliding[:4] == [NULL_BLOCK] * 4 and len(held(sliding)) == 2  # position 24 reads 17..24
    assert bm.num_free_blocks == free - 6 + 3  # six taken, then sliding blocks 1-3 given back
    bm.free(request)


def test_blocks_behind_the_window_stay_cached_and_a_hit_takes_what_each_group_reads(make_bm):
    bm = make_bm()
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    first = req("a", prompt)
    step(bm, first, 21)
    bm.free(first)
    second = req("b", prompt)
    entries, num_tokens = bm.find_cached_prefix(second)
    assert num_tokens == 20
    # the token at position 20 reads 13..20: the sliding group's blocks 3 and 4, null before
    assert [e[0] == NULL_BLOCK for e in entries] == [True, True, True, False, False]
    assert all(e[1] != NULL_BLOCK for e in entries)
    assert bm.allocate_slots(second, 21, entries)
    second.num_computed_tokens = 20
    assert second.block_tables[1][:5] == first_full_blocks(entries)
    bm.check_integrity()
    bm.free(second)


def first_full_blocks(entries):
    return [e[1] for e in entries]


def test_a_hit_shrinks_to_where_the_sliding_group_still_has_its_window(make_bm):
    bm = make_bm(num_blocks=14)  # 13 usable
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    first = req("a", prompt)
    step(bm, first, 21)
    sliding = sliding_ids(bm, prompt, 0, 5)  # each cached, the first three given back already
    full = list(first.block_tables[1])
    bm.free(first)
    # Another request shares the first 13 tokens: a hit of 3 blocks, which takes the sliding
    # group's blocks 1 and 2 back from the free list (the token at position 12 reads 5..12).
    keep = req("keep", prompt[:13])
    entries, num_tokens = bm.find_cached_prefix(keep)
    assert num_tokens == 12 and [e[0] for e in entries] == [NULL_BLOCK, sliding[1], sliding[2]]
    assert bm.allocate_slots(keep, 13, entries)
    # Four new blocks: the unhashed one, then the LRU's first cached ones: the sliding group's
    # blocks 0 (given back first, by the window), 4 and 3 (given back by the free).
    other = req("c", range(500, 508))
    assert bm.allocate_slots(other, 8)
    assert {bm._block_hash[b] for b in (sliding[0], sliding[3], sliding[4])} == {None}
    # The full group still has all five blocks, but position 20 would read the sliding blocks 3
    # and 4, position 16 blocks 2 and 3: the hit is the three blocks whose window is still there.
    entries, num_tokens = bm.find_cached_prefix(req("b", prompt))
    assert num_tokens == 12
    assert [e[0] for e in entries] == [NULL_BLOCK, sliding[1], sliding[2]]
    assert [e[1] for e in entries] == full[:3]
    assert all(bm._block_hash[b] is not None for b in full[3:5])
    bm.free(keep)
    bm.free(other)


def sliding_ids(bm, prompt, start, end):
    """The cached blocks of group 0 for the prompt's blocks start..end-1."""
    request = req("probe", prompt)
    bm._ensure_hashes(request, end)
    return [bm._cached[(0, request.block_hashes[i])] for i in range(start, end)]


def test_allocation_is_all_or_nothing_and_the_null_block_is_never_handed_out(make_bm):
    bm = make_bm(num_blocks=9)  # 8 usable
    request = req("a", range(100, 120))
    assert not bm.allocate_slots(request, 20)  # 5 + 5 blocks
    assert request.block_tables == [[], []] and bm.num_free_blocks == 8
    assert bm.allocate_slots(request, 16)
    assert NULL_BLOCK not in held(request.block_tables[0]) + request.block_tables[1]
    bm.free(request)


def test_free_tail_gives_back_a_rejected_drafts_blocks_in_every_group(make_bm):
    bm = make_bm()
    request = req("a", range(100, 110))
    step(bm, request, 10)
    assert bm.allocate_slots(request, 17)  # a draft of 7 slots: blocks 3 and 4
    assert [len(t) for t in request.block_tables] == [5, 5]
    bm.free_tail(request, 11)
    assert [len(t) for t in request.block_tables] == [3, 3]
    bm.check_integrity()
    bm.free(request)


def test_integrity_check_catches_a_held_null_block(make_bm):
    bm = make_bm()
    request = req("a", range(100, 110))
    step(bm, request, 10)
    bm._ref_counts[NULL_BLOCK] = 1
    with pytest.raises(AssertionError, match="null block"):
        bm.check_integrity()
    bm._ref_counts[NULL_BLOCK] = 0
    bm.free(request)


def test_kv_events_report_the_full_attention_groups_blocks_once_each():
    bm = GroupedBlockManager(9, BS, GROUPS, record_kv_events=True)  # 8 usable
    prompt = list(range(100, 113))  # 3 full blocks
    first = req("a", prompt)
    step(bm, first, 13)
    events = bm.take_kv_events()
    stored = [e.block_hashes[0] for e in events if isinstance(e, BlockStored)]
    assert stored == first.block_hashes[:3] and len(events) == 3  # group 1 (full attention) only
    snapshot = bm.kv_snapshot()
    assert isinstance(snapshot[0], AllBlocksCleared)
    assert [e.block_hashes[0] for e in snapshot[1:]] == first.block_hashes[:3]
    bm.free(first)
    # eight new blocks evict every cached one: removals only for the reported group's three
    other = req("b", range(500, 516))
    assert bm.allocate_slots(other, 16)
    removed = [h for e in bm.take_kv_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(first.block_hashes[:3])
    bm.free(other)
    bm.check_integrity()


def test_an_import_holds_each_groups_window_and_names_one_destination_per_group(make_bm):
    """Decode role: the prompt's KV arrives, computing starts at its end (start=num_tokens)."""
    bm = make_bm()
    prompt = list(range(100, 121))  # 21 tokens, 6 blocks: position 21 reads 14..21, blocks 3-5
    first = req("a", prompt)
    assert bm.allocate_slots(first, 21, start=21)
    sliding, full = first.block_tables
    assert sliding[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in sliding[3:] + full
    groups = bm.destination_groups(first, 0)
    assert [g.layers for g in groups] == [(0, 2), (1, 3)]
    assert [g.block_ids for g in groups] == [tuple(sliding[3:]), tuple(full)]
    first.num_computed_tokens = 21
    bm.cache_computed_blocks(first)  # every block received holds its whole group: all cached
    bm.free(first)
    # the same prompt again: a hit of 5 blocks (the sliding group's 3 and 4 are what position 20
    # reads); only block 5 is left to import, in each group
    again = req("b", prompt)
    entries, num_tokens = bm.find_cached_prefix(again)
    assert num_tokens == 20
    assert bm.allocate_slots(again, 21, entries, start=21)
    assert [g.block_ids for g in bm.destination_groups(again, 5)] == [(again.block_tables[0][5],),
                                                                      (again.block_tables[1][5],)]
    bm.free(again)


def test_a_failed_imports_local_prefill_gets_the_blocks_the_import_left_null(make_bm):
    bm = make_bm()
    request = req("a", range(100, 121))
    assert bm.allocate_slots(request, 21, start=21)  # the import: sliding blocks 0-2 null
    assert bm.new_blocks_for(request, 12) == 3  # computing from 0 again: those three
    assert bm.allocate_slots(request, 12)
    assert NULL_BLOCK not in request.block_tables[0][:3]
    bm.free(request)
