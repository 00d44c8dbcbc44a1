"""The goodput planner (deploy/planner.py) on a simulated cluster with a fake clock: a
prefill-heavy phase, then a decode-heavy one. It moves the P:D ratio the right way each time,
settles, never reverses a pool's direction within a phase, and respects max_workers."""
import math
import random

import pytest

from deploy.planner import Planner, PlannerConfig
from wire.stats import WorkerStats

MU = 1000.0  # prompt tokens/s one prefill worker computes


def tpot(batch: float) -> float:
    return 0.02 + 0.002 * batch  # seconds; 40 sequences fit a 100 ms SLO


class SimulatedCluster:
    """Pools of prefill and decode workers and the counters their Stats would report."""

    def __init__(self, prefill: int, decode: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.workers: dict[str, dict] = {}
        self.next_id = 0
        self.resize(prefill, decode)

    def size(self, role: str) -> int:
        return sum(1 for w in self.workers.values() if w["role"] == role)

    def resize(self, prefill: int, decode: int) -> None:
        for role, count in (("prefill", prefill), ("decode", decode)):
            mine = [a for a, w in self.workers.items() if w["role"] == role]
            for address in mine[count:]:
                del self.workers[address]
            for _ in range(count - len(mine)):
                self.next_id += 1
                self.workers[f"w{self.next_id}"] = {"role": role, "prompt_tokens_computed": 0, "decode_tokens": 0,
                                                    "prefill_tokens_queued": 0, "running": 0}

    def step(self, dt: float, arrivals_per_s: float, running: int) -> None:
        prefill = [w for w in self.workers.values() if w["role"] == "prefill"]
        decode = [w for w in self.workers.values() if w["role"] == "decode"]
        arrived = arrivals_per_s * dt * self.rng.uniform(0.8, 1.2)
        for worker in prefill:
            worker["prefill_tokens_queued"] += int(arrived / len(prefill))
            done = min(worker["prefill_tokens_queued"], int(MU * dt))
            worker["prefill_tokens_queued"] -= done
            worker["prompt_tokens_computed"] += done
        for worker in decode:
            batch = max(1, round(running / len(decode) * self.rng.uniform(0.85, 1.15)))
            worker["running"] = batch
            worker["decode_tokens"] += int(batch / tpot(batch) * dt)

    def stats(self):
        return [(address, w["role"], WorkerStats(**w)) for address, w in self.workers.items()]


def simulate(planner: Planner, cluster: SimulatedCluster, phases, apply: bool = True):
    """Tick every second through `phases` [(seconds, prompt tokens/s, running sequences)];
    returns the (prefill, decode) sizes at the end of each phase and every applied change."""
    now, ends, changes = 0.0, [], []
    for seconds, arrivals, running in phases:
        for _ in range(int(seconds)):
            now += 1.0
            cluster.step(1.0, arrivals, running)
            planner.observe(now, cluster.stats())
            decision = planner.decide(now, cluster.size("prefill"), cluster.size("decode"))
            if decision is not None and decision.target is not None and apply:
                cluster.resize(*decision.target)
                changes.append((now, decision.target))
        ends.append((cluster.size("prefill"), cluster.size("decode")))
    return ends, changes


PHASES = [(900, 3000.0, 8),  # prefill-heavy: long prompts, few streams
          (900, 500.0, 120)]  # decode-heavy: short prompts, many streams


def test_the_planner_follows_the_load_from_prefill_to_decode_heavy_without_flapping():
    config = PlannerConfig(slo_ttft_ms=2000, slo_tpot_ms=100, max_workers=6, interval_s=10, stable_decisions=3,
                           cooldown_s=60)
    planner = Planner(config)
    ends, changes = simulate(planner, SimulatedCluster(1, 1), PHASES)
    assert ends == [(4, 1), (1, 4)]  # 3000 tok/s x 1.2 / 1000; then 120 streams x 1.2 / 40
    assert all(p + d <= 6 for _, (p, d) in changes)
    for phase_start, phase_end in ((0, 900), (900, 1800)):
        sizes = [target for time, target in changes if phase_start < time <= phase_end]
        for pool in (0, 1):
            steps = [b[pool] - a[pool] for a, b in zip(sizes, sizes[1:]) if b[pool] != a[pool]]
            assert all(s > 0 for s in steps) or all(s < 0 for s in steps), f"pool {pool} flapped: {sizes}"
    # shrinking goes one worker at a time, at least cooldown_s apart
    times = [time for time, _ in changes]
    assert all(b - a >= 60 for a, b in zip(times, times[1:]))
    last = planner.decisions[-1]
    assert last.target is None and last.wanted == last.current == (1, 4) and "running" in last.reason


def test_a_steady_load_changes_nothing_and_dry_run_decisions_are_kept():
    planner = Planner(PlannerConfig(slo_tpot_ms=100, max_workers=6, interval_s=10))
    ends, changes = simulate(planner, SimulatedCluster(1, 1), [(600, 500.0, 10)])
    assert ends == [(1, 1)] and changes == []
    # a load that wants more workers: the decisions name the target; nothing applies them here
    planner = Planner(PlannerConfig(slo_tpot_ms=100, max_workers=6, interval_s=10, dry_run=True))
    ends, changes = simulate(planner, SimulatedCluster(1, 1), [(300, 3000.0, 8)], apply=False)
    assert ends == [(1, 1)]
    assert any(d.target == (4, 1) for d in planner.decisions)
    assert planner.decisions[-1].as_dict()["current"] == [1, 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_workers": 1}, "max_workers must be >= 2"),
    ({"slo_ttft_ms": 0}, "slo_ttft_ms must be > 0"),
    ({"stable_decisions": 0}, "stable_decisions must be >= 1"),
])
def test_planner_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlannerConfig(**kwargs)


# ---- in the controller ----------------------------------------------------------------------

async def _run_planned_controller(dry_run: bool, capacity: int | None = None):
    from deploy.config import ControllerConfig, PoolTargets
    from deploy.controller import PoolController
    from tests.deploy.fakes import FakeClock, FakeLauncher, settle
    launcher, clock = FakeLauncher(), FakeClock()
    launcher.capacity = capacity
    planner = PlannerConfig(slo_tpot_ms=100, max_workers=4, interval_s=10, stable_decisions=2, cooldown_s=0,
                            dry_run=dry_run)
    controller = PoolController(ControllerConfig(targets=PoolTargets(1, 1, 0), health_interval_s=3600.0,
                                                 planner=planner), launcher, clock=clock)
    await controller.start()
    counters = {}
    for second in range(60):  # 80 streams on the decode pool, little prefill: it wants 3 decode workers
        clock.advance(1.0)
        decoders = [h for h in launcher.of("decode") if h.alive]
        for handle in launcher.handles:
            if not handle.alive:
                continue
            done = counters.setdefault(handle.worker_id, [0, 0])
            if handle.role == "decode":
                batch = 80 // len(decoders) + second % 3  # some spread, for the TPOT fit
                done[1] += int(batch / tpot(batch))
                handle.reply = {"running": batch, "waiting": 0, "decode_tokens": done[1]}
            else:
                done[0] += 100
                handle.reply = {"running": 0, "waiting": 0, "prompt_tokens_computed": done[0]}
        await controller.tick()
        await settle()
    status = controller.status()
    await controller.shutdown()
    return controller, status


async def test_the_controller_applies_the_planners_decisions_or_only_logs_them():
    controller, status = await _run_planned_controller(dry_run=False)
    assert status["targets"] == {"prefill": 1, "decode": 3, "both": 0}
    assert any(d["target"] == [1, 3] for d in status["planner"]["decisions"])
    assert any(e["message"].startswith("planner: ") for e in status["events"])
    controller, status = await _run_planned_controller(dry_run=True)
    assert status["targets"] == {"prefill": 1, "decode": 1, "both": 0}
    assert status["planner"]["dry_run"] and any("would scale to 1 prefill, 3 decode" in e["message"] for e in status["events"])


async def test_the_planners_target_is_cut_to_what_the_cluster_can_place():
    """It wants 3 decode workers; the cluster has room for 3 workers in all: it gets 2, and the
    pools settle (a worker that could never be placed would keep them unsettled, and the planner
    would decide nothing more, not even to shrink)."""
    controller, status = await _run_planned_controller(dry_run=False, capacity=3)
    assert status["targets"] == {"prefill": 1, "decode": 2, "both": 0} and status["settled"]
    assert any("planner wants 1 prefill, 3 decode; the cluster has no room: 4 workers, room for 3" in e["message"]
               for e in status["events"])


async def test_a_planner_over_colocated_workers_only_does_nothing():
    from deploy.config import ControllerConfig, PoolTargets
    from deploy.controller import PoolController
    from tests.deploy.fakes import FakeClock, FakeLauncher
    launcher, clock = FakeLauncher(), FakeClock()
    controller = PoolController(ControllerConfig(targets=PoolTargets(0, 0, 2), health_interval_s=3600.0,
                                                 planner=PlannerConfig(interval_s=10)), launcher, clock=clock)
    await controller.start()
    for _ in range(30):
        clock.advance(1.0)
        await controller.tick()  # raised ZeroDivisionError once the prefill capacity was known
    assert controller.status()["targets"] == {"prefill": 0, "decode": 0, "both": 2}
    assert controller.planner.num_decisions == 0
    await controller.shutdown()


async def test_a_manual_scale_restarts_the_planners_cooldown():
    from deploy.config import ControllerConfig, PoolTargets
    from deploy.controller import PoolController
    from tests.deploy.fakes import FakeClock, FakeLauncher
    launcher, clock = FakeLauncher(), FakeClock()
    controller = PoolController(ControllerConfig(targets=PoolTargets(1, 1, 0), health_interval_s=3600.0,
                                                 planner=PlannerConfig(interval_s=10)), launcher, clock=clock)
    await controller.start()
    clock.advance(5.0)
    controller.scale(decode=3)
    assert controller.planner._last_change == clock() and controller.planner._streak == (None, 0)
    await controller.shutdown()


# ---- the model's edges ------------------------------------------------------------------------

def _decode_stats(running, waiting, decode_tokens):
    return WorkerStats(running=running, waiting=waiting, decode_tokens=decode_tokens)


def test_waiting_requests_count_as_demand_not_as_the_measured_batch():
    """A decode worker's waiting requests (many wait for their KV while prefill lags) run next, so
    they count in the demand; the TPOT they are measured at is the running batch's."""
    planner = Planner(PlannerConfig(slo_tpot_ms=100, max_workers=8, interval_s=10, stable_decisions=1))
    tokens = 0
    for second in range(1, 31):
        batch = (10, 20, 30)[second % 3]  # a spread, so the line is fitted: B = 40 (tpot above)
        tokens += int(batch / tpot(batch))
        planner.observe(float(second), [("d1", "decode", _decode_stats(batch, 30, tokens))])
    assert 39 <= planner._max_batch() <= 41
    decision = planner.decide(31.0, 1, 1)
    # the last sample: 10 running (second 30) and 30 waiting, x 1.2 / B
    assert decision.wanted[1] == math.ceil((10 + 30) * 1.2 / planner._max_batch())


def test_tpot_is_measured_per_token_kept_when_decoding_speculates():
    """With drafts a step runs 1 + k positions but keeps 1 + accepted tokens: the decode-token
    counter counts positions, so rejected draft tokens come off before TPOT is read."""
    def measured(rejected_per_token):
        planner = Planner(PlannerConfig(slo_tpot_ms=100, max_workers=8, interval_s=10, stable_decisions=1))
        kept = drafts = accepted = 0
        for second in range(1, 31):
            batch = (10, 20, 30)[second % 3]
            step_tokens = int(batch / tpot(batch))
            kept += step_tokens
            drafts += step_tokens * rejected_per_token + step_tokens
            accepted += step_tokens
            stats = WorkerStats(running=batch, waiting=0, decode_tokens=kept + drafts - accepted,
                                spec_draft_tokens=drafts, spec_accepted_tokens=accepted)
            planner.observe(float(second), [("d1", "decode", stats)])
        return planner._max_batch()

    assert measured(3) == measured(0)  # 3 rejected positions per kept token change nothing
    assert 39 <= measured(3) <= 41


@pytest.mark.parametrize("seed", range(20))
def test_a_narrow_spread_of_batches_is_read_cautiously_not_extrapolated(seed):
    """Batches of 30-31 with noisy TPOTs: a line through them could slope either way. The planner
    takes TPOT as proportional to the batch instead (never infinite, never 1)."""
    rng = random.Random(seed)
    planner = Planner(PlannerConfig(slo_tpot_ms=100, max_workers=8, interval_s=10))
    for batch in [30, 31] * 20:
        planner._tpot_points.append((batch, tpot(batch) * rng.uniform(0.75, 1.25)))
    batch = planner._max_batch()
    assert 20 <= batch <= 40  # proportional reading: 30.5 x 0.1 / ~0.081 s


def test_a_pool_that_should_grow_is_not_cut_to_fit_max_workers():
    """Pools that start above max_workers (or were scaled there by hand): growing one must not
    shrink it below its size to make room."""
    planner = Planner(PlannerConfig(max_workers=8, interval_s=10, stable_decisions=1, cooldown_s=0))
    planner._wanted = lambda window, prefill, decode: ((3, 5), "test")
    planner.observe(0.0, [])
    decision = planner.decide(10.0, 2, 8)
    assert decision.target == (2, 7)  # prefill stays (no room to grow), decode shrinks by one


def test_a_change_from_elsewhere_restarts_the_streak_and_the_cooldown():
    planner = Planner(PlannerConfig(max_workers=8, interval_s=10, stable_decisions=2, cooldown_s=60))
    planner._wanted = lambda window, prefill, decode: ((1, 2), "test")
    planner.observe(0.0, [])
    assert planner.decide(10.0, 1, 2).target is None  # steady at (1, 2)
    planner.targets_changed(15.0)  # an operator scaled decode to 4
    assert planner.decide(20.0, 1, 4) is None  # the interval restarted at 15
    decisions = [planner.decide(t, 1, 4) for t in (25.0, 35.0, 45.0, 55.0, 65.0, 75.0)]
    assert [d.target for d in decisions[:5]] == [None] * 5  # streak, then cooling down until 75
    assert decisions[5].target == (1, 3)


def test_a_worker_gone_from_the_stats_is_forgotten():
    """Its address may come back as a new worker whose counters start at zero: no negative rate
    paired with the old worker's counters."""
    planner = Planner(PlannerConfig(max_workers=8, interval_s=10))
    planner.observe(1.0, [("d1", "decode", _decode_stats(4, 0, 5000))])
    planner.observe(2.0, [])
    planner.observe(3.0, [("d1", "decode", _decode_stats(4, 0, 40))])
    assert planner._window == [] and list(planner._tpot_points) == []
