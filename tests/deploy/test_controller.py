"""The controller's membership logic over fake workers: start, death and replacement, scaling,
draining (routers and worker Stats must both release a worker), backoff, health."""
import asyncio

import pytest

from deploy.config import ControllerConfig, PoolTargets
from deploy.controller import DRAINING, READY, PoolController
from tests.deploy.fakes import FakeClock, FakeLauncher, MemoryStore, settle


def make_controller(prefill=1, decode=1, colocated=0, **overrides):
    launcher, clock = FakeLauncher(), FakeClock()
    config = ControllerConfig(targets=PoolTargets(prefill, decode, colocated),
                              **{"health_interval_s": 3600.0, **overrides})
    return PoolController(config, launcher, clock=clock), launcher, clock


def states(controller):
    return sorted((w["worker_id"], w["state"]) for w in controller.status()["workers"])


def addresses(controller, role=None):
    return sorted(m["address"] for m in controller.membership() if role is None or m["role"] == role)


def decode_status(controller):
    [worker] = [w for w in controller.status()["workers"] if w["role"] == "decode"]
    return worker


async def _until(predicate) -> None:
    """Wait (bound it with asyncio.wait_for) until `predicate()` holds, for a running health loop."""
    while not predicate():
        await asyncio.sleep(0.01)


async def test_start_brings_every_pool_to_its_target():
    controller, launcher, _ = make_controller(prefill=1, decode=2, colocated=1)
    await controller.start()
    assert controller.settled()
    membership = controller.membership()
    assert sorted(m["role"] for m in membership) == ["both", "decode", "decode", "prefill"]
    assert {m["address"] for m in membership} == {h.address for h in launcher.handles}
    assert not any(m["draining"] for m in membership)
    workers = controller.status()["workers"]
    assert [w["pid"] for w in workers] == [launcher.by_address(w["address"]).port for w in workers]
    assert all(w["healthy"] and w["state"] == READY for w in workers)
    await controller.shutdown()
    assert all(h.stopped for h in launcher.handles)


async def test_status_shows_each_workers_node_and_kv_bytes_moved():
    controller, launcher, _ = make_controller(prefill=1, decode=1)
    launcher.plan["prefill"] = [{"node_id": "a1" * 28, "node_ip": "10.0.0.1"}]
    launcher.plan["decode"] = [{"node_id": "b2" * 28, "node_ip": "10.0.0.2",
                                "reply": {"running": 1, "waiting": 0, "kv_bytes_received": 4096}}]
    await controller.start()
    await controller.tick()
    workers = {w["role"]: w for w in controller.status()["workers"]}
    assert (workers["prefill"]["node_id"], workers["prefill"]["node_ip"]) == ("a1" * 28, "10.0.0.1")
    assert (workers["decode"]["node_id"], workers["decode"]["node_ip"]) == ("b2" * 28, "10.0.0.2")
    assert (workers["decode"]["kv_bytes_received"], workers["decode"]["kv_bytes_sent"]) == (4096, 0)
    await controller.shutdown()


async def test_status_shows_each_workers_tensor_parallel_degree():
    from deploy.config import WorkerSpec
    controller, _, _ = make_controller(prefill=1, decode=1, colocated=1,
                                       worker=WorkerSpec(tensor_parallel_size={"both": 3}))
    await controller.start()
    assert sorted((w["role"], w["tensor_parallel_size"]) for w in controller.status()["workers"]) == [
        ("both", 3), ("decode", 1), ("prefill", 1)]
    await controller.shutdown()


async def test_a_failed_start_raises_with_the_workers_reason():
    controller, launcher, _ = make_controller()
    launcher.plan["decode"] = [{"fail_start": "no such model: /nope"}]
    with pytest.raises(RuntimeError, match=r"decode-\d+ failed to start: ValueError: no such model: /nope"):
        await controller.start()
    await controller.shutdown()
    assert all(h.stopped for h in launcher.handles)


async def test_a_dead_worker_leaves_routing_at_once_and_is_replaced():
    controller, launcher, _ = make_controller(prefill=1, decode=1)
    await controller.start()
    [old] = launcher.of("decode")
    launcher.plan["decode"] = [{"hold_start": True}]
    old.die("the actor is dead because its worker process has died")
    await settle()
    assert old.address not in addresses(controller)  # out of routing before any health tick
    assert addresses(controller, "prefill") == [launcher.of("prefill")[0].address]
    new = launcher.of("decode")[-1]
    assert new is not old and not controller.settled()
    assert any("died (the actor is dead" in e["message"] for e in controller.status()["events"])
    new.release_start()
    await settle()
    assert controller.settled()
    assert addresses(controller, "decode") == [new.address]
    await controller.shutdown()


async def test_scale_down_drains_until_routers_and_the_worker_are_idle():
    controller, launcher, clock = make_controller(prefill=1, decode=1)
    await controller.start()
    assert controller.scale(decode=2) == {"prefill": 1, "decode": 2, "both": 0}
    await settle()
    assert controller.settled()
    first, second = launcher.of("decode")
    first.reply = {"running": 1, "waiting": 0}
    # The router holds one request on `first`; we ask for `first` to be the one drained.
    controller.router_sync("r1", {first.address: {"inflight": 1, "draining": False}})
    controller.scale(decode=1, drain=[first.address])
    assert dict(states(controller))["decode-2"] == DRAINING
    entry = next(m for m in controller.membership() if m["address"] == first.address)
    assert entry["draining"] is True  # still listed (so in-flight requests keep their worker), flagged

    # The router has not applied the drain yet: the worker stays.
    controller.router_sync("r1", {first.address: {"inflight": 0, "draining": False}})
    await controller.tick()
    assert not first.stopped
    # Applied, but one request still in flight there.
    controller.router_sync("r1", {first.address: {"inflight": 1, "draining": True}})
    await controller.tick()
    assert not first.stopped
    # The router is done, but the worker's own Stats still show a running request.
    controller.router_sync("r1", {first.address: {"inflight": 0, "draining": True}})
    await controller.tick()
    assert not first.stopped
    first.reply = {"running": 0, "waiting": 0}
    clock.advance(1.0)
    await controller.tick()
    await settle()
    assert first.stopped and first.stopped_with_grace == controller.config.stop_grace_s
    assert addresses(controller, "decode") == [second.address]
    assert controller.settled() and not second.stopped
    await controller.shutdown()


async def test_a_drain_needs_a_stats_poll_sent_after_the_routers_released_the_worker():
    controller, launcher, clock = make_controller(prefill=1, decode=2)
    await controller.start()
    victim = launcher.of("decode")[0]
    controller.router_sync("r1", {victim.address: {"inflight": 1, "draining": False}})
    controller.scale(decode=1, drain=[victim.address])
    await controller.tick()  # idle Stats, but the router holds a request there
    member = next(m for m in controller._members.values() if m.grpc_address == victim.address)
    stats_before = member.stats_time
    controller.router_sync("r1", {victim.address: {"inflight": 0, "draining": True}})
    controller._check_drains()  # the routers are clear now; the last idle poll was sent before that
    assert not victim.stopped and member.state == DRAINING
    clock.advance(0.5)
    await controller.tick()
    await settle()
    assert member.stats_time > stats_before and victim.stopped
    await controller.shutdown()


async def test_a_stale_router_does_not_hold_a_drain_forever():
    controller, launcher, clock = make_controller(prefill=1, decode=2, router_stale_after_s=10.0)
    await controller.start()
    victim = launcher.of("decode")[1]
    controller.router_sync("gone-router", {victim.address: {"inflight": 3, "draining": False}})
    controller.scale(decode=1, drain=[victim.address])
    await controller.tick()
    assert not victim.stopped
    clock.advance(11.0)
    await controller.tick()
    clock.advance(0.1)
    await controller.tick()
    await settle()
    assert victim.stopped
    await controller.shutdown()


async def test_a_drain_that_times_out_stops_the_worker_anyway():
    controller, launcher, clock = make_controller(prefill=1, decode=2, drain_timeout_s=30.0)
    await controller.start()
    victim = launcher.of("decode")[0]
    victim.reply = {"running": 2, "waiting": 1}
    controller.scale(decode=1, drain=[victim.address])
    await controller.tick()
    assert not victim.stopped
    clock.advance(31.0)
    await controller.tick()
    await settle()
    assert victim.stopped
    assert any("drain timed out after 30 s (3 request(s) still on it)" in e["message"]
               for e in controller.status()["events"])
    await controller.shutdown()


async def test_a_decode_worker_still_streaming_after_the_grace_hands_its_streams_over():
    controller, launcher, clock = make_controller(prefill=2, decode=2, drain_grace_s=5.0)
    await controller.start()
    victim = launcher.of("decode")[0]
    victim.reply = {"running": 3, "waiting": 0}
    busy_prefill = launcher.of("prefill")[0]
    busy_prefill.reply = {"running": 1, "waiting": 0}
    controller.router_sync("r1", {victim.address: {"inflight": 3, "draining": False}})
    controller.scale(prefill=1, decode=1, drain=[victim.address, busy_prefill.address])
    await controller.tick()
    await settle()
    assert victim.hand_overs == 0  # within the grace: the streams may finish there
    clock.advance(5.0)
    await controller.tick()
    await settle()
    assert victim.hand_overs == 1 and busy_prefill.hand_overs == 0  # a prefill worker's prompts just end
    assert any(f"{victim.address} handed 3 stream(s) over after a 5 s drain grace" in e["message"]
               for e in controller.status()["events"])
    controller.router_sync("r1", {victim.address: {"inflight": 0, "draining": True}})  # resumed elsewhere
    for _ in range(2):  # the routers are clear, then a poll sent after that shows nothing running
        clock.advance(1.0)
        await controller.tick()
        await settle()
    assert victim.stopped and victim.hand_overs == 1
    await controller.shutdown()


async def test_without_a_grace_a_drain_waits_for_its_streams():
    controller, launcher, clock = make_controller(prefill=1, decode=2, drain_grace_s=None)
    await controller.start()
    victim = launcher.of("decode")[0]
    victim.reply = {"running": 2, "waiting": 0}
    controller.scale(decode=1, drain=[victim.address])
    clock.advance(60.0)
    await controller.tick()
    await settle()
    assert victim.hand_overs == 0 and not victim.stopped
    await controller.shutdown()


async def test_growing_again_takes_back_a_draining_worker_instead_of_starting_one():
    controller, launcher, _ = make_controller(prefill=1, decode=2)
    await controller.start()
    victim = launcher.of("decode")[0]
    victim.reply = {"running": 1, "waiting": 0}
    await controller.tick()
    controller.scale(decode=1, drain=[victim.address])
    assert DRAINING in dict(states(controller)).values()
    controller.scale(decode=2)
    assert len(launcher.of("decode")) == 2
    assert controller.settled() and not any(m["draining"] for m in controller.membership())
    await controller.shutdown()


async def test_without_a_preference_the_least_loaded_worker_is_drained():
    controller, launcher, _ = make_controller(prefill=1, decode=3)
    await controller.start()
    busy, idle, medium = launcher.of("decode")
    busy.reply, idle.reply, medium.reply = {"running": 5}, {"running": 0}, {"running": 2}
    await controller.tick()
    controller.scale(decode=2)
    draining = [m["address"] for m in controller.membership() if m["draining"]]
    assert draining == [idle.address]
    await controller.shutdown()


async def test_scaling_down_a_starting_worker_stops_it_instead_of_draining_a_ready_one():
    controller, launcher, _ = make_controller(prefill=1, decode=1)
    await controller.start()
    launcher.plan["decode"] = [{"hold_start": True}]
    controller.scale(decode=2)
    await settle()
    ready, starting = launcher.of("decode")
    controller.scale(decode=1)
    await settle()
    assert starting.stopped and not ready.stopped
    assert controller.settled() and addresses(controller, "decode") == [ready.address]
    await controller.shutdown()


async def test_an_unresponsive_worker_turns_unhealthy_then_is_replaced():
    controller, launcher, _ = make_controller(prefill=1, decode=1, unhealthy_after_failures=2,
                                              replace_after_failures=4)
    await controller.start()
    [worker] = launcher.of("decode")
    worker.unresponsive = True
    await controller.tick()
    assert decode_status(controller)["healthy"] is True
    await controller.tick()
    status = decode_status(controller)
    assert status["healthy"] is False and "connection refused" in status["last_error"]
    await controller.tick()
    assert not worker.stopped
    await controller.tick()
    await settle()
    assert worker.stopped
    assert len(launcher.of("decode")) == 2 and controller.settled()
    assert addresses(controller, "decode") == [launcher.of("decode")[1].address]
    await controller.shutdown()


async def test_a_poll_cut_off_by_its_workers_stop_fails_and_health_checks_go_on():
    # Stopping a dead worker's handle closes its gRPC channel, which cancels a Stats call still
    # open on it: the poll gets CancelledError. That is one failed poll; it must not end the
    # health loop, which alone polls workers and finishes drains (a dead loop left a drained
    # replacement waiting for drain_timeout_s in the end-to-end test).
    launcher = FakeLauncher()
    config = ControllerConfig(targets=PoolTargets(1, 2, 0), health_interval_s=0.01)
    controller = PoolController(config, launcher)  # the real clock: a drain needs a poll sent after it began
    await controller.start()
    victim = launcher.of("decode")[0]
    victim.stats_hang = True
    await asyncio.wait_for(_until(lambda: victim.open_calls), 30.0)  # a poll of it is in flight
    victim.die("SIGKILL")
    await asyncio.wait_for(_until(lambda: victim.stopped), 30.0)  # which cancelled the poll
    assert not victim.open_calls
    assert await controller.wait_settled(30.0)
    replacement = launcher.of("decode")[-1]
    assert replacement is not victim
    controller.scale(decode=1, drain=[replacement.address])
    assert await controller.wait_settled(30.0)  # drained: the health loop still polls
    assert replacement.stopped
    assert any(f"{replacement.worker_id} at {replacement.address} stopping: drained" in e["message"]
               for e in controller.status()["events"])
    await controller.shutdown()


async def test_the_health_loop_outlives_a_tick_that_raises_until_it_is_cancelled():
    controller, _, _ = make_controller(health_interval_s=0.01)
    ticks = []

    async def tick():  # a CancelledError from something the tick awaited, then a bug, then fine
        ticks.append(len(ticks))
        if len(ticks) == 1:
            cut_off = asyncio.get_running_loop().create_future()
            cut_off.cancel()
            await cut_off
        if len(ticks) == 2:
            raise RuntimeError("a bug in one tick")

    controller.tick = tick
    await controller.start()
    await asyncio.wait_for(_until(lambda: len(ticks) >= 3), 30.0)
    assert not controller._loop_task.done()
    await controller.shutdown()
    assert controller._loop_task.cancelled()


async def test_a_drained_worker_that_never_answered_a_poll_leaves_after_the_failed_polls():
    controller, launcher, _ = make_controller(prefill=1, decode=1, unhealthy_after_failures=2,
                                              replace_after_failures=3)
    await controller.start()
    launcher.plan["decode"] = [{"unresponsive": True}]
    controller.scale(decode=2)
    await settle()
    mute = launcher.of("decode")[-1]
    controller.scale(decode=1, drain=[mute.address])  # drained before any poll reached it
    for _ in range(3):
        assert not mute.stopped
        await controller.tick()
    await settle()
    assert mute.stopped and controller.settled() and len(launcher.of("decode")) == 2  # not replaced
    assert any(f"{mute.worker_id} at {mute.address} stopping: unresponsive for 3 polls; its drain ends here"
               in e["message"] for e in controller.status()["events"])
    await controller.shutdown()


async def test_a_failing_replacement_backs_off_before_trying_again():
    controller, launcher, clock = make_controller(prefill=1, decode=1, max_start_backoff_s=60.0)
    await controller.start()
    launcher.plan["decode"] = [{"fail_start": "out of memory"}, {"fail_start": "out of memory"}]
    launcher.of("decode")[0].die()
    await settle()
    assert len(launcher.of("decode")) == 2  # the first replacement failed at once
    await controller.tick()
    assert len(launcher.of("decode")) == 2  # backing off (1 s)
    clock.advance(1.5)
    await controller.tick()
    await settle()
    assert len(launcher.of("decode")) == 3  # second try failed too: now 2 s
    clock.advance(1.5)
    await controller.tick()
    assert len(launcher.of("decode")) == 3
    clock.advance(1.0)
    await controller.tick()
    await settle()
    assert len(launcher.of("decode")) == 4 and controller.settled()
    events = [e["message"] for e in controller.status()["events"]]
    assert any("failed to start: ValueError: out of memory (next try in 2 s)" in e for e in events)
    await controller.shutdown()


async def test_scale_refuses_what_could_not_serve_and_unknown_workers():
    controller, launcher, _ = make_controller(prefill=1, decode=1)
    await controller.start()
    with pytest.raises(ValueError, match="no decode worker to send their KV to"):
        controller.scale(decode=0)
    with pytest.raises(ValueError, match="no worker could answer requests"):
        controller.scale(prefill=0, decode=0)
    with pytest.raises(ValueError, match="2 decode worker.s. but no prefill worker"):
        controller.scale(prefill=0, decode=2)
    with pytest.raises(ValueError, match=r"the decode pool size must be an integer >= 0, got -1"):
        controller.scale(decode=-1)
    with pytest.raises(ValueError, match=r"no worker at 10\.0\.0\.1:1"):
        controller.scale(decode=2, drain=["10.0.0.1:1"])
    assert controller.targets == PoolTargets(1, 1, 0) and len(launcher.handles) == 2
    assert controller.scale(prefill=0, decode=0, colocated=1) == {"prefill": 0, "decode": 0, "both": 1}
    await controller.shutdown()
    with pytest.raises(ValueError, match="shutting down"):
        controller.scale(decode=2)


async def test_wait_settled_reports_whether_the_pools_arrived():
    controller, launcher, _ = make_controller(prefill=1, decode=1)
    await controller.start()
    launcher.plan["decode"] = [{"hold_start": True}]
    controller.scale(decode=2)
    assert await controller.wait_settled(0.0) is False
    launcher.of("decode")[1].release_start()
    assert await asyncio.wait_for(controller.wait_settled(30.0), 30.0) is True
    await controller.shutdown()


def test_config_validation_messages():
    with pytest.raises(ValueError, match="unhealthy_after_failures <= replace_after_failures"):
        ControllerConfig(unhealthy_after_failures=5, replace_after_failures=2)
    with pytest.raises(ValueError, match="drain_timeout_s must be > 0"):
        ControllerConfig(drain_timeout_s=0)
    with pytest.raises(ValueError, match="colocated pool size must be an integer >= 0"):
        PoolTargets(colocated=-2)


def test_pool_targets_by_role_and_back():
    targets = PoolTargets(prefill=2, decode=3, colocated=1)
    assert targets.counts() == {"prefill": 2, "decode": 3, "both": 1}
    assert PoolTargets.from_counts(targets.counts()) == targets


# ---- the controller's own death: durable state, adoption, orphans -------------------------------

async def _die(controller):
    """The controller's process dies: its loop stops, its workers are not told anything."""
    tasks = [controller._loop_task, *controller._tasks]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _restarted(controller, launcher, clock, store):
    return PoolController(controller.config, launcher, clock=clock, store=store)


async def test_a_restarted_controller_adopts_its_live_workers_with_the_same_targets():
    store = MemoryStore()
    first, launcher, clock = make_controller(prefill=1, decode=2)
    first.store = store
    await first.start()
    first.scale(decode=3)
    await settle(20)
    assert first.settled() and store.state["targets"] == {"prefill": 1, "decode": 3, "both": 0}
    before = first.membership()
    await _die(first)
    second = _restarted(first, launcher, clock, store)
    assert await second.recover()
    assert second.membership() == before and second.settled()
    nodes = [(w["worker_id"], w["node_id"], w["node_ip"]) for w in second.status()["workers"]]
    assert nodes == [(w["worker_id"], w["node_id"], w["node_ip"]) for w in first.status()["workers"]]
    assert len(launcher.handles) == 4  # nothing relaunched
    assert any("restarted: 4 worker(s) adopted" in e["message"] for e in second.status()["events"])
    # it still replaces a dead worker and scales
    victim = launcher.of("decode")[0]
    victim.die("SIGKILL")
    await settle(20)
    assert second.settled() and victim.address not in addresses(second) and len(launcher.of("decode")) == 4
    second.scale(decode=1)
    await second.tick()
    second._routers.clear()  # no router holds anything: drains finish on Stats alone
    clock.advance(1)
    await second.tick()
    await settle(20)
    assert second.settled() and len(addresses(second, "decode")) == 1
    await second.shutdown()
    assert store.state is None and all(h.stopped or not h.alive for h in launcher.handles)


async def test_recovery_stops_starting_and_orphaned_workers_and_replaces_the_dead():
    store = MemoryStore()
    first, launcher, clock = make_controller(prefill=1, decode=1)
    first.store = store
    await first.start()
    launcher.plan["decode"] = [{"hold_start": True}]
    first.scale(decode=2)  # decode-2 is STARTING when the controller dies
    await settle()
    starting = launcher.of("decode")[-1]
    orphan = launcher.launch("decode", "decode-99")  # launched, never recorded
    await orphan.start()
    await _die(first)
    dead = launcher.of("prefill")[0]
    dead.die("node lost")  # dies while no controller watches
    second = _restarted(first, launcher, clock, store)
    assert await second.recover()
    await settle(20)
    assert starting.stopped and orphan.stopped
    assert second.settled() and len(addresses(second, "prefill")) == 1 and len(addresses(second, "decode")) == 2
    assert dead.address not in addresses(second)
    await second.shutdown()


async def test_recover_without_a_record_does_nothing():
    controller, launcher, clock = make_controller()
    controller.store = MemoryStore()
    assert not await controller.recover()
    assert launcher.handles == []


async def test_the_store_is_written_when_something_changed_not_every_tick():
    """The write is a blocking call to the GCS on the controller's event loop."""
    controller, launcher, clock = make_controller(prefill=1, decode=1)
    controller.store = store = MemoryStore()
    await controller.start()
    saves = store.saves
    for _ in range(5):
        clock.advance(1)
        await controller.tick()
    assert store.saves == saves
    controller.scale(decode=2)
    await settle(20)
    assert store.saves > saves and store.state["targets"]["decode"] == 2
    await controller.shutdown()


async def test_routers_gone_quiet_are_forgotten():
    controller, _, clock = make_controller()
    await controller.start()
    for i in range(5):  # routers restarted under new ids
        controller.router_sync(f"router-{i}", {})
        clock.advance(controller.config.router_stale_after_s + 1)
    controller.router_sync("router-last", {})
    assert list(controller._routers) == ["router-last"]
    await controller.shutdown()


async def test_start_failures_after_start_are_not_kept():
    controller, launcher, _ = make_controller(prefill=1, decode=1)
    await controller.start()
    launcher.plan["decode"] = [{"fail_start": "boom"}] * 3
    launcher.of("decode")[0].die("SIGKILL")
    await settle(20)
    assert controller._start_failures is None  # nobody waits on start(): nothing to collect
    assert any("failed to start" in e["message"] for e in controller.status()["events"])
    await controller.shutdown()


async def test_a_failed_recovery_is_retried_by_the_next_call():
    """A restarted controller actor whose recovery failed once (e.g. the GCS not answering yet)
    tries again on the next call instead of failing every call for good."""
    from deploy.controller import ControllerActor

    class Flaky:
        attempts = 0

        async def recover(self):
            Flaky.attempts += 1
            if Flaky.attempts == 1:
                raise ConnectionError("GCS unavailable")
            return True

        def status(self):
            return {"ok": True}

    actor = object.__new__(ControllerActor)
    actor.controller, actor._restarted, actor._recovery = Flaky(), True, None
    with pytest.raises(ConnectionError):
        await actor.status()
    assert await actor.status() == {"ok": True} and Flaky.attempts == 2
