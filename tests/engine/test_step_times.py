"""The step-time histogram (engine/step_times.py): every model step the engine times lands in its
kind's bucket, in the scheduler's stats and on the wire."""
from wire.stats import worker_stats_to_wire
from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_times import STEP_TIME_BUCKETS, StepTimeHistogram
from tests.engine.fake_runner import FakeModelRunner, step

BS = 4


def bucket(seconds: float) -> int:
    """The index of the first bound >= seconds (len(STEP_TIME_BUCKETS): above them all)."""
    return next((i for i, bound in enumerate(STEP_TIME_BUCKETS) if seconds <= bound), len(STEP_TIME_BUCKETS))


def test_a_value_lands_in_the_first_bucket_whose_bound_holds_it():
    histogram = StepTimeHistogram()
    for seconds in (0.0, STEP_TIME_BUCKETS[3], STEP_TIME_BUCKETS[3] + 1e-9, 60.0):
        histogram.observe("decode", seconds)
    counts, total = histogram.snapshot()["decode"]
    assert counts[0] == 1 and counts[3] == 1 and counts[4] == 1 and counts[-1] == 1 and sum(counts) == 4
    assert abs(total - (60.0 + 2 * STEP_TIME_BUCKETS[3])) < 1e-6
    assert sum(histogram.snapshot()["prefill"][0]) == 0


def test_the_scheduler_counts_prompt_steps_and_decode_steps_apart():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4), CacheConfig(block_size=BS),
                          32, 128)
    runner = FakeModelRunner(32, BS)
    scheduler.add_request(Request("a", list(range(1, 13)), SamplingParams(max_tokens=4, temperature=0.0)))
    kinds = []
    while scheduler.has_unfinished():
        batch, _ = step(scheduler, runner)
        prompt = any(seq.start < seq.request.num_prompt_tokens for seq in batch.seqs)
        seconds = 0.015 if prompt else 0.045  # what the engine would have timed
        scheduler.observe_step(batch, seconds)
        kinds.append("prefill" if prompt else "decode")
    # a 12-token prompt in 8-token steps: two prompt steps (the second samples token 1), then 3 decodes
    assert kinds == ["prefill", "prefill", "decode", "decode", "decode"]
    times = scheduler.stats().step_times
    assert times["prefill"][0][bucket(0.015)] == 2 and sum(times["prefill"][0]) == 2
    assert times["decode"][0][bucket(0.045)] == 3 and sum(times["decode"][0]) == 3
    assert abs(times["decode"][1] - 3 * 0.045) < 1e-12

    sent = worker_stats_to_wire("both", scheduler.stats(), 0, BS)
    by_kind = {entry.kind: entry for entry in sent.step_times}
    assert list(by_kind["decode"].bucket_counts) == times["decode"][0]
    assert by_kind["prefill"].sum_seconds == times["prefill"][1]
