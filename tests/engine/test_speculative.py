"""Speculative decoding (engine/speculative.py): the n-gram proposer, the acceptance rule, the
scheduler's drafts (fake runner: outputs, blocks, limits, preemption), and with real models that
outputs do not change: greedy, seeded and logprob outputs are identical with and without it, and
unseeded sampling keeps its distribution (a chi-square test on a tiny model)."""
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.request import Request
from engine.scheduler import Scheduler
from engine.speculative import NgramProposer, accepted_length
from engine.structured_output import StructuredOutput
from tests.engine.fake_runner import VOCAB_SIZE, FakeModelRunner, next_token, reference_generate, run_until_done, step
from tests.engine.tiny_models import save_tiny_model, tiny_config

BS = 4
NGRAM = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=4)


# ---- the proposer and the rule ------------------------------------------------------------------

def test_ngram_takes_the_longest_suffix_then_its_most_recent_occurrence():
    proposer = NgramProposer(min_n=1, max_n=3)
    # suffix [1, 2, 3] occurred once (followed by 40, 41); the 2-gram [2, 3] more recently (-> 50)
    tokens = [1, 2, 3, 40, 41, 9, 2, 3, 50, 51, 7, 1, 2, 3]
    assert proposer.lookup(tokens, 4) == [40, 41, 9, 2]
    assert proposer.lookup(tokens, 1) == [40]
    # only the 1-gram [3] matches: its most recent earlier occurrence is followed by 50
    assert proposer.lookup([1, 2, 3, 50, 8, 9, 3], 2) == [50, 8]
    assert NgramProposer(min_n=2, max_n=3).lookup([1, 2, 3, 50, 8, 9, 3], 2) == []
    # the continuation may run into the suffix itself (a repeating pattern), never past the end
    assert proposer.lookup([5, 6, 5, 6, 5], 4) == [6, 5]
    assert proposer.lookup([7], 4) == [] and proposer.lookup([7, 7], 4) == [7]
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(min_n=3, max_n=2)


def test_accepted_length_is_the_matching_prefix_plus_one():
    assert accepted_length([], [9]) == 1
    assert accepted_length([4, 5, 6], [4, 5, 6, 7]) == 4  # all accepted, plus the token after them
    assert accepted_length([4, 5, 6], [4, 8, 6, 7]) == 2  # 4 accepted, then 8 instead of 5
    assert accepted_length([4, 5, 6], [1, 5, 6, 7]) == 1


def test_speculative_config_and_flags_are_checked():
    with pytest.raises(ValueError, match="speculative_method must be one of ngram"):
        SpeculativeConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 16\]"):
        SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_max must be an integer >= prompt_lookup_min"):
        SpeculativeConfig(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative must be true or false"):
        SamplingParams(speculative="no")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_speculation_with_an_8bit_kv_cache_is_refused(kv_cache_dtype):
    """A rejected draft's K/V can grow its block's 8-bit scale (re-rounding the tokens before it),
    which changed greedy outputs: the pair is refused rather than served inexact."""
    from engine.llm import build_engine_config
    with pytest.raises(ValueError, match="speculative decoding is not supported with an 8-bit KV cache"):
        build_engine_config("default", speculative_method="ngram", kv_cache_dtype=kv_cache_dtype)
    assert build_engine_config("default", kv_cache_dtype=kv_cache_dtype).cache.kv_cache_dtype == kv_cache_dtype


# ---- the scheduler's drafts, with a fake runner -----------------------------------------------

class OracleProposer:
    """Proposes the true continuation (the fake model's), wrong at draft index `wrong_at` of every
    `wrong_every`-th draft, so that steps accept everything, a prefix, or nothing."""

    def __init__(self, wrong_at=2, wrong_every=3):
        self.wrong_at, self.wrong_every, self.calls, self.limits = wrong_at, wrong_every, 0, []

    def propose(self, requests, limits):
        drafts = []
        for request, k in zip(requests, limits):
            self.calls += 1
            self.limits.append((request.num_output_tokens, request.num_tokens, request.sampling_params.max_tokens, k))
            draft = reference_generate(request.all_token_ids, k)
            if self.calls % self.wrong_every == 0 and self.wrong_at < len(draft):
                draft[self.wrong_at] = (draft[self.wrong_at] + 1) % 1000
            drafts.append(draft)
        return drafts


def scheduler_with(proposer=None, speculative=NGRAM, num_blocks=64, budget=64, max_seqs=8, role="both",
                   max_model_len=256):
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                          CacheConfig(block_size=BS), num_blocks, max_model_len, role=role,
                          speculative=speculative, proposer=proposer)
    return scheduler, FakeModelRunner(num_blocks, BS)


def req(request_id, prompt, max_tokens=8, eos=(), **params):
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   eos_token_ids=set(eos))


def prompt_of(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


def assert_all_free(scheduler):
    scheduler.check_integrity()
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_drafts_give_the_same_outputs_in_fewer_steps_and_are_counted():
    prompts = {f"r{i}": prompt_of(i, 6 + 5 * i) for i in range(4)}
    plain, plain_runner = scheduler_with(speculative=None)
    spec, spec_runner = scheduler_with(OracleProposer())
    for scheduler in (plain, spec):
        for request_id, prompt in prompts.items():
            scheduler.add_request(req(request_id, prompt, max_tokens=30))
    expected = run_until_done(plain, plain_runner)
    got = run_until_done(spec, spec_runner)
    for request_id, prompt in prompts.items():
        assert got[request_id].new_token_ids == expected[request_id].new_token_ids == reference_generate(prompt, 30)
        assert got[request_id].finish_reason == "length"
    assert len(spec_runner.batches) < len(plain_runner.batches) / 2
    stats = spec.stats()
    assert stats.spec_drafts > 0 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert plain.stats().spec_drafts == 0
    assert any(seq.draft_token_ids for batch in spec_runner.batches for seq in batch.seqs)
    assert_all_free(spec)


def test_a_draft_never_passes_max_tokens_the_context_or_the_budget():
    proposer = OracleProposer(wrong_every=10**9)  # always right: every step takes its whole draft
    scheduler, runner = scheduler_with(proposer, max_model_len=20)
    scheduler.add_request(req("short", prompt_of(1, 5), max_tokens=7))
    scheduler.add_request(req("long", prompt_of(2, 10), max_tokens=50))
    finals = run_until_done(scheduler, runner)
    assert finals["short"].new_token_ids == reference_generate(prompt_of(1, 5), 7)
    assert finals["long"].new_token_ids == reference_generate(prompt_of(2, 10), 10)  # 20 tokens of context
    assert finals["long"].finish_reason == "length"
    # a draft of k tokens yields up to k + 1: never past max_tokens, nor past 20 positions
    assert all(outputs + k < max_tokens and length + k <= 20 for outputs, length, max_tokens, k in proposer.limits)
    limits = {k for *_, k in proposer.limits}
    assert 4 in limits and min(limits) < 4  # cut by max_tokens and by the context
    assert all(seq.start + seq.num_new_tokens <= 20 for batch in runner.batches for seq in batch.seqs)
    # a budget of 3 tokens: two decodes and one draft token
    scheduler, runner = scheduler_with(OracleProposer(wrong_every=10**9), budget=3)
    scheduler.add_request(req("a", [1, 2], max_tokens=12))
    scheduler.add_request(req("b", [3, 4], max_tokens=12))
    for _ in range(3):
        batch, _ = step(scheduler, runner)
        assert batch.num_tokens <= 3
    assert sum(len(seq.draft_token_ids) for seq in batch.seqs) == 1
    run_until_done(scheduler, runner)
    assert_all_free(scheduler)


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there():
    prompt = prompt_of(3, 8)
    reference = reference_generate(prompt, 12)
    scheduler, runner = scheduler_with(OracleProposer(wrong_every=10**9))
    scheduler.add_request(req("eos", prompt, max_tokens=12, eos=[reference[5]]))
    finals = run_until_done(scheduler, runner)
    assert finals["eos"].new_token_ids == reference[:reference.index(reference[5]) + 1]
    assert finals["eos"].finish_reason == "stop"
    assert_all_free(scheduler)


class AnyText:
    """A grammar state (engine/structured_output.py) that allows every token."""
    rejected_token = None
    is_terminated = False

    def accept(self, token_id):
        pass


def test_who_speculates():
    proposer = OracleProposer()
    scheduler, runner = scheduler_with(proposer)
    scheduler.add_request(req("opted-out", prompt_of(4, 6), speculative=False))
    scheduler.add_request(req("grammar", prompt_of(5, 6), structured_output=StructuredOutput.json_object()))
    scheduler.get_request("grammar").grammar = AnyText()  # stands for a compiled grammar: no drafts either
    scheduler.add_request(req("plain", prompt_of(6, 6)))
    step(scheduler, runner)
    batch, _ = step(scheduler, runner)
    drafted = {seq.request.request_id for seq in batch.seqs if seq.draft_token_ids}
    assert drafted == {"plain"}
    for request_id in scheduler.request_ids():
        scheduler.abort(request_id)
    # above the batch-size cap nobody drafts; a prefill-role scheduler never does
    capped = SpeculativeConfig(speculative_method="ngram", speculative_disable_by_batch_size=1)
    scheduler, runner = scheduler_with(OracleProposer(), speculative=capped)
    scheduler.add_request(req("a", prompt_of(7, 6), max_tokens=4))
    scheduler.add_request(req("b", prompt_of(8, 6), max_tokens=4))
    run_until_done(scheduler, runner)
    assert scheduler.stats().spec_drafts == 0
    assert scheduler_with(OracleProposer(), role="prefill")[0].proposer is None


def test_drafts_under_preemption_keep_outputs_and_blocks_exact():
    """Few blocks: drafts that cannot get their slots are dropped, decodes preempt each other,
    and every output is still the reference."""
    scheduler, runner = scheduler_with(OracleProposer(wrong_at=1, wrong_every=2), num_blocks=14, budget=16)
    prompts = {f"p{i}": prompt_of(10 + i, 7 + i) for i in range(4)}
    for request_id, prompt in prompts.items():
        scheduler.add_request(req(request_id, prompt, max_tokens=14))
    finals = run_until_done(scheduler, runner)
    for request_id, prompt in prompts.items():
        assert finals[request_id].new_token_ids == reference_generate(prompt, 14)
    assert scheduler.stats().num_preemptions > 0 and scheduler.stats().spec_drafts > 0
    assert_all_free(scheduler)


class AlwaysWrong:
    """Drafts that are always rejected (the fake model never continues with 1, 2, 3)."""

    def propose(self, requests, limits):
        return [[1, 2, 3][:k] for k in limits]


def test_a_rejected_drafts_blocks_go_back_at_once():
    """The slots of rejected draft tokens held their blocks until the request grew into them:
    blocks that another request could be preempted for."""
    scheduler, runner = scheduler_with(AlwaysWrong(), num_blocks=4, budget=4)
    scheduler.add_request(req("d", range(10, 14), max_tokens=6))
    step(scheduler, runner)
    decoding = scheduler.get_request("d")
    scheduler.add_request(Request("p", list(range(50, 55)), SamplingParams(max_tokens=2, temperature=0.0), priority=1))
    while scheduler.has_unfinished():
        step(scheduler, runner)
        if not decoding.is_finished:
            assert len(decoding.block_ids) == scheduler.block_manager.blocks_needed(decoding.num_tokens)
    assert scheduler.stats().spec_drafts > 0
    assert decoding.output_token_ids == reference_generate(list(range(10, 14)), 6)
    assert_all_free(scheduler)


def test_drafts_never_take_the_blocks_a_running_prompts_chunk_needs():
    """Drafts are added before this step's running prompt chunks: a draft that took the last
    free block made the chunk after it preempt. With drafts that are always rejected (the
    requests grow exactly as without speculation), the preemptions and recomputed tokens are
    the same as without speculation."""
    def run(**options):
        scheduler, runner = scheduler_with(num_blocks=6, budget=8, max_model_len=64, **options)
        scheduler.add_request(req("A", prompt_of(1, 7), max_tokens=12))
        scheduler.add_request(req("B", prompt_of(2, 12), max_tokens=12))
        outputs = {r.request_id: r for r in (scheduler.get_request("A"), scheduler.get_request("B"))}
        while scheduler.has_unfinished():
            step(scheduler, runner)
        stats = scheduler.stats()
        assert_all_free(scheduler)
        return ({i: r.output_token_ids for i, r in outputs.items()}, stats.num_preemptions,
                stats.prompt_tokens_computed, stats.spec_drafts)

    class FirstTokenWrong:  # full-length drafts whose first token the fake model never samples
        def propose(self, requests, limits):
            return [[(next_token(r.all_token_ids) + 1) % VOCAB_SIZE] * k for r, k in zip(requests, limits)]

    plain = run(speculative=None)
    drafted = run(proposer=FirstTokenWrong())
    assert drafted[3] > 0  # drafts ran
    assert drafted[:3] == plain[:3]


# ---- real models: outputs are unchanged ---------------------------------------------------------

CODE = """def total(items):
    result = 0
    for item in items:
        result += item.price * item.quantity
    return result
"""
REPETITIVE = [
    [{"role": "user", "content": "Rewrite this function with the variable result renamed to acc:\n" + CODE}],
    [{"role": "user", "content": 'Repeat exactly: {"id": 7, "name": "Ada", "tags": ["x", "y"], "ok": true}'}],
    "one two three four five one two three four five one two three",
]


@pytest.fixture(scope="module")
def default_pair():
    """The default model without and with n-gram speculation."""
    return (LLM("default", num_blocks=256),
            LLM("default", num_blocks=256, speculative_method="ngram", num_speculative_tokens=4))


def _generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_greedy_outputs_and_logprobs_are_identical_with_speculation(default_pair):
    plain, spec = default_pair
    params = [SamplingParams(max_tokens=48, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3),
              SamplingParams(max_tokens=40, temperature=0.0, min_tokens=30, stop=[" one two three five one two"])]
    before = spec.engine.scheduler.stats()
    expected = _generate(plain, REPETITIVE, params)
    got = _generate(spec, REPETITIVE, params)
    after = spec.engine.scheduler.stats()
    for mine, theirs in zip(got, expected):
        assert mine.token_ids == theirs.token_ids
        assert mine.text == theirs.text and mine.finish_reason == theirs.finish_reason
    assert expected[2].finish_reason == "stop"  # the stop string cut a speculative step's tokens
    for mine, theirs in zip(got[0].logprobs, expected[0].logprobs):
        assert mine.token_id == theirs.token_id and mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top_logprobs] == [t for t, _ in theirs.top_logprobs] and len(mine.top_logprobs) == 2
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert drafted > 0 and accepted > drafted / 4  # these outputs copy their prompts
    assert spec.engine.scheduler.block_manager.num_free_blocks == spec.engine.scheduler.block_manager.num_blocks


def test_seeded_sampling_is_identical_with_speculation(default_pair):
    """The acceptance rule draws each position with that position's seeded uniform, so a seeded
    request gives the tokens it gives without speculation."""
    plain, spec = default_pair
    params = [SamplingParams(max_tokens=40, temperature=t, seed=s, top_p=0.95)
              for t, s in ((0.3, 1), (0.7, 2), (1.0, 3))]
    expected = _generate(plain, REPETITIVE, params)
    got = _generate(spec, REPETITIVE, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def _bigram(model):
    """Make the tiny model a bigram model: attention and MLP add nothing, so the logits depend on
    the last token only. From token t (2 <= t < 60): t again (logit 6), t + 1 (5.5), t + 2 (4.5),
    anything else (0). Peaked but never certain, so drafts are accepted and rejected often."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    embedding = model.model.embed_tokens.weight
    embedding.zero_()
    for token in range(embedding.shape[0]):
        embedding[token, token % 64] = 1.0  # RMSNorm makes it sqrt(64) = 8
    model.model.norm.weight.fill_(1.0)
    head = model.lm_head.weight
    head.zero_()
    for token in range(2, 60):
        for following, logit in ((token, 6.0), (token + 1, 5.5), (token + 2, 4.5)):
            head[following, token] = logit / 8.0


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("bigram"), tiny_config(tie_word_embeddings=False), edit=_bigram)
    common = dict(num_blocks=512, block_size=4, max_num_seqs=256, max_num_batched_tokens=4096, seed=11)
    return (LLM(folder, **common),
            LLM(folder, **common, speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1))


def _histograms(outputs, positions):
    return [torch.bincount(torch.tensor([o.token_ids[p] for o in outputs]), minlength=128) for p in positions]


def _homogeneity_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two samples of counts come from one distribution (categories with
    fewer than 10 observations pooled)."""
    a, b = a.double(), b.double()
    total = a + b
    keep = total >= 10
    a = torch.cat([a[keep], a[~keep].sum()[None]])
    b = torch.cat([b[keep], b[~keep].sum()[None]])
    total = a + b
    a, b, total = a[total > 0], b[total > 0], total[total > 0]
    expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    statistic = float(((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum())
    dof = len(total) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(statistic / 2.0, dtype=torch.float64)))


def test_unseeded_sampling_keeps_its_distribution(tiny_pair):
    """600 unseeded samples of output positions 1-3 (drafted ones; position 0 has no draft), with
    and without speculation: a chi-square test cannot tell them apart, while the same test does
    tell temperature 1.0 from 1.2 (so it can fail). The prompt (2 2 3 3 ... 19 19) walks the
    bigram model's likely paths, so drafts are often right and often wrong."""
    plain, spec = tiny_pair
    prompt = [token for token in range(2, 20) for _ in range(2)]
    count, positions = 600, (1, 2, 3)

    def sample(llm, temperature):
        return _generate(llm, [prompt] * count, SamplingParams(max_tokens=4, temperature=temperature,
                                                               ignore_eos=True))

    before = spec.engine.scheduler.stats()
    with_spec = _histograms(sample(spec, 1.0), positions)
    after = spec.engine.scheduler.stats()
    without = _histograms(sample(plain, 1.0), positions)
    hotter = _histograms(sample(plain, 1.2), positions)
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert drafted > count / 2 and 0.2 < accepted / drafted < 0.8  # both branches of the rule ran, often
    for position, (a, b) in zip(positions, zip(with_spec, without)):
        assert _homogeneity_p_value(a, b) > 1e-3, f"output position {position}"
    assert min(_homogeneity_p_value(a, b) for a, b in zip(hotter, without)) < 1e-3
