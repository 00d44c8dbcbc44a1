"""The goodput planner: how many prefill and decode workers the load needs under the SLO.

The controller (deploy/controller.py) feeds it every worker's polled Stats each health tick
(`observe`) and asks it for a decision every `interval_s` (`decide`); the decision goes through
the controller's own `scale()`, or with `dry_run` only into its log and status.

The model (after DistServe's placement of the two phases, and Dynamo's planner): prefill and
decode are sized separately, each from what the pool is measured to do.
- **Prefill.** Over the last interval prompt tokens arrived at `r` per second (computed plus the
  queue's growth) and `q` are queued. A prefill worker that had a queue the whole interval
  computed `mu` tokens/s: the capacity (its largest recent value). P = `r (1 + headroom) / mu`
  rounded up, and at least one more than now while the queue alone (`q / (P mu)`) is longer than
  the TTFT SLO and not shrinking. Until a busy interval measured `mu`, the prefill pool keeps its size.
- **Decode.** A decode worker's time per output token grows with its batch: TPOT = a + c * b.
  Each interval gives (b = running sequences, TPOT = b / output tokens per second; with speculative
  decoding, rejected draft tokens do not count) per worker;
  a least-squares line over the recent ones gives a and c, and the largest batch within the SLO,
  `B = (slo_tpot - a) / c`. While the batch sizes seen span less than half their mean (or the
  line's slope is not positive: noise), a line through them would extrapolate noise, so TPOT is
  taken as proportional to the batch (the cautious reading: it ignores a > 0). D = sequences on
  the decode workers (running, and waiting: they run next) * (1 + headroom) / B, rounded up.
- Both at least 1; P + D at most `max_workers` (shared in proportion when the wish is larger); a
  pool that should grow never shrinks to make room.

A change of targets from elsewhere (`pdserve scale`, the admin API) counts as a change
(`targets_changed`): it restarts the cooldown, the streak and the interval, so the planner does
not undo it on its next decision from numbers measured before it. The controller asks for a
decision only while the pools are settled, and feeds no interval that spans a change.

Hysteresis, so it never flaps: a new size must be wanted by `stable_decisions` decisions in a
row, and none is applied within `cooldown_s` of the last; a pool shrinks by one worker per change
(growing may jump). Every decision is kept (`decisions`) for the status and metrics.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from wire.stats import WorkerStats


@dataclass
class PlannerConfig:
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    max_workers: int = 8  # prefill + decode workers at most
    interval_s: float = 10.0
    stable_decisions: int = 3
    cooldown_s: float = 60.0
    headroom: float = 0.2
    dry_run: bool = False

    def __post_init__(self) -> None:
        for name in ("slo_ttft_ms", "slo_tpot_ms", "interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_workers < 2:
            raise ValueError(f"max_workers must be >= 2 (a prefill and a decode worker), got {self.max_workers}")
        if self.stable_decisions < 1 or self.cooldown_s < 0 or self.headroom < 0:
            raise ValueError("stable_decisions must be >= 1, cooldown_s and headroom >= 0")


@dataclass(frozen=True)
class Decision:
    time: float
    current: tuple[int, int]  # (prefill, decode) when decided
    wanted: tuple[int, int]  # what the model asks for now
    target: tuple[int, int] | None  # what to scale to now (None: keep)
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"time": self.time, "current": list(self.current), "wanted": list(self.wanted),
                "target": list(self.target) if self.target else None, "reason": self.reason}


@dataclass
class _Sample:
    time: float
    role: str
    prompt_tokens: int
    decode_tokens: int  # output tokens decoded (cumulative): positions run less rejected draft tokens
    queued: int
    running: int
    waiting: int


@dataclass
class Planner:
    config: PlannerConfig
    decisions: collections.deque = field(default_factory=lambda: collections.deque(maxlen=50))
    _last: dict[str, _Sample] = field(default_factory=dict)
    _window: list[tuple[str, _Sample, _Sample]] = field(default_factory=list)  # (address, start, end)
    _prefill_capacity: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    _tpot_points: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    _window_start: float | None = None
    _streak: tuple[tuple[int, int] | None, int] = (None, 0)
    _last_change: float | None = None
    num_decisions: int = 0  # cumulative
    num_changes: int = 0  # decisions with a target (applied, or logged in a dry run)

    def observe(self, now: float, workers: Iterable[tuple[str, str, WorkerStats]]) -> None:
        """(address, role, Stats) of every ready worker, as polled at `now`; a worker missing
        from one call is forgotten (its address may come back as another worker)."""
        workers = list(workers)
        seen = {address for address, _, _ in workers}
        for address in [a for a in self._last if a not in seen]:
            del self._last[address]
        for address, role, stats in workers:
            # with speculative decoding a step runs 1 + k positions and keeps 1 + accepted tokens:
            # TPOT is time per token kept
            rejected = stats.spec_draft_tokens - stats.spec_accepted_tokens
            sample = _Sample(now, role, stats.prompt_tokens_computed, stats.decode_tokens - rejected,
                             stats.prefill_tokens_queued, stats.running, stats.waiting)
            previous = self._last.get(address)
            self._last[address] = sample
            if previous is None or previous.role != role or now <= previous.time:
                continue
            self._window.append((address, previous, sample))
            if role == "decode" and sample.running > 0 and sample.decode_tokens > previous.decode_tokens:
                rate = (sample.decode_tokens - previous.decode_tokens) / (now - previous.time)
                self._tpot_points.append((sample.running, sample.running / rate))
        if self._window_start is None:
            self._window_start = now

    def targets_changed(self, now: float) -> None:
        """The pool sizes changed (the planner's own decision or anyone else's): the cooldown
        starts now, the streak and the interval start over."""
        self._last_change = now
        self._streak = (None, 0)
        self.restart_interval(now)

    def restart_interval(self, now: float) -> None:
        """Drop what the current interval has measured (it spans a change in progress)."""
        self._window, self._window_start = [], now

    def decide(self, now: float, prefill: int, decode: int) -> Decision | None:
        """Every `interval_s`: the pool sizes to scale to now, or None before an interval has passed."""
        if self._window_start is None or now - self._window_start < self.config.interval_s:
            return None
        window, self._window, self._window_start = self._window, [], now
        wanted, reason = self._wanted(window, prefill, decode)
        streak_target, streak = self._streak
        streak = streak + 1 if wanted == streak_target else 1
        self._streak = (wanted, streak)
        target = None
        if wanted != (prefill, decode):
            cooling = self._last_change is not None and now - self._last_change < self.config.cooldown_s
            if streak < self.config.stable_decisions:
                reason += f"; wanted {streak}/{self.config.stable_decisions} times in a row"
            elif cooling:
                reason += "; cooling down after the last change"
            else:
                # shrink one worker at a time, grow at once, never past max_workers in all
                new_prefill = wanted[0] if wanted[0] >= prefill else prefill - 1
                new_decode = wanted[1] if wanted[1] >= decode else decode - 1
                # (a pool that should grow is never cut below its size to fit max_workers)
                if new_prefill > prefill:
                    new_prefill = max(prefill, min(new_prefill, self.config.max_workers - new_decode))
                if new_decode > decode:
                    new_decode = max(decode, min(new_decode, self.config.max_workers - new_prefill))
                if (new_prefill, new_decode) != (prefill, decode):
                    target = (new_prefill, new_decode)
                    self._last_change = now
        decision = Decision(now, (prefill, decode), wanted, target, reason)
        self.decisions.append(decision)
        self.num_decisions += 1
        self.num_changes += target is not None
        return decision

    def status(self) -> dict[str, Any]:
        """For `pdserve status` and the routers' /metrics: counts, the last decision, the recent ones."""
        recent = [d.as_dict() for d in list(self.decisions)[-10:]]
        return {"dry_run": self.config.dry_run, "decisions_total": self.num_decisions,
                "changes_total": self.num_changes, "last": recent[-1] if recent else None, "decisions": recent}

    # ---- the model ---------------------------------------------------------------------------

    def _wanted(self, window: list[tuple[str, _Sample, _Sample]], prefill: int,
                decode: int) -> tuple[tuple[int, int], str]:
        cfg = self.config
        spans: dict[str, list[_Sample]] = {}  # per worker: its samples over the interval, in order
        for address, start, end in window:
            spans.setdefault(address, [start]).append(end)
        prefill_rate = queued = growth = 0.0
        running = 0
        for samples in spans.values():
            first, last = samples[0], samples[-1]
            if last.role == "prefill":
                seconds = last.time - first.time
                served = (last.prompt_tokens - first.prompt_tokens) / seconds
                prefill_rate += served + (last.queued - first.queued) / seconds  # arrivals: served + queue growth
                queued += last.queued
                growth += last.queued - first.queued
                if all(s.queued > 0 for s in samples):  # busy throughout: what one worker can do
                    self._prefill_capacity.append(served)
            else:
                running += last.running + last.waiting
        mu = max(self._prefill_capacity) if self._prefill_capacity else None
        if mu:
            want_prefill = max(1, math.ceil(prefill_rate * (1 + cfg.headroom) / mu))
            if queued / (max(prefill, 1) * mu) > cfg.slo_ttft_ms / 1000.0 and growth >= 0:
                want_prefill = max(want_prefill, prefill + 1)  # a queue past the TTFT SLO, not draining
            prefill_why = (f"prefill {prefill_rate:.0f} tok/s arriving, {queued:.0f} queued, {mu:.0f} tok/s "
                           f"per busy worker")
        else:
            want_prefill = prefill
            prefill_why = "prefill capacity not measured yet"
        batch = self._max_batch()
        if batch is not None:
            want_decode = max(1, math.ceil(running * (1 + cfg.headroom) / batch))
            decode_why = f"{running} running, {batch:.0f} per worker within the TPOT SLO"
        else:
            want_decode = decode
            decode_why = "decode TPOT not measured yet"
        if want_prefill + want_decode > cfg.max_workers:
            total = want_prefill + want_decode
            want_prefill = min(cfg.max_workers - 1, max(1, round(cfg.max_workers * want_prefill / total)))
            want_decode = cfg.max_workers - want_prefill
        return (want_prefill, want_decode), f"{prefill_why}; {decode_why}"

    def _max_batch(self) -> float | None:
        """The largest decode batch whose TPOT fits the SLO, from TPOT = a + c * batch."""
        points = list(self._tpot_points)
        if len(points) < 3:
            return None
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        slo = self.config.slo_tpot_ms / 1000.0
        proportional = max(1.0, mean_b * slo / mean_t)  # TPOT taken as proportional to the batch
        spread = max(b for b, _ in points) - min(b for b, _ in points)
        if spread < 0.5 * mean_b:  # too narrow a range of batches to fit a line through
            return proportional
        var = sum((b - mean_b) ** 2 for b, _ in points)
        slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / var
        if slope <= 0:  # noise: TPOT cannot fall as the batch grows
            return proportional
        intercept = mean_t - slope * mean_b
        return max(1.0, (slo - intercept) / slope)
