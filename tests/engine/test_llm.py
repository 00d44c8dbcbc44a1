"""The whole engine (scheduler + model runner + sampler + detokenizer) on the default model.

Greedy outputs must be token-identical to transformers whatever the scheduling: chunked prefill
at a small budget, a KV pool so small that requests are preempted, and prefix-cache hits.
"""
import asyncio

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine, EngineUnavailable
from engine.huge_pages import HUGE_PAGES_ENV
from engine.model.loader import resolve_model
from tests.engine.streams import collect_tokens

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "Name a fruit that is yellow."}],
    [{"role": "user", "content": "Écris un mot en français."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
]
PLAIN = ["The history of the Roman empire", "Les fleurs du jardin sont"]
NEW = 32
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(HUGE_PAGES_ENV, "1")  # the one real model here built as served: weights in huge pages
        return LLM("default")


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.tokenizer
    return [tok.apply_chat_template(c) for c in CHATS] + [tok.encode(p) for p in PLAIN]


@pytest.fixture(scope="module")
def reference(prompts):
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("default").model_dir,
                                                           torch_dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(p):].tolist())
    return refs


def _assert_clean(engine):
    engine.scheduler.check_integrity()
    stats = engine.scheduler.stats()
    assert stats.running == stats.waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_default_config_matches_transformers(llm, prompts, reference):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[0].text == llm.tokenizer.decode(reference[0])
    _assert_clean(llm.engine)
    # The outputs above were computed from weights that the runner moved into one arena advised
    # into huge pages (engine/huge_pages.py).
    params = list(llm.engine.runner.model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1


def test_chunked_prefill_small_budget_matches(prompts, reference):
    small = LLM("default", max_num_batched_tokens=32, enable_prefix_caching=False)
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert small.engine.scheduler.stats().prompt_tokens_computed >= sum(len(p) for p in prompts)
    _assert_clean(small.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_tiny_pool_matches(prompts, reference, mode):
    longest = max(len(p) for p in prompts) + NEW
    blocks = (longest + 15) // 16 + 2  # one request always fits, all of them never do
    tiny = LLM("default", num_blocks=blocks, block_size=16, enable_prefix_caching=False, preemption_mode=mode,
               swap_space_gb=0.1)
    outs = tiny.generate(prompts, GREEDY, use_tqdm=False)
    stats = tiny.engine.scheduler.stats()
    assert stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    if mode == "swap":  # KV went to host memory and came back instead of being recomputed
        assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks
        assert stats.prompt_tokens_computed == sum(len(p) for p in prompts)
        assert stats.swap_slots_free == tiny.engine.runner.num_swap_slots > 0
    _assert_clean(tiny.engine)


def test_prefix_cache_hit_gives_same_output(llm, prompts, reference):
    shared = prompts[3] * 3  # a long prompt; run it twice
    first = llm.generate([shared], GREEDY, use_tqdm=False)[0]
    second = llm.generate([shared], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 or first.num_cached_tokens < len(shared)
    assert second.num_cached_tokens >= (len(shared) - 1) // 16 * 16 > 0
    assert second.token_ids == first.token_ids
    fresh = LLM("default", enable_prefix_caching=False).generate([shared], GREEDY, use_tqdm=False)[0]
    assert fresh.token_ids == first.token_ids and fresh.num_cached_tokens == 0
    _assert_clean(llm.engine)


def test_agent_conversation_prefills_only_new_tokens(llm):
    tok = llm.tokenizer
    messages = [{"role": "system", "content": "You are a tool-using agent. Tools: search(q), calc(expr). " * 4}]
    engine = llm.engine
    for turn in range(10):
        messages.append({"role": "user", "content": f"Tool result {turn}: value={turn * 17}. Next step?"})
        prompt = tok.apply_chat_template(messages)
        before = engine.scheduler.stats().prompt_tokens_computed
        out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0]
        computed = engine.scheduler.stats().prompt_tokens_computed - before
        assert computed == len(prompt) - out.num_cached_tokens
        if turn > 0:
            # everything but the last partial block of what the previous turn left in the cache
            assert out.num_cached_tokens >= (previous_len // 16) * 16 - 16
            assert computed < len(prompt) - previous_len + 32
        previous_len = len(prompt) + len(out.token_ids)
        messages.append({"role": "assistant", "content": out.text})
    _assert_clean(engine)


def test_idle_agent_session_comes_back_from_the_host_cache_tier(llm, prompts):
    """A device pool that holds one conversation at a time and a host tier: between turns other
    traffic evicts the session's blocks, which are saved to host memory and copied back on the
    next turn, so turns 2.. compute only their new tokens, with the big pool's exact outputs."""
    tok = llm.tokenizer
    tiered = LLM("default", num_blocks=24, host_cache_gb=0.1)
    engine = tiered.engine
    messages = [{"role": "system", "content": "You are a tool-using agent. Tools: search(q), calc(expr). " * 3}]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for turn in range(4):
        messages.append({"role": "user", "content": f"Tool result {turn}: value={turn * 17}. Next step?"})
        prompt = tok.apply_chat_template(messages)
        before = engine.scheduler.stats()
        out = tiered.generate([prompt], params, use_tqdm=False)[0]
        after = engine.scheduler.stats()
        assert out.token_ids == llm.generate([prompt], params, use_tqdm=False)[0].token_ids
        assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(prompt) - out.num_cached_tokens
        if turn > 0:
            assert after.host_cache_hits > before.host_cache_hits  # it came back from host memory
            assert out.num_cached_tokens >= (previous_len // 16) * 16 - 16
        previous_len = len(prompt) + len(out.token_ids)
        messages.append({"role": "assistant", "content": out.text})
        # other traffic fills the device pool (no prefix in common with the session)
        filler = tok.encode(f"Report {turn}. " + "The river rose and the fields flooded again. " * 40)[:360]
        tiered.generate([filler], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    stats = engine.scheduler.stats()
    assert stats.offloaded_blocks > 0 and stats.reloaded_blocks > 0
    assert stats.host_cache_slots == engine.runner.num_host_cache_slots > 0
    _assert_clean(engine)


def test_an_8bit_cache_goes_to_the_host_tier_and_to_swap_as_it_is(prompts):
    """int8 KV: blocks evicted to the host tier and copied back, and a preempted request's blocks
    swapped out and in, are the bytes they were (scales included), so outputs equal a big int8 pool's."""
    big = LLM("default", kv_cache_dtype="int8")
    assert big.engine.runner.kv_cache.data.dtype == torch.uint8
    tok = big.tokenizer
    tiered = LLM("default", kv_cache_dtype="int8", num_blocks=24, host_cache_gb=0.05)
    system = "You are a tool-using agent. Tools: search(q), calc(expr). " * 3
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for turn in range(2):
        prompt = tok.apply_chat_template([{"role": "system", "content": system},
                                          {"role": "user", "content": f"Tool result {turn}: value={turn}."}])
        assert tiered.generate([prompt], params, use_tqdm=False)[0].token_ids == \
            big.generate([prompt], params, use_tqdm=False)[0].token_ids
        filler = tok.encode(f"Report {turn}. " + "The river rose and the fields flooded again. " * 40)[:360]
        tiered.generate([filler], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    stats = tiered.engine.scheduler.stats()
    assert stats.offloaded_blocks > 0 and stats.host_cache_hits > 0
    _assert_clean(tiered.engine)
    tiered.close()
    swapping = LLM("default", kv_cache_dtype="int8", num_blocks=12, preemption_mode="swap", swap_space_gb=0.05,
                   enable_prefix_caching=False)
    many = [p[:40] for p in prompts[:4]]
    expected = [o.token_ids for o in big.generate(many, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in swapping.generate(many, GREEDY, use_tqdm=False)] == expected
    stats = swapping.engine.scheduler.stats()
    assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks > 0
    _assert_clean(swapping.engine)
    swapping.close()
    big.close()


def test_seeded_sampling_is_reproducible_across_batches(llm, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate([prompts[0]], params, use_tqdm=False)[0].token_ids
    mixed = llm.generate([prompts[1], prompts[0], prompts[2]],
                         [SamplingParams(max_tokens=12, temperature=1.0), params, GREEDY], use_tqdm=False)[1]
    assert mixed.token_ids == alone
    other = llm.generate([prompts[0]], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=99),
                         use_tqdm=False)[0].token_ids
    assert other != alone


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.95, seed=7,
                                                            frequency_penalty=0.5, ignore_eos=True)],
                         ids=["greedy", "seeded-with-penalty"])
def test_a_resumed_request_continues_exactly(llm, prompts, params):
    """A migrated generation: the tokens already delivered come back as the prompt's tail
    (`num_resumed_tokens`) and count as outputs, so the continuation is the uninterrupted one."""
    engine = llm.engine
    full = llm.generate([prompts[2]], params, use_tqdm=False)[0].token_ids
    delivered = full[:11]
    request = engine.make_request(prompts[2] + delivered, params, num_resumed_tokens=len(delivered))
    assert request.num_prompt_tokens == len(prompts[2]) and request.output_token_ids == delivered
    engine.add(request)
    streamed = []
    while engine.has_unfinished():
        for delta in engine.step():
            streamed.extend(delta.new_token_ids)
            if delta.finished:
                assert delta.num_prompt_tokens == len(prompts[2])
    assert streamed == full[11:]  # only what comes after the delivered tokens, max_tokens counted
    with pytest.raises(ValueError, match="leaves none to generate"):
        engine.add(engine.make_request(prompts[2] + full, params, num_resumed_tokens=len(full)))
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.make_request(delivered, params, num_resumed_tokens=len(delivered))
    _assert_clean(engine)


def test_stop_string_and_logprobs(llm, prompts, reference):
    full = llm.tokenizer.decode(reference[3])
    stop = full[10:14]
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=NEW, temperature=0.0, stop=[stop], logprobs=2),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == full[:full.index(stop)]
    assert len(out.logprobs) == len(out.token_ids)
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in out.logprobs)
    _assert_clean(llm.engine)


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_as_stop(llm, prompts, reference):
    """The token that completes a stop string is also the max_tokens-th: the text is cut at the
    stop, so the reason is "stop", not "length"."""
    tok = llm.tokenizer
    k = next(k for k in range(6, NEW) if len(tok.decode(reference[3][:k])) >= 4
             and tok.decode(reference[3][:k])[-3:] not in tok.decode(reference[3][:k - 1]))
    text = tok.decode(reference[3][:k])
    stop = text[-3:]
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=k, temperature=0.0, stop=[stop]), use_tqdm=False)[0]
    assert (out.finish_reason, out.text) == ("stop", text[:text.index(stop)])
    assert len(out.token_ids) == k
    _assert_clean(llm.engine)


def test_the_stop_token_that_ended_the_output_is_not_in_its_text(llm, prompts, reference):
    """As in vLLM: the stop token id's text is left out unless include_stop_str_in_output (the
    token itself is among the output's tokens either way)."""
    tok = llm.tokenizer
    stop_id = reference[3][5]
    end = reference[3].index(stop_id) + 1
    for include in (False, True):
        params = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=[stop_id],
                                include_stop_str_in_output=include)
        out = llm.generate([prompts[3]], params, use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.token_ids == reference[3][:end]
        assert out.text == tok.decode(reference[3][:end if include else end - 1])
    _assert_clean(llm.engine)


def test_bad_requests_are_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 10000], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM("default", block_sise=16)


def test_a_refused_prompt_in_a_batch_leaves_nothing_behind():
    """generate() whose second prompt is refused when added (larger than this KV cache, within
    the context): the error, and neither the first prompt nor its detokenizer stays in the
    engine, so the next call works."""
    with LLM("default", num_blocks=8, block_size=16) as small:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        with pytest.raises(ValueError):
            small.generate([[5] * 10, [7] * 200], params, use_tqdm=False)
        _assert_clean(small.engine)
        assert small.engine._detokenizers == {}
        [output] = small.generate([[9] * 10], params, use_tqdm=False)
        assert len(output.token_ids) == 4
        _assert_clean(small.engine)


def test_async_engine_streams_and_aborts(llm, prompts, reference):
    engine = AsyncEngine(llm.engine)

    async def abort_early(prompt):
        async for delta in engine.generate(prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)):
            if delta.new_token_ids:
                break  # the caller goes away: the request must be aborted and its blocks freed

    async def main():
        results = await asyncio.gather(collect_tokens(engine, prompts[0], GREEDY),
                                       collect_tokens(engine, prompts[4], GREEDY), abort_early(prompts[1]))
        await asyncio.sleep(0.2)
        return results

    try:
        results = asyncio.run(main())
        assert results[0] == reference[0] and results[1] == reference[4]
        stats = engine.call(lambda e: e.scheduler.stats()).result(timeout=30)
        assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    finally:
        engine.shutdown()


def test_hand_over_ends_every_open_stream_unfinished_and_frees_its_blocks(llm, prompts):
    """A draining worker's streams end without a finish (the router resumes them elsewhere)."""
    engine = AsyncEngine(llm.engine)
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def read(prompt, started):
        got = []
        async for delta in engine.generate(prompt, long):
            got += delta.new_token_ids
            started.set()
            assert not delta.finished
        return got

    async def main():
        started = [asyncio.Event(), asyncio.Event()]
        readers = [asyncio.ensure_future(read(p, e)) for p, e in zip(prompts[:2], started)]
        await asyncio.gather(*(e.wait() for e in started))
        assert engine.hand_over() == 2
        got = await asyncio.wait_for(asyncio.gather(*readers), 30)
        await asyncio.sleep(0.2)  # the aborts reach the engine thread
        return got

    try:
        got = asyncio.run(main())
        assert all(0 < len(tokens) < 500 for tokens in got)
        stats = engine.call(lambda e: e.scheduler.stats()).result(timeout=30)
        assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    finally:
        engine.shutdown()


def test_async_engine_stats_answer_at_once_while_the_engine_thread_is_busy(llm, prompts):
    """Health polls read a snapshot the engine thread publishes, never waiting behind a step; a
    request's counters are in it before its first token reaches the caller."""
    import threading
    engine = AsyncEngine(llm.engine)
    try:
        gate = threading.Event()
        blocker = engine.call(lambda e: gate.wait(30))  # the engine thread is busy from here on
        stats, queued = engine.stats()
        assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total and queued == 0
        gate.set()
        blocker.result(timeout=30)

        async def stats_at_first_token():
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            first = None
            async for delta in engine.generate(prompts[0], params):  # to the end: nothing left behind
                if delta.new_token_ids and first is None:
                    first = engine.stats()
            return first

        stats, _ = asyncio.run(stats_at_first_token())
        assert stats.running == 1 and stats.kv_blocks_free < stats.kv_blocks_total
    finally:
        engine.shutdown()
    with pytest.raises(EngineUnavailable, match="shut down"):
        engine.stats()


def test_async_engine_stats_fail_once_the_engine_loop_died(llm, prompts, monkeypatch):
    def broken_step():
        raise RuntimeError("injected failure")

    monkeypatch.setattr(llm.engine, "run_batch", broken_step)
    engine = AsyncEngine(llm.engine)
    request_id = "dies"

    async def run():
        with pytest.raises(EngineUnavailable, match="engine loop died"):
            async for _ in engine.generate(prompts[0], GREEDY, request_id=request_id):
                pass

    async def run_again():
        async for _ in engine.generate(prompts[0], GREEDY, request_id="after"):
            pass

    try:
        asyncio.run(run())
        with pytest.raises(EngineUnavailable, match="engine loop died: injected failure"):
            engine.stats()
        with pytest.raises(EngineUnavailable, match="engine loop died"):  # no new work is accepted
            asyncio.run(run_again())
        with pytest.raises(EngineUnavailable, match="engine loop died"):  # nor left waiting
            engine.call(lambda e: None).result(timeout=30)
    finally:
        engine.shutdown()
        llm.engine.abort(request_id)  # the dead loop left it in the shared engine's scheduler


def test_shutdown_ends_open_streams_and_fails_later_calls(llm, prompts):
    """Shut down under an open stream: its reader gets an error instead of waiting for good, and
    a call made afterwards fails at once instead of sitting in the inbox."""
    engine = AsyncEngine(llm.engine)
    request_id = "open-at-shutdown"

    async def run():
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        with pytest.raises(EngineUnavailable, match="engine is shut down"):
            async for delta in engine.generate(prompts[0], params, request_id=request_id):
                if delta.new_token_ids:
                    await asyncio.to_thread(engine.shutdown)

    try:
        asyncio.run(asyncio.wait_for(run(), 120))
        with pytest.raises(EngineUnavailable, match="engine is shut down"):
            engine.call(lambda e: 1).result(timeout=5)
    finally:
        engine.shutdown()
        llm.engine.abort(request_id)  # left in the shared engine's scheduler


def test_a_call_whose_loop_fails_after_it_ran_is_answered_not_left_waiting(llm):
    """The engine loop fails right after a call ran (a bug in its bookkeeping): the call's caller
    gets the error instead of waiting for good."""
    engine = AsyncEngine(llm.engine)

    def broken():
        raise RuntimeError("injected failure")

    engine._abort_added = broken  # runs after every call, on the engine thread
    try:
        with pytest.raises(EngineUnavailable, match="engine loop died during this call"):
            engine.call(lambda e: 1).result(timeout=30)
        with pytest.raises(EngineUnavailable, match="engine loop died: injected failure"):
            engine.stats()
    finally:
        engine.shutdown()


def test_async_engine_survives_a_cancelled_call(llm, prompts, reference):
    """A caller that cancels its `call` future before the engine thread runs it must not stop the
    engine loop (it once died with InvalidStateError and failed every open stream)."""
    engine = AsyncEngine(llm.engine)
    try:
        gate = __import__("threading").Event()
        blocker = engine.call(lambda e: gate.wait(10))  # keeps the engine thread busy
        cancelled = engine.call(lambda e: e.scheduler.stats())
        assert cancelled.cancel()
        gate.set()
        blocker.result(timeout=30)

        async def collect():
            tokens = []
            async for delta in engine.generate(prompts[0], GREEDY):
                tokens.extend(delta.new_token_ids)
            return tokens

        assert asyncio.run(collect()) == reference[0]
    finally:
        engine.shutdown()


def test_prompt_logprobs_match_transformers_with_chunks_and_a_cached_prefix(prompts):
    """prompt_logprobs: entry p is log P(prompt[p] | prompt[:p]) of the raw model, within 1e-4 of
    transformers' in fp32, with the top k at each position; the prompt is computed whole even when
    the prefix cache holds it (a second request with the same prefix), and in chunks of 16 tokens."""
    llm = LLM("default", max_num_batched_tokens=16, num_blocks=256)  # every prompt prefilled in chunks
    prompt = prompts[0] + prompts[3]
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("default").model_dir,
                                                           torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    warm = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    assert warm.prompt_logprobs is None
    [out] = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3), use_tqdm=False)
    assert out.num_cached_tokens == 0  # not read from the prefix cache the first request filled
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry = entries[p]
        assert entry.token_id == prompt[p]
        assert entry.logprob == pytest.approx(float(want[p - 1, prompt[p]]), abs=1e-4)
        top_values, top_ids = want[p - 1].topk(3)
        assert [t for t, _ in entry.top_logprobs] == top_ids.tolist()
        assert [v for _, v in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
    _assert_clean(llm.engine)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
