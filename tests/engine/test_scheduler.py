"""Lifecycle tests: the real scheduler and block manager driven by a fake model runner."""
import random

import pytest

import engine.block_manager as block_manager_module
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_hooks import KVCacheFullError
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_types import SampledToken
from tests.engine.fake_runner import FakeConnector, FakeModelRunner, reference_generate, run_until_done, step

BS = 4


@pytest.fixture
def make():
    """Builds (scheduler, runner) pairs (`swap_slots` > 0: swap preemption with that many host
    slots; `host_slots` > 0: a host cache tier that size); after the test, checks integrity,
    aborts what is left and checks that every block and swap slot is free again."""
    created = []

    def factory(num_blocks=64, budget=64, max_seqs=8, max_model_len=256, role="both", connector=None,
                prefix_caching=True, chunked=True, swap_slots=0, host_slots=0, long_chunk=None):
        scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                              enable_chunked_prefill=chunked, long_prefill_chunk_tokens=long_chunk,
                                              preemption_mode="swap" if swap_slots else "recompute"),
                              CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
                              num_blocks, max_model_len, role=role, kv_connector=connector, num_swap_slots=swap_slots,
                              num_host_slots=host_slots)
        created.append(scheduler)
        return scheduler, FakeModelRunner(num_blocks, BS)

    yield factory
    for scheduler in created:
        scheduler.check_integrity()
        for request_id in scheduler.request_ids():
            scheduler.abort(request_id)
        scheduler.check_integrity()
        assert scheduler.request_ids() == [] and not scheduler.has_unfinished()
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
        assert scheduler.stats().swap_slots_free == scheduler.num_swap_slots


def req(request_id, prompt, max_tokens=8, priority=0, arrival=None, eos=(), **params):
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   eos_token_ids=set(eos), priority=priority, arrival_time=arrival)


def prompt_of(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


# ---- admission, outputs, stops ---------------------------------------------------------------

def test_single_request_matches_reference_and_stops_at_max_tokens(make):
    scheduler, runner = make()
    prompt = prompt_of(0, 10)
    request = req("a", prompt, max_tokens=6)
    scheduler.add_request(request)
    assert (scheduler.num_waiting, scheduler.num_running) == (1, 0)
    finals = run_until_done(scheduler, runner)
    assert finals["a"].new_token_ids == reference_generate(prompt, 6) == request.output_token_ids
    assert finals["a"].finish_reason == "length" and request.status is RequestStatus.FINISHED_LENGTH
    assert [b.num_tokens for b in runner.batches] == [10, 1, 1, 1, 1, 1]
    assert request.block_ids == [] and scheduler.get_request("a") is request
    scheduler.schedule()
    assert scheduler.get_request("a") is None


def test_eos_stop_token_ids_ignore_eos_and_max_model_len(make):
    scheduler, runner = make(max_model_len=20)
    prompt = prompt_of(1, 12)
    expected = reference_generate(prompt, 8)
    scheduler.add_request(req("eos", prompt, max_tokens=8, eos={expected[2]}))
    scheduler.add_request(req("ignored", prompt, max_tokens=8, eos={expected[2]}, ignore_eos=True))
    scheduler.add_request(req("stop-id", prompt, max_tokens=8, stop_token_ids=[expected[4]]))
    scheduler.add_request(req("ctx", prompt, max_tokens=100))
    finals = run_until_done(scheduler, runner)
    assert (finals["eos"].new_token_ids, finals["eos"].finish_reason) == (expected[:3], "stop")
    assert (finals["ignored"].new_token_ids, finals["ignored"].finish_reason) == (expected, "length")
    assert (finals["stop-id"].new_token_ids, finals["stop-id"].finish_reason) == (expected[:5], "stop")
    assert (finals["ctx"].new_token_ids, finals["ctx"].finish_reason) == (expected, "length")  # 12 + 8 = 20


def test_generation_is_capped_by_the_whole_kv_cache(make):
    scheduler, runner = make(num_blocks=4, max_model_len=256)  # 16 token slots
    prompt = prompt_of(2, 10)
    scheduler.add_request(req("a", prompt, max_tokens=100))
    finals = run_until_done(scheduler, runner)
    assert finals["a"].new_token_ids == reference_generate(prompt, 6)
    assert finals["a"].finish_reason == "length"


def test_invalid_requests_and_configs_raise_clear_errors(make):
    scheduler, _ = make(num_blocks=4, max_model_len=32)
    with pytest.raises(ValueError, match="the prompt is empty"):
        scheduler.add_request(req("e", []))
    with pytest.raises(ValueError, match="more than max_model_len"):
        scheduler.add_request(req("long", range(33)))
    with pytest.raises(ValueError, match="more than the whole KV cache holds"):
        scheduler.add_request(req("huge", range(17)))
    with pytest.raises(ValueError, match="non-negative integers"):
        scheduler.add_request(req("neg", [1, -2]))
    with pytest.raises(ValueError, match=r"below 2\*\*32"):  # block hashes pack them as uint32
        scheduler.add_request(req("wide", [1, 2 ** 32]))
    scheduler.add_request(req("widest", [2 ** 32 - 1]))  # the largest one is fine
    scheduler.abort("widest")
    scheduler.add_request(req("dup", [1, 2]))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(req("dup", [3]))
    assert scheduler.num_waiting == 1
    with pytest.raises(ValueError, match="role must be"):
        Scheduler(SchedulerConfig(), CacheConfig(), 8, 32, role="mixed")
    with pytest.raises(ValueError, match="needs host swap space"):
        Scheduler(SchedulerConfig(preemption_mode="swap"), CacheConfig(), 8, 32)
    with pytest.raises(ValueError, match="without chunked prefill"):
        Scheduler(SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False), CacheConfig(), 8, 32)
    with pytest.raises(ValueError, match="does not import KV"):
        make(role="prefill")[0].add_imported_request(req("x", [1, 2]))


# ---- token budget, chunked prefill, max_num_seqs ---------------------------------------------

def test_long_prompt_is_chunked_exactly_under_a_small_budget(make):
    scheduler, runner = make(budget=8)
    prompt = prompt_of(3, 21)
    scheduler.add_request(req("a", prompt, max_tokens=3))
    batches = []
    while scheduler.has_unfinished():
        batch, _ = step(scheduler, runner)
        batches.append([(s.start, s.num_new_tokens, s.sample) for s in batch.seqs])
    assert batches == [[(0, 8, False)], [(8, 8, False)], [(16, 5, True)], [(21, 1, True)], [(22, 1, True)]]
    assert scheduler.get_request("a").output_token_ids == reference_generate(prompt, 3)


def test_decodes_go_first_and_prefill_chunks_fill_the_rest(make):
    scheduler, runner = make(budget=8)
    short, long = prompt_of(4, 5), prompt_of(5, 30)
    scheduler.add_request(req("short", short, max_tokens=10))
    step(scheduler, runner)  # short's prompt
    scheduler.add_request(req("long", long, max_tokens=2))
    shapes = []
    for _ in range(5):
        batch, _ = step(scheduler, runner)
        shapes.append([(s.request.request_id, s.num_new_tokens) for s in batch.seqs])
    assert shapes == [[("short", 1), ("long", 7)], [("short", 1), ("long", 7)], [("short", 1), ("long", 7)],
                      [("short", 1), ("long", 7)], [("short", 1), ("long", 2)]]
    finals = run_until_done(scheduler, runner)
    assert finals["short"].new_token_ids[-1] == reference_generate(short, 10)[-1]
    assert scheduler.stats().prompt_tokens_computed == 35


def test_budget_and_max_num_seqs_hold_every_step_with_continuous_admission(make):
    scheduler, runner = make(num_blocks=256, budget=16, max_seqs=3)
    prompts = {f"r{i}": prompt_of(10 + i, 3 + 7 * i) for i in range(8)}
    max_tokens = {f"r{i}": 2 + i for i in range(8)}
    for request_id, prompt in prompts.items():
        scheduler.add_request(req(request_id, prompt, max_tokens=max_tokens[request_id]))
    running_counts = []
    finals = {}
    while scheduler.has_unfinished():
        batch, outputs = step(scheduler, runner)  # step() asserts budget, cap and decode-first order
        running_counts.append(scheduler.num_running)
        finals.update({o.request_id: o for o in outputs if o.finished})
    assert max(running_counts) == 3 and len(finals) == 8
    assert all(b.num_tokens <= 16 for b in runner.batches)
    assert max(len(b.seqs) for b in runner.batches) == 3


def test_continuous_batching_outputs_match_reference(make):
    scheduler, runner = make(num_blocks=256, budget=16, max_seqs=3)
    prompts = {f"r{i}": prompt_of(20 + i, 3 + 7 * i) for i in range(6)}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        scheduler.add_request(req(request_id, prompt, max_tokens=5 + i))
    finals = run_until_done(scheduler, runner)
    for i, (request_id, prompt) in enumerate(prompts.items()):
        assert finals[request_id].new_token_ids == reference_generate(prompt, 5 + i)


def test_chunked_prefill_disabled_runs_whole_prompts(make):
    scheduler, runner = make(budget=32, max_model_len=32, chunked=False)
    scheduler.add_request(req("a", prompt_of(6, 5), max_tokens=2))
    scheduler.add_request(req("b", prompt_of(7, 32), max_tokens=2))
    shapes = []
    while scheduler.has_unfinished():
        batch, _ = step(scheduler, runner)
        shapes.append([(s.request.request_id, s.num_new_tokens) for s in batch.seqs])
    assert shapes == [[("a", 5)], [("a", 1)], [("b", 32)]]  # b never fits beside a; at 32 tokens it is done


# ---- preemption ------------------------------------------------------------------------------

def test_preemption_when_blocks_run_out_resumes_with_identical_output(make):
    prompts = {f"r{i}": prompt_of(30 + i, 9 + 3 * i) for i in range(5)}

    def run(num_blocks):
        scheduler, runner = make(num_blocks=num_blocks, budget=32, max_seqs=5)
        for request_id, prompt in prompts.items():
            scheduler.add_request(req(request_id, prompt, max_tokens=20))
        return scheduler, run_until_done(scheduler, runner), runner

    big, unconstrained, _ = run(256)
    assert big.stats().num_preemptions == 0
    small, constrained, runner = run(16)
    stats = small.stats()
    assert stats.num_preemptions > 0 and any(b.preempted_ids for b in runner.batches)
    for request_id, prompt in prompts.items():
        assert constrained[request_id].new_token_ids == unconstrained[request_id].new_token_ids
        assert constrained[request_id].new_token_ids == reference_generate(prompt, 20)
    assert stats.decode_tokens > big.stats().decode_tokens  # recomputed outputs count as decode positions


def test_preemption_victim_is_least_important_then_latest_and_requeues_in_front(make):
    scheduler, runner = make(num_blocks=6, budget=64, max_seqs=4)
    scheduler.add_request(req("important-late", prompt_of(40, 7), max_tokens=20, priority=0, arrival=3.0))
    scheduler.add_request(req("normal-early", prompt_of(41, 7), max_tokens=20, priority=1, arrival=1.0))
    scheduler.add_request(req("normal-late", prompt_of(42, 7), max_tokens=20, priority=1, arrival=2.0))
    batch, _ = step(scheduler, runner)
    assert [s.request.request_id for s in batch.seqs] == ["important-late", "normal-early", "normal-late"]
    preempted = []
    while not preempted:
        batch, _ = step(scheduler, runner)
        preempted = batch.preempted_ids
    assert preempted == ["normal-late"]
    assert "normal-late" not in [s.request.request_id for s in batch.seqs]
    victim = scheduler.get_request("normal-late")
    assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1 and victim.block_ids == [] and len(victim.output_token_ids) == 2
    scheduler.add_request(req("newcomer", prompt_of(43, 3), max_tokens=2, priority=1, arrival=0.5 + 2.0))
    assert [r.request_id for r in scheduler.waiting] == ["normal-late", "newcomer"]
    requests = {r.request_id: r for r in scheduler.running + scheduler.waiting}
    run_until_done(scheduler, runner)
    for request_id, seed in (("important-late", 40), ("normal-early", 41), ("normal-late", 42)):
        assert requests[request_id].output_token_ids == reference_generate(prompt_of(seed, 7), 17)  # 24 slots


def test_a_prefill_chunk_can_preempt_an_already_scheduled_decode(make):
    scheduler, runner = make(num_blocks=5, budget=5, max_seqs=2)
    late = req("late", prompt_of(50, 3), max_tokens=10, arrival=2.0)
    early = req("early", prompt_of(51, 16), max_tokens=3, arrival=1.0)
    scheduler.add_request(late)
    step(scheduler, runner)
    scheduler.add_request(early)  # arrived earlier, so it is the more important one
    shapes = []
    while True:
        batch, _ = step(scheduler, runner)
        shapes.append([(s.request.request_id, s.start, s.num_new_tokens) for s in batch.seqs])
        if batch.preempted_ids:
            break
    # late's decode was scheduled first, then early's chunk needed a block: late is unscheduled.
    assert shapes == [[("late", 3, 1), ("early", 0, 4)], [("late", 4, 1), ("early", 4, 4)],
                      [("late", 5, 1), ("early", 8, 4)], [("early", 12, 4)]]
    assert batch.preempted_ids == ["late"] and batch.num_tokens == 4
    assert late.status is RequestStatus.PREEMPTED and late.output_token_ids == reference_generate(late.prompt_token_ids, 4)
    run_until_done(scheduler, runner)
    assert early.output_token_ids == reference_generate(early.prompt_token_ids, 3)
    assert late.output_token_ids == reference_generate(late.prompt_token_ids, 10)
    assert late.num_preemptions == 1 and scheduler.stats().num_preemptions == 1


# ---- priorities ------------------------------------------------------------------------------

def test_lower_priority_value_is_admitted_first_and_equal_priority_is_fcfs(make):
    scheduler, runner = make(max_seqs=1)
    scheduler.add_request(req("low", prompt_of(60, 4), max_tokens=1, priority=5, arrival=1.0))
    scheduler.add_request(req("first", prompt_of(61, 4), max_tokens=1, priority=0, arrival=2.0))
    scheduler.add_request(req("second", prompt_of(62, 4), max_tokens=1, priority=0, arrival=3.0))
    scheduler.add_request(req("tie", prompt_of(63, 4), max_tokens=1, priority=0, arrival=3.0))
    order = []
    while scheduler.has_unfinished():
        batch, _ = step(scheduler, runner)
        order += [s.request.request_id for s in batch.seqs]
    assert order == ["first", "second", "tie", "low"]


# ---- abort at every state --------------------------------------------------------------------

def _abort_and_check(scheduler, request_id, expect_output=True):
    out = scheduler.abort(request_id)
    if expect_output:
        assert out is not None and out.finished and out.finish_reason == "abort" and out.new_token_ids == []
        assert scheduler.get_request(request_id).status is RequestStatus.FINISHED_ABORTED
    else:
        assert out is None
    assert scheduler.abort(request_id) is None
    scheduler.check_integrity()
    assert request_id not in scheduler.request_ids()


def test_abort_waiting_mid_prefill_running_and_preempted(make):
    scheduler, runner = make(num_blocks=10, budget=8, max_seqs=4)
    scheduler.add_request(req("waiting", prompt_of(70, 5)))
    _abort_and_check(scheduler, "waiting")
    assert scheduler.num_waiting == 0

    scheduler.add_request(req("chunked", prompt_of(71, 20)))
    step(scheduler, runner)
    assert scheduler.get_request("chunked").num_computed_tokens == 8
    _abort_and_check(scheduler, "chunked")
    assert scheduler.block_manager.num_free_blocks == 10

    scheduler.add_request(req("running", prompt_of(72, 5), max_tokens=50))
    step(scheduler, runner)
    step(scheduler, runner)
    assert len(scheduler.get_request("running").output_token_ids) == 2
    _abort_and_check(scheduler, "running")

    keeper = req("keeper", prompt_of(73, 15), max_tokens=40, arrival=1.0)
    scheduler.add_request(keeper)
    scheduler.add_request(req("victim", prompt_of(74, 15), max_tokens=40, arrival=2.0))
    while scheduler.get_request("victim").status is not RequestStatus.PREEMPTED:
        step(scheduler, runner)
    _abort_and_check(scheduler, "victim")
    run_until_done(scheduler, runner)
    assert keeper.output_token_ids == reference_generate(prompt_of(73, 15), 25)  # 40 slots in all
    assert _abort_and_check(scheduler, "never-seen", expect_output=False) is None


def test_abort_between_schedule_and_update_is_skipped(make):
    scheduler, runner = make()
    scheduler.add_request(req("a", prompt_of(75, 6)))
    scheduler.add_request(req("b", prompt_of(76, 6), max_tokens=2))
    batch = scheduler.schedule()
    sampled = runner.execute(batch)
    assert scheduler.abort("a").finish_reason == "abort"
    outputs = scheduler.update(batch, sampled)
    assert [o.request_id for o in outputs] == ["b"]
    scheduler.check_integrity()
    run_until_done(scheduler, runner)


def test_finish_with_error_frees_blocks_and_reports_the_message(make):
    scheduler, runner = make()
    scheduler.add_request(req("a", prompt_of(77, 6)))
    step(scheduler, runner)
    out = scheduler.finish_with_error("a", "internal error: boom")
    assert (out.finish_reason, out.error, out.finished) == ("error", "internal error: boom", True)
    assert scheduler.get_request("a").status is RequestStatus.FINISHED_ERROR
    assert scheduler.finish_with_error("a", "again") is None


# ---- prefix caching --------------------------------------------------------------------------

def test_shared_prefix_hits_report_cached_tokens_and_give_the_same_output(make):
    scheduler, runner = make(num_blocks=64, budget=64)
    system = prompt_of(80, 22)
    first, second = system + prompt_of(81, 5), system + prompt_of(82, 7)
    scheduler.add_request(req("first", first, max_tokens=4))
    finals = run_until_done(scheduler, runner)
    assert finals["first"].num_cached_tokens == 0
    scheduler.add_request(req("second", second, max_tokens=4))
    finals = run_until_done(scheduler, runner)
    assert finals["second"].num_cached_tokens == 20  # 5 full blocks of the shared 22 tokens
    assert runner.batches[-4].seqs[0].start == 20 and runner.batches[-4].num_tokens == len(second) - 20
    assert finals["second"].new_token_ids == reference_generate(second, 4)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (len(first) + len(second), 20)
    assert stats.prompt_tokens_computed == len(first) + len(second) - 20


def test_prefix_caching_disabled_recomputes_everything(make):
    scheduler, runner = make(prefix_caching=False)
    prompt = prompt_of(83, 17)
    for request_id in ("a", "b"):
        scheduler.add_request(req(request_id, prompt, max_tokens=2))
        assert run_until_done(scheduler, runner)[request_id].num_cached_tokens == 0
    stats = scheduler.stats()
    assert (stats.prefix_cache_hits, stats.kv_blocks_cached, stats.prompt_tokens_computed) == (0, 0, 34)


def test_ten_turn_conversation_prefills_only_new_tokens(make):
    scheduler, runner = make(num_blocks=128, budget=32, max_model_len=1024)
    rng = random.Random(7)
    history = prompt_of(90, 37)
    computed_before = 0
    for turn in range(1, 11):
        if turn > 1:
            history = history + [rng.randrange(1000) for _ in range(rng.randrange(3, 9))]  # the new user tail
        request_id = f"turn{turn}"
        scheduler.add_request(req(request_id, history, max_tokens=6))
        final = run_until_done(scheduler, runner)[request_id]
        assert final.new_token_ids == reference_generate(history, 6)
        computed = scheduler.stats().prompt_tokens_computed - computed_before
        computed_before += computed
        assert computed == len(history) - final.num_cached_tokens
        if turn == 1:
            assert final.num_cached_tokens == 0
        else:
            # Everything the previous turn computed (its prompt and all but its last output) is reused.
            assert final.num_cached_tokens == previous_kv_tokens // BS * BS
            assert computed <= len(history) - previous_kv_tokens + BS - 1
        previous_kv_tokens = len(history) + 6 - 1
        history = history + final.new_token_ids


def test_hash_collisions_never_reuse_wrong_blocks(make, monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent, tokens, extra, algo: b"collide")
    scheduler, runner = make(num_blocks=32)
    prompts = {"a": prompt_of(100, 13), "b": prompt_of(101, 13), "c": prompt_of(100, 4) + prompt_of(102, 9)}
    for request_id, prompt in prompts.items():
        scheduler.add_request(req(request_id, prompt, max_tokens=5))
        final = run_until_done(scheduler, runner)[request_id]  # the fake runner checks every KV slot read
        assert final.new_token_ids == reference_generate(prompt, 5)
    assert scheduler.stats().prefix_cache_hits == 4  # only c's first block really matches a's


def test_lru_keeps_recent_prefixes_and_evicts_old_ones(make):
    scheduler, runner = make(num_blocks=12, budget=64)
    old, recent = prompt_of(110, 17), prompt_of(111, 17)
    for request_id, prompt in (("old", old), ("recent", recent)):
        scheduler.add_request(req(request_id, prompt, max_tokens=1))
        run_until_done(scheduler, runner)
    # 2 partial (hashless) blocks + 2 never used are free first; 6 blocks evict old's tail blocks 3 and 2.
    scheduler.add_request(req("filler", prompt_of(112, 24), max_tokens=1))
    run_until_done(scheduler, runner)
    assert scheduler.block_manager.find_cached_prefix(req("recent?", recent + [5]))[1] == 16
    assert scheduler.block_manager.find_cached_prefix(req("old?", old + [5]))[1] == 8
    scheduler.add_request(req("old-again", old + [5], max_tokens=1))
    assert run_until_done(scheduler, runner)["old-again"].num_cached_tokens == 8


# ---- prefill role: export --------------------------------------------------------------------

def test_prefill_role_pins_blocks_while_sending_until_finish_sending(make):
    connector = FakeConnector()
    scheduler, runner = make(num_blocks=16, budget=8, role="prefill", connector=connector)
    prompt = prompt_of(120, 14)
    scheduler.add_request(req("p", prompt, max_tokens=50))
    outputs = []
    while scheduler.num_running or scheduler.num_waiting:
        batch, out = step(scheduler, runner)
        # a prefill-role request holds blocks for its whole prompt from its first chunk on
        assert all(len(seq.request.block_ids) == 4 for seq in batch.seqs)
        outputs += out
    assert len(outputs) == 1
    out = outputs[0]
    assert (out.new_token_ids, out.finished, out.finish_reason) == (reference_generate(prompt, 1), False, None)
    request = scheduler.get_request("p")
    assert request.status is RequestStatus.SENDING_KV and scheduler.has_unfinished()
    assert connector.finished == [("p", request.block_ids)] and len(request.block_ids) == 4
    assert scheduler.block_manager.num_free_blocks == 12 and scheduler.stats().sending_kv == 1
    final = scheduler.finish_sending("p", None)
    assert (final.finished, final.finish_reason, final.new_token_ids) == (True, "prefill_done", [])
    assert scheduler.finish_sending("p", None) is None and not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 16 and connector.ended == []
    scheduler.add_request(req("p2", prompt + [1], max_tokens=50))  # its blocks stayed cached
    while scheduler.num_running or scheduler.num_waiting:
        step(scheduler, runner)
    assert scheduler.get_request("p2").num_cached_tokens == 12
    scheduler.finish_sending("p2", None)


def test_prefill_role_abort_while_sending_stops_the_send_then_frees(make):
    connector = FakeConnector()
    scheduler, runner = make(num_blocks=16, role="prefill", connector=connector)
    scheduler.add_request(req("p", prompt_of(121, 9)))
    step(scheduler, runner)
    assert scheduler.block_manager.num_free_blocks == 13
    _abort_and_check(scheduler, "p")
    assert connector.ended == ["p"]
    assert scheduler.block_manager.num_free_blocks == 16


def test_prefill_role_failed_send_ends_in_error_and_frees(make):
    scheduler, runner = make(num_blocks=16, role="prefill", connector=FakeConnector())
    scheduler.add_request(req("p", prompt_of(122, 9)))
    step(scheduler, runner)
    final = scheduler.finish_sending("p", "KV transfer failed: peer unreachable")
    assert (final.finish_reason, final.error) == ("error", "KV transfer failed: peer unreachable")
    assert scheduler.block_manager.num_free_blocks == 16 and scheduler.num_sending_kv == 0


def test_prefill_role_short_prompts_pass_between_a_long_prompts_chunks(make):
    """With long_prefill_chunk_tokens (the prefill role's default), a long prompt runs a chunk per
    step, even alone; when a prompt that fits in one chunk is waiting, the long prompt skips the
    step so that the short one runs without its chunk, until a chunk's worth of tokens ran in the
    steps it skipped; prompts longer than a chunk run chunks too."""
    scheduler, runner = make(num_blocks=64, budget=32, role="prefill", connector=FakeConnector(pin=False),
                             long_chunk=8)
    long = prompt_of(124, 100)
    scheduler.add_request(req("long", long))
    batch, _ = step(scheduler, runner)
    assert [seq.num_new_tokens for seq in batch.seqs] == [8]
    scheduler.add_request(req("short", prompt_of(125, 6)))
    scheduler.add_request(req("medium", prompt_of(126, 20)))
    batch, outputs = step(scheduler, runner)
    # the long prompt yields; the medium one, admitted with the short one, runs a chunk
    assert {seq.request.request_id: seq.num_new_tokens for seq in batch.seqs} == {"short": 6, "medium": 8}
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("short", "prefill_done")]
    batch, _ = step(scheduler, runner)
    assert {seq.request.request_id: seq.num_new_tokens for seq in batch.seqs} == {"long": 8, "medium": 8}
    scheduler.add_request(req("short2", prompt_of(127, 6)))
    scheduler.add_request(req("short3", prompt_of(128, 5)))
    batch, outputs = step(scheduler, runner)
    assert {seq.request.request_id: seq.num_new_tokens for seq in batch.seqs} == {"medium": 4, "short2": 6,
                                                                                   "short3": 5}
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [
        ("medium", "prefill_done"), ("short2", "prefill_done"), ("short3", "prefill_done")]
    scheduler.add_request(req("short4", prompt_of(129, 6)))
    batch, _ = step(scheduler, runner)  # the last step it skipped ran 15 tokens, a chunk is 8: not this one
    assert {seq.request.request_id: seq.num_new_tokens for seq in batch.seqs} == {"long": 8, "short4": 6}
    finals = run_until_done(scheduler, runner)
    assert finals["long"].new_token_ids == reference_generate(long, 1)


def test_a_long_prompt_yields_again_until_short_prompts_have_run_a_chunks_worth(make):
    """Two short prompts arriving a moment apart (the second after the first's step began) both
    run before the long prompt's next chunk; a third does not: by then they ran more than a chunk."""
    scheduler, runner = make(num_blocks=64, budget=32, role="prefill", connector=FakeConnector(pin=False),
                             long_chunk=8)
    long = prompt_of(132, 100)
    scheduler.add_request(req("long", long))
    step(scheduler, runner)
    scheduler.add_request(req("short", prompt_of(133, 5)))
    batch, outputs = step(scheduler, runner)
    assert {seq.request.request_id: seq.num_new_tokens for seq in batch.seqs} == {"short": 5}
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("short", "prefill_done")]
    scheduler.add_request(req("short2", prompt_of(134, 6)))
    batch, _ = step(scheduler, runner)  # 5 tokens ran in the step it skipped: it yields again
    assert {seq.request.request_id: seq.num_new_tokens for seq in batch.seqs} == {"short2": 6}
    scheduler.add_request(req("short3", prompt_of(135, 4)))
    batch, _ = step(scheduler, runner)  # 11 tokens by now: its chunk runs, the short one beside it
    assert {seq.request.request_id: seq.num_new_tokens for seq in batch.seqs} == {"long": 8, "short3": 4}
    scheduler.add_request(req("short4", prompt_of(136, 6)))
    batch, _ = step(scheduler, runner)  # a chunk ran since: it yields again
    assert {seq.request.request_id: seq.num_new_tokens for seq in batch.seqs} == {"short4": 6}
    finals = run_until_done(scheduler, runner)
    assert finals["long"].new_token_ids == reference_generate(long, 1)


def test_a_long_prompt_runs_its_chunk_when_the_short_prompt_cannot_be_admitted(make):
    """A yield that nobody can use is taken back in the same step: no step runs empty."""
    scheduler, runner = make(num_blocks=26, budget=32, role="prefill", connector=FakeConnector(pin=False),
                             long_chunk=8)
    long = prompt_of(130, 100)  # the prefill role holds all 25 of its blocks from admission
    scheduler.add_request(req("long", long))
    step(scheduler, runner)
    scheduler.add_request(req("short", prompt_of(131, 6)))  # needs 2 blocks, 1 is free
    batch, _ = step(scheduler, runner)
    assert {seq.request.request_id: seq.num_new_tokens for seq in batch.seqs} == {"long": 8}
    finals = run_until_done(scheduler, runner)
    assert finals["long"].new_token_ids == reference_generate(long, 1)
    assert finals["short"].finish_reason == "prefill_done"


def test_prefill_role_without_a_send_finishes_at_its_first_token(make):
    connector = FakeConnector(pin=False)
    scheduler, runner = make(num_blocks=16, role="prefill", connector=connector)
    scheduler.add_request(req("p", prompt_of(123, 9)))
    _, outputs = step(scheduler, runner)
    assert (outputs[0].finished, outputs[0].finish_reason) == (True, "prefill_done")
    assert scheduler.block_manager.num_free_blocks == 16 and connector.finished[0][0] == "p"


# ---- decode role: import ---------------------------------------------------------------------

def test_decode_role_import_success_decodes_like_a_local_run(make):
    scheduler, runner = make(num_blocks=16, role="decode")
    prompt = prompt_of(130, 14)
    expected = reference_generate(prompt, 6)
    request = req("d", prompt, max_tokens=6)
    plan = scheduler.add_imported_request(request)
    assert request.status is RequestStatus.WAITING_FOR_KV and scheduler.has_unfinished()
    assert plan.num_cached_tokens == 0 and plan.block_ids == request.block_ids and len(plan.block_ids) == 4
    assert plan.blocks_to_fill == list(enumerate(plan.block_ids))
    assert scheduler.schedule().is_empty  # nothing to run while the KV is in flight
    assert scheduler.block_manager.num_free_blocks == 12
    runner.import_kv(request, plan.blocks_to_fill)
    first = scheduler.finish_import("d", SampledToken(expected[0], logprob=-0.1))
    assert (first.new_token_ids, first.finished) == ([expected[0]], False)
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 14
    finals = run_until_done(scheduler, runner)
    assert [expected[0]] + finals["d"].new_token_ids == expected and finals["d"].finish_reason == "length"
    stats = scheduler.stats()
    assert (stats.imported_tokens, stats.prompt_tokens_computed, stats.decode_tokens) == (14, 0, 5)
    assert stats.kv_blocks_cached == 4  # the imported prompt blocks (3 full) + 1 decoded full block


def test_decode_role_import_uses_own_prefix_cache(make):
    scheduler, runner = make(num_blocks=32, role="decode")
    shared = prompt_of(131, 12)
    scheduler.add_request(req("local", shared + [1, 2], max_tokens=2))
    run_until_done(scheduler, runner)
    prompt = shared + prompt_of(132, 6)
    request = req("d", prompt, max_tokens=3)
    plan = scheduler.add_imported_request(request)
    assert plan.num_cached_tokens == 12 == request.num_cached_tokens
    assert [index for index, _ in plan.blocks_to_fill] == [3, 4]
    _import_and_decode(scheduler, runner, request, plan)
    assert scheduler.stats().imported_tokens == 6


def _import_and_decode(scheduler, runner, request, plan):
    """What a successful transfer and the rest of the generation do; the output must be exact."""
    runner.import_kv(request, plan.blocks_to_fill)
    expected = reference_generate(request.prompt_token_ids, request.sampling_params.max_tokens)
    scheduler.finish_import(request.request_id, SampledToken(expected[0]))
    assert [expected[0]] + run_until_done(scheduler, runner)[request.request_id].new_token_ids == expected


def test_decode_role_import_failure_with_fallback_prefills_locally(make):
    scheduler, runner = make(num_blocks=32, budget=8, role="decode")
    shared = prompt_of(133, 8)
    scheduler.add_request(req("local", shared + [3], max_tokens=1))
    run_until_done(scheduler, runner)
    prompt = shared + prompt_of(134, 13)
    request = req("d", prompt, max_tokens=4)
    plan = scheduler.add_imported_request(request)
    assert plan.num_cached_tokens == 8
    runner.import_kv(request, plan.blocks_to_fill[:1])  # a partial transfer, then failure
    assert scheduler.fail_import("d", fallback_to_local_prefill=True) is None
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 8
    finals = run_until_done(scheduler, runner)
    assert finals["d"].new_token_ids == reference_generate(prompt, 4)
    assert finals["d"].num_cached_tokens == 8


def test_decode_role_import_failure_without_fallback_errors_and_frees(make):
    scheduler, runner = make(num_blocks=8, role="decode")
    plan = scheduler.add_imported_request(req("d", prompt_of(135, 10)))
    assert scheduler.block_manager.num_free_blocks == 8 - len(plan.block_ids)
    out = scheduler.fail_import("d", fallback_to_local_prefill=False, message="transfer timed out")
    assert (out.finished, out.finish_reason, out.error) == (True, "error", "transfer timed out")
    assert scheduler.block_manager.num_free_blocks == 8 and not scheduler.has_unfinished()
    with pytest.raises(ValueError, match="not waiting for KV"):
        scheduler.finish_import("d", SampledToken(1))


def test_decode_role_import_when_cache_is_full_changes_nothing(make):
    scheduler, runner = make(num_blocks=4, role="decode")
    scheduler.add_imported_request(req("a", prompt_of(136, 10)))
    with pytest.raises(KVCacheFullError, match="needs 2 free KV blocks, 1 are free"):
        scheduler.add_imported_request(req("b", prompt_of(137, 5)))
    assert scheduler.request_ids() == ["a"] and scheduler.block_manager.num_free_blocks == 1
    _abort_and_check(scheduler, "a")  # abort while waiting for KV frees its blocks
    assert scheduler.block_manager.num_free_blocks == 4


def test_decode_role_first_token_can_finish_and_seq_cap_defers_running(make):
    scheduler, runner = make(num_blocks=32, role="decode", max_seqs=1)
    eos_prompt = prompt_of(138, 6)
    request = req("eos", eos_prompt, eos={42})
    plan = scheduler.add_imported_request(request)
    runner.import_kv(request, plan.blocks_to_fill)
    out = scheduler.finish_import("eos", SampledToken(42))
    assert (out.finished, out.finish_reason) == (True, "stop") and scheduler.block_manager.num_free_blocks == 32

    scheduler.add_request(req("busy", prompt_of(139, 5), max_tokens=3))
    step(scheduler, runner)
    prompt = prompt_of(140, 7)
    expected = reference_generate(prompt, 3)
    late = req("late", prompt, max_tokens=3)
    plan = scheduler.add_imported_request(late)
    runner.import_kv(late, plan.blocks_to_fill)
    scheduler.finish_import("late", SampledToken(expected[0]))
    assert late.status is RequestStatus.WAITING and scheduler.num_running == 1  # max_num_seqs=1
    finals = run_until_done(scheduler, runner)
    assert [expected[0]] + finals["late"].new_token_ids == expected


def test_request_holding_blocks_may_pass_a_blocked_head_of_queue(make):
    # Without this, "big" (head of the queue) waits for blocks that "imported" holds while
    # "imported" waits behind "big": nothing would ever run again.
    scheduler, runner = make(num_blocks=7, role="decode", max_seqs=1)
    busy = req("busy", prompt_of(141, 3), max_tokens=2, arrival=1.0)
    scheduler.add_request(busy)
    step(scheduler, runner)
    imported = req("imported", prompt_of(142, 15), max_tokens=3, arrival=3.0)
    plan = scheduler.add_imported_request(imported)
    runner.import_kv(imported, plan.blocks_to_fill)
    expected = reference_generate(imported.prompt_token_ids, 3)
    scheduler.finish_import("imported", SampledToken(expected[0]))
    big = req("big", prompt_of(143, 15), max_tokens=2, arrival=2.0)
    scheduler.add_request(big)
    assert [r.request_id for r in scheduler.waiting] == ["big", "imported"]
    run_until_done(scheduler, runner)
    assert imported.output_token_ids == expected
    assert big.output_token_ids == reference_generate(big.prompt_token_ids, 2)
    assert [s.request.request_id for b in runner.batches[-4:] for s in b.seqs] == ["imported", "imported", "big", "big"]


def test_waiting_requests_holding_every_block_give_one_back_when_nothing_runs(make):
    """Two imports fall back to local prefill with the first token kept (their prompts fill their
    one block each: with it they need two); they hold every block and nothing runs, so no step
    would ever free one. The last in queue order gives its blocks back; both finish, exact."""
    scheduler, runner = make(num_blocks=2, role="decode")
    requests = {}
    for request_id, seed in (("a", 144), ("b", 145)):
        requests[request_id] = request = req(request_id, prompt_of(seed, 4), max_tokens=4, arrival=float(seed))
        scheduler.add_imported_request(request)
    expected = {rid: reference_generate(r.prompt_token_ids, 4) for rid, r in requests.items()}
    for request_id in ("a", "b"):
        scheduler.fail_import(request_id, True, "short", first_token=SampledToken(expected[request_id][0]))
    assert scheduler.block_manager.num_free_blocks == 0
    run_until_done(scheduler, runner, max_steps=200)
    for request_id, request in requests.items():
        assert request.output_token_ids == expected[request_id]
    assert scheduler.stats().num_preemptions >= 1 and scheduler.block_manager.num_free_blocks == 2


def test_a_finished_import_queues_behind_requests_already_waiting(make):
    """A slot that frees goes to the oldest waiting request, not to the next import to finish."""
    scheduler, runner = make(num_blocks=400, role="decode", max_seqs=2)

    def imported(request_id, arrival, max_tokens):
        request = req(request_id, prompt_of(int(arrival) + 146, 7), max_tokens=max_tokens, arrival=arrival)
        plan = scheduler.add_imported_request(request)
        runner.import_kv(request, plan.blocks_to_fill)
        scheduler.finish_import(request_id, SampledToken(reference_generate(request.prompt_token_ids, 1)[0]))
        return request

    imported("a", 0.0, 3)
    imported("b", 1.0, 50)
    old = imported("old", 2.0, 4)  # deferred: running is full
    assert old.status is RequestStatus.WAITING
    arrival = 3.0
    for _ in range(10):
        _, outputs = step(scheduler, runner)
        if any(output.finished for output in outputs):
            imported(f"new{arrival:.0f}", arrival, 3)
            arrival += 1
    assert old.status is RequestStatus.FINISHED_LENGTH
    assert old.output_token_ids == reference_generate(old.prompt_token_ids, 4)


def test_imports_do_not_take_the_blocks_an_older_waiting_request_needs(make):
    """A prompt queued for local prefill because blocks were short (a KVCacheFullError) is not
    starved by later imports taking every block that frees: they are refused while it waits."""
    scheduler, runner = make(num_blocks=24, budget=64, max_seqs=8, role="decode")
    for index in range(4):
        request = req(f"r{index}", prompt_of(150 + index, 16), max_tokens=6, arrival=float(index))
        plan = scheduler.add_imported_request(request)
        runner.import_kv(request, plan.blocks_to_fill)
        scheduler.finish_import(request.request_id, SampledToken(1))
    big = req("big", prompt_of(160, 40), max_tokens=4, arrival=10.0)
    with pytest.raises(KVCacheFullError):
        scheduler.add_imported_request(big)
    scheduler.add_request(big)  # what the decode worker does: prefill it here when blocks free up
    step(scheduler, runner)
    assert big.status is RequestStatus.WAITING and not big.block_ids  # still short of blocks
    later = req("later", prompt_of(161, 8), max_tokens=2, arrival=11.0)
    with pytest.raises(KVCacheFullError, match="request big waits for free KV blocks ahead of later"):
        scheduler.add_imported_request(later)
    urgent = req("urgent", prompt_of(162, 8), max_tokens=2, priority=-1, arrival=12.0)
    scheduler.fail_import(scheduler.add_imported_request(urgent).request_id, False)  # more important: admitted
    run_until_done(scheduler, runner)
    assert big.output_token_ids == reference_generate(big.prompt_token_ids, 4)


# ---- counters --------------------------------------------------------------------------------

def test_stats_counters(make):
    scheduler, runner = make(num_blocks=20, budget=64, max_seqs=4)
    prompt = prompt_of(150, 10)
    scheduler.add_request(req("a", prompt, max_tokens=4))
    scheduler.add_request(req("b", prompt_of(151, 6), max_tokens=3))
    stats = scheduler.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_total, stats.kv_blocks_free) == (0, 2, 20, 20)
    step(scheduler, runner)
    stats = scheduler.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_free, stats.kv_blocks_cached) == (2, 0, 15, 3)
    run_until_done(scheduler, runner)
    scheduler.add_request(req("c", prompt + [7, 7], max_tokens=1))
    run_until_done(scheduler, runner)
    stats = scheduler.stats()
    assert stats.prefix_cache_queries == 10 + 6 + 12 and stats.prefix_cache_hits == 8
    assert stats.prompt_tokens_computed == 10 + 6 + 4
    assert stats.decode_tokens == 3 + 2  # a: 3 fed-back outputs, b: 2, c: none
    assert (stats.running, stats.waiting, stats.kv_blocks_free, stats.num_preemptions) == (0, 0, 20, 0)
    # a: 13 tokens computed -> 3 cached blocks; b: 8 -> 2; c reuses a's 2 and adds block 2 (10, 7, 7...)
    assert stats.kv_blocks_cached == 3 + 2 + 1


# ---- randomized lifecycle --------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_aborts_and_preemptions_keep_outputs_exact(make, seed):
    rng = random.Random(seed)
    max_model_len = 48
    scheduler, runner = make(num_blocks=20, budget=12, max_seqs=4, max_model_len=max_model_len)
    prefixes = [prompt_of(200 + seed * 10 + i, 12) for i in range(3)]
    requests, streamed = {}, {}
    aborted = set()
    step_index = 0
    while step_index < 300 or scheduler.has_unfinished():
        step_index += 1
        if step_index < 300 and rng.random() < 0.3:
            prompt = rng.choice(prefixes)[:rng.randrange(0, 13)] + prompt_of(rng.randrange(10**6), rng.randrange(1, 20))
            request = req(f"r{len(requests)}", prompt, max_tokens=rng.randrange(1, 16), priority=rng.randrange(3),
                          arrival=float(step_index))
            requests[request.request_id] = request
            scheduler.add_request(request)
        live = scheduler.request_ids()
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            assert scheduler.abort(victim).finish_reason == "abort"
            aborted.add(victim)
        if not scheduler.has_unfinished():
            continue
        batch, outputs = step(scheduler, runner)
        assert not batch.is_empty
        for out in outputs:
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert scheduler.stats().num_preemptions > 0 and scheduler.stats().prefix_cache_hits > 0
    for request_id, request in requests.items():
        assert streamed.get(request_id, []) == request.output_token_ids  # no token streamed twice after a resume
        if request_id in aborted:
            assert request.status is RequestStatus.FINISHED_ABORTED
            continue
        limit = min(request.sampling_params.max_tokens, max_model_len - request.num_prompt_tokens)
        assert request.output_token_ids == reference_generate(request.prompt_token_ids, limit)
        assert request.finish_reason == "length" and request.block_ids == []


# ---- swap preemption -------------------------------------------------------------------------

SWAP_PROMPTS = {f"r{i}": prompt_of(30 + i, 9 + 3 * i) for i in range(5)}


def _run_swapping(scheduler, runner):
    for request_id, prompt in SWAP_PROMPTS.items():
        scheduler.add_request(req(request_id, prompt, max_tokens=20))
    return run_until_done(scheduler, runner)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swap_preemption_resumes_without_recomputing(make, prefix_caching):
    scheduler, runner = make(num_blocks=16, budget=32, max_seqs=5, swap_slots=64, prefix_caching=prefix_caching)
    finals = _run_swapping(scheduler, runner)
    stats = scheduler.stats()
    assert stats.num_preemptions > 0
    for request_id, prompt in SWAP_PROMPTS.items():
        assert finals[request_id].new_token_ids == reference_generate(prompt, 20)
    # Nothing was recomputed: every prompt and output position ran through the model once.
    assert stats.prompt_tokens_computed == sum(len(p) for p in SWAP_PROMPTS.values())
    assert stats.decode_tokens == len(SWAP_PROMPTS) * 19
    assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks > 0
    if not prefix_caching:  # every swapped block comes back by copy
        assert stats.swapped_in_blocks == stats.swapped_out_blocks
    else:  # some come back from the prefix cache, without a copy
        assert stats.swapped_in_blocks < stats.swapped_out_blocks
    assert not any(b.swap_out and b.swap_in for b in runner.batches)


def test_swap_falls_back_to_recompute_when_slots_run_out(make):
    scheduler, runner = make(num_blocks=16, budget=32, max_seqs=5, swap_slots=5)
    finals = _run_swapping(scheduler, runner)
    for request_id, prompt in SWAP_PROMPTS.items():
        assert finals[request_id].new_token_ids == reference_generate(prompt, 20)
    stats = scheduler.stats()
    recomputed = stats.prompt_tokens_computed + stats.decode_tokens - sum(len(p) for p in SWAP_PROMPTS.values()) \
        - len(SWAP_PROMPTS) * 19
    assert recomputed > 0  # some victims needed more than the free slots and were recomputed
    assert stats.swapped_out_blocks > 0  # and the ones that fitted were swapped


def test_aborting_a_swapped_request_frees_its_slots(make):
    scheduler, runner = make(num_blocks=12, budget=32, max_seqs=5, swap_slots=64)
    for request_id, prompt in SWAP_PROMPTS.items():
        scheduler.add_request(req(request_id, prompt, max_tokens=20))
    victim = None
    for _ in range(200):
        batch, _ = step(scheduler, runner)
        swapped = [scheduler.get_request(r) for r in batch.preempted_ids if scheduler.get_request(r).swap_slots]
        if swapped:
            victim = swapped[0]
            break
    assert victim is not None and victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens > 0
    free_before = scheduler.stats().swap_slots_free
    held = len(victim.swap_slots)
    final = scheduler.abort(victim.request_id)
    assert final.finish_reason == "abort" and victim.swap_slots == []
    assert scheduler.stats().swap_slots_free == free_before + held
    scheduler.check_integrity()


def test_swap_needs_swap_space():
    with pytest.raises(ValueError, match="swap_space_gb"):
        Scheduler(SchedulerConfig(preemption_mode="swap"), CacheConfig(block_size=BS), 16, 256, num_swap_slots=0)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="spill")


# ---- host cache tier (KV offload) ------------------------------------------------------------

def _session_turns(scheduler, runner, turns=4, others_per_turn=3):
    """An agent session: each turn resends its history plus a short new tail; between turns,
    other requests fill the small pool and evict the session's cached blocks. Returns the
    session's per-turn (num_cached_tokens, prompt tokens computed)."""
    history = prompt_of(200, 20)
    seen = []
    for turn in range(turns):
        before = scheduler.stats().prompt_tokens_computed
        request = req(f"s{turn}", history, max_tokens=4)
        scheduler.add_request(request)
        finals = run_until_done(scheduler, runner)
        assert finals[f"s{turn}"].new_token_ids == reference_generate(history, 4)
        seen.append((request.num_cached_tokens, scheduler.stats().prompt_tokens_computed - before))
        for other in range(others_per_turn):
            scheduler.add_request(req(f"o{turn}.{other}", prompt_of(300 + 10 * turn + other, 22), max_tokens=2))
        run_until_done(scheduler, runner)
        history = history + finals[f"s{turn}"].new_token_ids + prompt_of(400 + turn, 3)
    return seen


def test_host_cache_brings_an_evicted_session_back_without_recomputing(make):
    """Without the host tier the session's blocks are gone after the other traffic and every
    turn recomputes its whole history; with it, turns 2.. prefill only the uncached tail, and
    the KV that came back is right (the fake runner checks every position it reads)."""
    plain, plain_runner = make(num_blocks=12, budget=16, max_seqs=4)
    without = _session_turns(plain, plain_runner)
    assert [cached for cached, _ in without[1:]] == [0, 0, 0]
    tiered, tiered_runner = make(num_blocks=12, budget=16, max_seqs=4, host_slots=64)
    with_tier = _session_turns(tiered, tiered_runner)
    for (cached, computed), (_, computed_without) in zip(with_tier[1:], without[1:]):
        assert cached > 0 and computed == computed_without - cached  # only the tail is computed
        assert computed <= 2 * BS
    stats = tiered.stats()
    assert stats.host_cache_hits == sum(cached for cached, _ in with_tier[1:]) > 0
    assert stats.offloaded_blocks > 0 and stats.reloaded_blocks * BS == stats.host_cache_hits
    assert stats.host_cache_slots == 64 and 0 < stats.host_cache_used <= 64
    assert any(b.kv_offload for b in tiered_runner.batches) and any(b.kv_reload for b in tiered_runner.batches)


def test_host_cache_evicts_least_recently_used_and_a_lost_first_block_is_a_miss(make):
    """Three host slots: the oldest saved blocks make room for newer ones, and a prefix whose
    first block left the tier is not found (lookups are prefix runs)."""
    scheduler, runner = make(num_blocks=6, budget=32, max_seqs=2, host_slots=3)
    first = prompt_of(210, 13)  # 3 full blocks + 1 token
    scheduler.add_request(req("a", first, max_tokens=1))
    run_until_done(scheduler, runner)
    for index in range(3):  # each evicts older cached blocks into the 3 slots
        scheduler.add_request(req(f"x{index}", prompt_of(220 + index, 21), max_tokens=1))
        run_until_done(scheduler, runner)
    assert scheduler.stats().offloaded_blocks > 3 and scheduler.stats().host_cache_used == 3
    again = req("a2", first, max_tokens=1)
    scheduler.add_request(again)
    run_until_done(scheduler, runner)
    assert again.num_cached_tokens == 0


def test_host_cache_offloads_a_block_once_and_keeps_it_after_a_reload(make):
    scheduler, runner = make(num_blocks=8, budget=32, max_seqs=2, host_slots=16)
    prompt = prompt_of(230, 17)
    for turn in range(3):
        request = req(f"p{turn}", prompt, max_tokens=1)
        scheduler.add_request(request)
        run_until_done(scheduler, runner)
        if turn:
            assert request.num_cached_tokens == 16
        scheduler.add_request(req(f"fill{turn}", prompt_of(240 + turn, 29), max_tokens=1))
        run_until_done(scheduler, runner)
    stats = scheduler.stats()
    # The prompt's 4 full blocks went to the host once; evicting their reloaded copies again
    # found them there (the tier is inclusive) and copied nothing.
    prompt_blocks = 4
    fill_blocks = 7 * 3
    assert stats.offloaded_blocks <= prompt_blocks + fill_blocks
    assert stats.reloaded_blocks == 2 * prompt_blocks


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_host_cache_under_random_traffic_keeps_outputs_exact(make, seed, mode):
    """Shared prefixes, a pool so small that requests are preempted, a host tier smaller than
    the traffic, aborts: every output equals the reference (so every reloaded block held the
    right KV) and nothing leaks."""
    rng = random.Random(seed)
    scheduler, runner = make(num_blocks=14, budget=rng.choice([8, 16, 32]), max_seqs=4,
                             swap_slots=32 if mode == "swap" else 0, host_slots=rng.choice([4, 12, 40]))
    stems = [prompt_of(500 + seed * 10 + i, 12) for i in range(3)]
    requests = {}
    for wave in range(4):
        for index in range(4):
            prompt = rng.choice(stems) + prompt_of(rng.randrange(10**6), rng.randrange(1, 9))
            request_id = f"w{wave}.{index}"
            requests[request_id] = req(request_id, prompt, max_tokens=rng.randrange(2, 8))
            scheduler.add_request(requests[request_id])
        if wave == 2:
            step(scheduler, runner)
            scheduler.abort(f"w{wave}.1")
        run_until_done(scheduler, runner)
    for request_id, request in requests.items():
        if request.finish_reason == "abort":
            continue
        assert request.output_token_ids == reference_generate(request.prompt_token_ids,
                                                              request.sampling_params.max_tokens)
    assert scheduler.stats().offloaded_blocks > 0  # (hits: the deterministic tests above)


def test_decode_role_import_takes_host_cache_hits_and_transfers_only_the_rest(make):
    scheduler, runner = make(num_blocks=10, role="decode", host_slots=32)
    shared = prompt_of(600, 16)
    scheduler.add_request(req("local", shared + [7], max_tokens=1))
    run_until_done(scheduler, runner)
    scheduler.add_request(req("filler", prompt_of(601, 37), max_tokens=1))  # evicts the shared blocks
    run_until_done(scheduler, runner)
    assert scheduler.block_manager.find_cached_prefix(req("probe", shared + [1]))[1] == 0
    prompt = shared + prompt_of(602, 6)
    request = req("d", prompt, max_tokens=3)
    plan = scheduler.add_imported_request(request)
    assert plan.num_cached_tokens == 16 and [index for index, _ in plan.blocks_to_fill] == [4, 5]
    offloads, reloads = scheduler.take_host_copies()  # what the engine does at once
    assert len(reloads) == 4
    runner.offload(offloads)
    runner.reload(reloads)
    _import_and_decode(scheduler, runner, request, plan)
    assert scheduler.stats().host_cache_hits == 16


def test_one_batch_never_writes_a_host_slot_twice(make):
    """An eviction burst larger than the tier: slots saved in this pass are not recycled for later
    blocks of the same pass (that would copy twice into one slot); the surplus is not saved."""
    scheduler, runner = make(num_blocks=12, budget=64, max_seqs=2, host_slots=3)
    scheduler.add_request(req("a", prompt_of(700, 33), max_tokens=1))
    run_until_done(scheduler, runner)
    scheduler.add_request(req("b", prompt_of(701, 41), max_tokens=1))
    batch, _ = step(scheduler, runner)
    slots = [slot for _, slot in batch.kv_offload]
    assert len(slots) == 3 and len(set(slots)) == 3
    run_until_done(scheduler, runner)
    again = req("a2", prompt_of(700, 33), max_tokens=1)
    scheduler.add_request(again)
    run_until_done(scheduler, runner)
    assert again.output_token_ids == reference_generate(prompt_of(700, 33), 1)
