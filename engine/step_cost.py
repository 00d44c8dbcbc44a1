"""`StepCostModel`: how long an engine step takes, learned from the steps that ran, so the
scheduler can size prefill chunks from a step-time target (`SchedulerConfig.max_step_ms`).

A step's duration is modelled as `base + per_decode * decodes + per_token * prefill_tokens +
per_draft * draft_tokens` (a decode with a speculative draft is one decode and its draft tokens,
never prompt work), fitted by exponentially weighted least squares (the last ~`1 / (1 - decay)`
steps count most; four parameters, solved in closed form at each query). The fit adapts as
contexts grow, the batch mix changes or the machine gets busier.

`prefill_budget(decodes, target_s, ratio, drafts)` is how many prefill tokens fit next to
`decodes` decode tokens (and their `drafts` draft tokens) within `target_s`, and within `ratio`
times the decode-only step the model predicts
(a target relative to the hardware: 2.0 lets prefill chunks at most double the decodes' step,
on a CPU or a GPU alike); either may be None (or inf): no cap from it. Until the model has seen `min_prefill_steps` steps with prefill tokens
it answers `probe_tokens` (small chunks it learns from, rather than one unbounded first chunk);
None when prefill tokens look free (no reason to cap). It is never below `min_tokens`, so a
prompt always makes progress however slow the decodes are.
"""
from __future__ import annotations

from math import inf

import numpy as np


class StepCostModel:
    def __init__(self, decay: float = 0.95, min_tokens: int = 16, min_prefill_steps: int = 4) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.min_tokens = min_tokens
        self.probe_tokens = 4 * min_tokens
        self.min_prefill_steps = min_prefill_steps
        self._gram = np.zeros((4, 4))  # sum of w * x x^T over steps, x = (1, decodes, prefill tokens, drafts)
        self._moment = np.zeros(4)  # sum of w * x * seconds
        self._prefill_steps = 0

    def observe(self, decodes: int, prefill_tokens: int, seconds: float, drafts: int = 0) -> None:
        x = np.array([1.0, float(decodes), float(prefill_tokens), float(drafts)])
        self._gram = self.decay * self._gram + np.outer(x, x)
        self._moment = self.decay * self._moment + x * seconds
        if prefill_tokens:
            self._prefill_steps += 1

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(base, per_decode, per_prefill_token, per_draft_token) in seconds, or None before
        enough prefill steps."""
        if self._prefill_steps < self.min_prefill_steps:
            return None
        ridge = 1e-9 * np.eye(4)  # keeps the solve defined while one feature has not varied yet
        base, per_decode, per_token, per_draft = np.linalg.solve(self._gram + ridge, self._moment)
        return float(base), float(per_decode), float(per_token), float(per_draft)

    def prefill_budget(self, decodes: int, target_s: float | None, ratio: float | None = None,
                       drafts: int = 0) -> int | None:
        fitted = self.coefficients()
        if fitted is None:
            return self.probe_tokens
        base, per_decode, per_token, per_draft = fitted
        if per_token <= 0.0:
            return None  # prefill tokens look free here: no reason to cap them
        decode_s = max(base, 0.0) + max(per_decode, 0.0) * decodes + max(per_draft, 0.0) * drafts
        targets = [t for t in (target_s, None if ratio is None else ratio * decode_s) if t is not None and t < inf]
        if not targets:
            return None
        return max(self.min_tokens, int((min(targets) - decode_s) / per_token))
