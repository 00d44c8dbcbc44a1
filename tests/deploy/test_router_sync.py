"""The router's WorkerPool follows the controller's membership, and reports back what it holds."""
import asyncio

import pytest

from deploy.router_sync import MembershipSync
from router.config import RouterConfig
from router.pool import WorkerPool


class NullClient:
    def __init__(self, address, role):
        self.address = address

    async def close(self):
        pass


def entry(role, address, draining=False):
    return {"worker_id": address, "role": role, "address": address, "draining": draining}


def make_sync(fetch=None):
    pool = WorkerPool(RouterConfig(model="tiny"), client_factory=NullClient)
    return pool, MembershipSync(pool, fetch or _never, interval_s=0.01, router_id="r1")


async def _never(router_id, report):
    raise AssertionError("not called")


def test_new_workers_join_and_the_report_carries_inflight_and_draining():
    pool, sync = make_sync()
    sync.apply([entry("prefill", "127.0.0.1:1001"), entry("decode", "127.0.0.1:1002")])
    assert {(w.role, w.address, w.draining) for w in pool.workers()} == {
        ("prefill", "127.0.0.1:1001", False), ("decode", "127.0.0.1:1002", False)}
    decode = pool.get("127.0.0.1:1002")
    decode.healthy = True
    pool.assign(decode, None, 10)
    assert sync.report() == {"127.0.0.1:1001": {"inflight": 0, "draining": False, "role": "prefill"},
                             "127.0.0.1:1002": {"inflight": 1, "draining": False, "role": "decode"}}


def test_draining_stops_new_routing_and_a_listed_worker_can_come_back():
    pool, sync = make_sync()
    sync.apply([entry("decode", "127.0.0.1:1002")])
    worker = pool.get("127.0.0.1:1002")
    worker.healthy = True
    sync.apply([entry("decode", "127.0.0.1:1002", draining=True)])
    assert worker.draining and pool.routable("decode") == []
    assert sync.report()["127.0.0.1:1002"]["draining"] is True
    sync.apply([entry("decode", "127.0.0.1:1002")])
    assert not worker.draining and pool.routable("decode") == [worker]


def test_a_worker_left_out_is_unrouted_at_once_and_removed_when_idle():
    pool, sync = make_sync()
    sync.apply([entry("decode", "127.0.0.1:1002"), entry("decode", "127.0.0.1:1003")])
    busy, idle = pool.get("127.0.0.1:1002"), pool.get("127.0.0.1:1003")
    busy.healthy = idle.healthy = True
    assignment = pool.assign(busy, None, 4)
    sync.apply([])
    assert pool.get("127.0.0.1:1003") is None  # nothing in flight: gone at once
    assert pool.get("127.0.0.1:1002") is busy and not busy.healthy and busy.last_error == "removed by the controller"
    assert pool.routable("decode") == []
    sync.apply([])  # a second round changes nothing while the request runs
    assert pool.get("127.0.0.1:1002") is busy
    assignment.release()
    assert pool.workers() == []


def test_a_draining_worker_never_joined_is_not_added():
    pool, sync = make_sync()
    sync.apply([entry("decode", "127.0.0.1:1002", draining=True)])
    assert pool.workers() == []


def test_an_address_reused_by_another_role_replaces_the_old_worker():
    pool, sync = make_sync()
    sync.apply([entry("prefill", "127.0.0.1:1001"), entry("decode", "127.0.0.1:1002")])
    sync.apply([entry("decode", "127.0.0.1:1001"), entry("decode", "127.0.0.1:1002")])
    assert pool.get("127.0.0.1:1001") is None  # the old prefill worker left (idle)
    sync.apply([entry("decode", "127.0.0.1:1001"), entry("decode", "127.0.0.1:1002")])
    assert pool.get("127.0.0.1:1001").role == "decode"


async def test_run_keeps_the_last_membership_while_the_controller_is_unreachable():
    calls = []

    async def fetch(router_id, report):
        calls.append(report)
        if len(calls) == 2:
            raise ConnectionError("controller gone")
        return [entry("decode", "127.0.0.1:1002")]

    pool, sync = make_sync(fetch)
    sync.start()
    for _ in range(500):
        if len(calls) >= 3:
            break
        await asyncio.sleep(0.01)
    await sync.stop()
    assert len(calls) >= 3
    assert [w.address for w in pool.workers()] == ["127.0.0.1:1002"]
    assert calls[1] == {"127.0.0.1:1002": {"inflight": 0, "draining": False, "role": "decode"}}
    assert sync.last_error is None  # it recovered


async def test_a_controller_that_never_answers_fails_the_round_and_keeps_the_membership():
    calls = []
    hung = asyncio.Event()

    async def fetch(router_id, report):
        calls.append(report)
        if len(calls) == 1:
            return [entry("prefill", "127.0.0.1:1001")]
        hung.set()
        await asyncio.Event().wait()  # a controller that takes the call and never answers

    pool = WorkerPool(RouterConfig(model="tiny"), client_factory=NullClient)
    sync = MembershipSync(pool, fetch, interval_s=0.01, router_id="r1", timeout_s=0.05)
    await sync.sync_once()
    with pytest.raises(TimeoutError, match="the controller did not answer within 0.05 s"):
        await sync.sync_once()
    assert hung.is_set()
    assert [w.address for w in pool.workers()] == ["127.0.0.1:1001"]


def test_interval_must_be_positive():
    pool = WorkerPool(RouterConfig(model="tiny"), client_factory=NullClient)
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        MembershipSync(pool, _never, interval_s=0)
