"""How long the engine's model steps take, as a histogram per kind of step, for operators: the
router exports each worker's as `pdserve:worker_step_seconds{worker,role,kind}`, so an ITL tail
can be told apart from a slow step (the engine) and a slow path around it (the network, the
router, a CPU shared with other processes).

Kinds: "decode", a step of plain decodes only; "prefill", a step with prompt tokens (a prompt
or its chunk, with or without decodes beside it). A step's time is the model's forward with
sampling (`ModelRunner.execute`), what the scheduler's step-cost model learns from too.
Counts are per bucket (not cumulative), the last one above every bound, since the worker started.
"""
from __future__ import annotations

import bisect

STEP_KINDS: tuple[str, ...] = ("decode", "prefill")
# Upper bounds in seconds: a CPU decode step of the default model is 20-80 ms, a GPU's ~1-10 ms,
# a CPU prefill chunk up to seconds.
STEP_TIME_BUCKETS: tuple[float, ...] = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15,
                                        0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


class StepTimeHistogram:
    def __init__(self) -> None:
        self.counts = {kind: [0] * (len(STEP_TIME_BUCKETS) + 1) for kind in STEP_KINDS}
        self.sums = {kind: 0.0 for kind in STEP_KINDS}

    def observe(self, kind: str, seconds: float) -> None:
        self.counts[kind][bisect.bisect_left(STEP_TIME_BUCKETS, seconds)] += 1
        self.sums[kind] += seconds

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """{kind: (counts per bucket, sum of seconds)}, copies."""
        return {kind: (list(self.counts[kind]), self.sums[kind]) for kind in STEP_KINDS}
