"""The step-time target (`max_step_ms`): the cost model learns a step's cost from the steps that
ran, and the scheduler sizes prefill chunks from it while decodes run."""
import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_cost import StepCostModel
from tests.engine.fake_runner import FakeModelRunner, reference_generate, run_until_done, step

BASE, PER_DECODE, PER_TOKEN = 0.002, 0.0005, 0.00005  # seconds


def cost(decodes: int, prefill: int) -> float:
    return BASE + PER_DECODE * decodes + PER_TOKEN * prefill


def trained(model: StepCostModel, steps: int = 60, noise: float = 0.02) -> StepCostModel:
    rng = random.Random(0)
    for _ in range(steps):
        decodes, prefill = rng.randint(0, 32), rng.choice([0, 0, rng.randint(16, 512)])
        model.observe(decodes, prefill, cost(decodes, prefill) * (1 + rng.uniform(-noise, noise)))
    return model


def test_the_model_learns_the_cost_of_a_step_and_the_prefill_that_fits_a_target():
    model = trained(StepCostModel())
    base, per_decode, per_token, _ = model.coefficients()
    assert base == pytest.approx(BASE, rel=0.2) and per_decode == pytest.approx(PER_DECODE, rel=0.1)
    assert per_token == pytest.approx(PER_TOKEN, rel=0.05)
    # 10 ms with 8 decodes: (10 - 2 - 4) ms / 0.05 ms per token = 80 tokens
    assert model.prefill_budget(8, 0.010) == pytest.approx(80, abs=8)
    assert model.prefill_budget(100, 0.010) == model.min_tokens  # over the target already: still progress


def test_probe_chunks_until_prefill_steps_were_seen():
    model = StepCostModel(min_tokens=16, min_prefill_steps=4)
    for _ in range(50):
        model.observe(8, 0, cost(8, 0))  # decode-only steps say nothing about prefill tokens
    assert model.coefficients() is None and model.prefill_budget(8, 0.010) == 64
    for _ in range(4):
        model.observe(8, 64, cost(8, 64))
    assert model.prefill_budget(8, 0.010) == pytest.approx(80, abs=2)  # (10 - 2 - 4) ms / 0.05 ms per token
    free = StepCostModel(min_prefill_steps=1)
    free.observe(8, 64, 0.001)
    free.observe(8, 0, 0.002)
    assert free.prefill_budget(8, 0.010) is None  # prefill tokens look free: no cap


def req(request_id: str, length: int, max_tokens: int) -> Request:
    prompt = [(7 * i + len(request_id)) % 97 + 3 for i in range(length)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_draft_tokens_are_decode_work_not_prompt_tokens():
    """Speculative decoding: a decode with a 4-token draft runs 5 rows, nearly as cheap as one in a
    memory-bound step. Counted as prompt tokens they made prompt tokens look 10x dearer and ended
    the probe phase with no prompt run at all."""
    per_draft = 0.00001
    model = StepCostModel(min_tokens=16, min_prefill_steps=4)
    for _ in range(50):  # decode-only steps, every decode drafting 4 tokens
        model.observe(8, 0, cost(8, 0) + per_draft * 32, drafts=32)
    assert model.coefficients() is None  # still probing: no prompt token has run
    rng = random.Random(1)
    for _ in range(60):
        decodes, prefill = rng.randint(1, 32), rng.choice([0, rng.randint(16, 512)])
        drafts = rng.randint(0, 4 * decodes)  # some proposals come back empty
        model.observe(decodes, prefill, cost(decodes, prefill) + per_draft * drafts, drafts=drafts)
    _, _, per_token, learned_draft = model.coefficients()
    assert per_token == pytest.approx(PER_TOKEN, rel=0.05) and learned_draft == pytest.approx(per_draft, rel=0.2)
    # 10 ms with 8 decodes and their 32 draft tokens: (10 - 2 - 4 - 0.32) ms / 0.05 ms = 73 tokens
    assert model.prefill_budget(8, 0.010, drafts=32) == pytest.approx(73, abs=4)


def test_the_scheduler_caps_prefill_chunks_only_while_decodes_run_and_outputs_are_unchanged():
    block = 4
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_step_ms=10.0), CacheConfig(block_size=block),
                          256, 1024)
    runner = FakeModelRunner(256, block)
    trained(scheduler.step_cost)
    cap = scheduler.step_cost.prefill_budget(1, 0.010)
    assert 100 < cap < 512  # (10 - 2 - 0.5) ms / 0.05 ms = 150 tokens
    scheduler.add_request(req("first", 400, 40))
    batch, _ = step(scheduler, runner)  # nothing decodes yet: no cap, the whole prompt at once
    assert batch.num_tokens == 400 > cap
    long = req("long", 600, 4)
    scheduler.add_request(long)
    chunks = []
    while scheduler.get_request("long").num_computed_tokens < 600:
        batch, _ = step(scheduler, runner)
        chunks += [s.num_new_tokens for s in batch.seqs if s.request.request_id == "long"]
    assert all(c <= cap for c in chunks) and len(chunks) >= 4  # chunked next to the running decode
    run_until_done(scheduler, runner)
    assert long.output_token_ids == reference_generate(long.prompt_token_ids, 4)


def test_max_step_ms_must_be_positive():
    with pytest.raises(ValueError, match="max_step_ms must be > 0"):
        SchedulerConfig(max_step_ms=0)


def test_a_relative_target_caps_prefill_at_a_multiple_of_the_decode_step():
    model = trained(StepCostModel())
    # 8 decodes take 2 + 4 = 6 ms; ratio 2 leaves 6 ms for prefill: 6 / 0.05 = 120 tokens
    assert model.prefill_budget(8, None, ratio=2.0) == pytest.approx(120, abs=12)
    assert model.prefill_budget(8, 0.010, ratio=2.0) == pytest.approx(80, abs=8)  # the tighter target wins
    assert model.prefill_budget(8, None, ratio=float("inf")) is None  # inf: off
    assert model.prefill_budget(8, None, None) is None
    with pytest.raises(ValueError, match="max_step_ratio must be > 1"):
        SchedulerConfig(max_step_ratio=1.0)


def test_a_decode_role_worker_caps_its_local_prefill_relative_to_its_decodes_by_default():
    from engine.config import DECODE_ROLE_MAX_STEP_RATIO
    from engine.llm import build_engine_config
    assert build_engine_config(role="decode").scheduler.max_step_ratio == DECODE_ROLE_MAX_STEP_RATIO
    assert build_engine_config(role="decode", max_step_ms=300.0).scheduler.max_step_ratio is None
    off = build_engine_config(role="decode", max_step_ratio=float("inf")).scheduler
    assert off.max_step_ratio == float("inf") and not off.step_target_set  # nothing capped, nothing learned
    for role in ("both", "prefill"):
        assert build_engine_config(role=role).scheduler.step_target_set is False
    # a prefill worker lets short prompts pass a long one's chunks, by default
    from engine.config import PREFILL_ROLE_LONG_CHUNK_TOKENS
    assert build_engine_config(role="prefill", device="cpu").scheduler.long_prefill_chunk_tokens == \
        PREFILL_ROLE_LONG_CHUNK_TOKENS["cpu"] == 128
    assert build_engine_config(role="decode").scheduler.long_prefill_chunk_tokens is None
    assert build_engine_config(role="prefill", long_prefill_chunk_tokens=None).scheduler.long_prefill_chunk_tokens is None
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_step_ratio=2.0),
                          CacheConfig(block_size=4), 256, 1024)
    trained(scheduler.step_cost)
    runner = FakeModelRunner(256, 4)
    scheduler.add_request(req("first", 40, 40))
    step(scheduler, runner)
    long = req("long", 600, 4)
    scheduler.add_request(long)
    cap = scheduler.step_cost.prefill_budget(1, None, 2.0)
    batch, _ = step(scheduler, runner)
    assert [s.num_new_tokens for s in batch.seqs if s.request is long] == [cap]
    run_until_done(scheduler, runner)
    assert long.output_token_ids == reference_generate(long.prompt_token_ids, 4)
