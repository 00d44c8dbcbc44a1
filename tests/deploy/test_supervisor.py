"""RouterSupervisor over stand-in router processes (tests/deploy/fake_router.py): the routers
share one listening socket, a killed one is restarted on it and answers there, a router that exits before it is
ready or hangs in its start fails the start, a restart that hangs or cannot fork backs off and
retries, and stop() leaves no process."""
import asyncio
import os
import signal
import socket
import sys

import pytest

from deploy.router_process import RouterSpec
from deploy.supervisor import RouterStartError, RouterSupervisor
from tests.deploy.harness import REPO, start_time

FAKE = (sys.executable, str(REPO / "tests" / "deploy" / "fake_router.py"))


def spec() -> RouterSpec:
    return RouterSpec(index=0, listen_fd=-1, ready_fd=-1, parent_pid=os.getpid(), ray_address="unused:1",
                      namespace="test", token_auth=False, controller="unused", router={})


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


async def answer(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    pid = int(await reader.read())
    writer.close()
    return pid


async def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def test_routers_share_the_socket_and_a_killed_one_comes_back_on_it():
    async def scenario():
        with listener() as sock:
            port = sock.getsockname()[1]
            supervisor = RouterSupervisor(spec(), 2, sock, grace_s=5.0, command=FAKE)
            await supervisor.start()
            try:
                first = supervisor.pids
                assert len(set(first)) == 2
                assert {await answer(port) for _ in range(20)} <= set(first)
                started = {pid: start_time(pid) for pid in first}
                os.kill(first[0], signal.SIGKILL)
                await wait_for(lambda: supervisor.restarts == 1 and len(supervisor.pids) == 2)
                second = supervisor.pids
                assert first[1] in second and first[0] not in second
                # The restarted router accepts on the same socket: connections keep coming until it
                # answers one. (Not by stopping the survivor: a SIGSTOP can take the kernel's one
                # accept wakeup with it, and the connection then waits in the backlog for ever.)
                restarted = (set(second) - {first[1]}).pop()
                answered: set[int] = set()
                for _ in range(200):
                    answered.add(await asyncio.wait_for(answer(port), 10))
                    if restarted in answered:
                        break
                assert restarted in answered and answered <= set(second)
            finally:
                await supervisor.stop()
            assert supervisor.pids == []
            for pid, started_at in started.items():
                assert start_time(pid) != started_at  # gone (or the pid reused)
    asyncio.run(scenario())


def test_a_router_that_exits_before_it_is_ready_fails_the_start(monkeypatch):
    monkeypatch.setenv("FAKE_ROUTER_EXIT", "3")

    async def scenario():
        with listener() as sock:
            supervisor = RouterSupervisor(spec(), 1, sock, command=FAKE)
            with pytest.raises(RouterStartError, match="router 0 exited with status 3 before it accepted"):
                await supervisor.start()
            await supervisor.stop()
    asyncio.run(scenario())


def test_a_router_that_hangs_before_it_is_ready_is_killed_and_fails_the_start(monkeypatch):
    monkeypatch.setenv("FAKE_ROUTER_HANG", "1")

    async def scenario():
        with listener() as sock:
            supervisor = RouterSupervisor(spec(), 1, sock, command=FAKE, start_timeout_s=1.0)
            with pytest.raises(RouterStartError, match="router 0 did not accept connections within 1 s; killed it"):
                await supervisor.start()
            [slot] = supervisor._slots
            assert slot.process.returncode == -signal.SIGKILL  # killed and reaped, not left behind
            await supervisor.stop()
    asyncio.run(scenario())


def test_a_router_that_ignores_sigterm_is_killed_after_the_grace():
    async def scenario():
        with listener() as sock:
            supervisor = RouterSupervisor(spec(), 1, sock, grace_s=0.5, command=FAKE)
            await supervisor.start()
            [pid] = supervisor.pids
            os.kill(pid, signal.SIGSTOP)  # a stopped process does not act on SIGTERM
            await supervisor.stop()
            assert supervisor.pids == []
            assert start_time(pid) is None  # killed and reaped
    asyncio.run(scenario())


def test_a_router_that_hangs_at_every_restart_is_retried_with_a_growing_backoff(monkeypatch):
    """Its time to the start timeout is not time served: the backoff grows instead of resetting
    (a start timeout longer than HEALTHY_RUN_S used to read as a healthy run: instant restarts)."""
    import deploy.supervisor as supervisor_module
    monkeypatch.setattr(supervisor_module, "HEALTHY_RUN_S", 0.2)

    async def scenario():
        with listener() as sock:
            supervisor = RouterSupervisor(spec(), 1, sock, grace_s=2.0, command=FAKE, start_timeout_s=0.5)
            await supervisor.start()
            [slot] = supervisor._slots
            monkeypatch.setenv("FAKE_ROUTER_HANG", "1")  # every later start hangs
            os.kill(supervisor.pids[0], signal.SIGKILL)
            try:
                await wait_for(lambda: slot.quick_failures >= 3, 30.0)
            finally:
                await supervisor.stop()
            assert supervisor.restarts == 0
    asyncio.run(scenario())


def test_a_restart_that_cannot_fork_is_retried(monkeypatch):
    """An OSError from starting the process (no memory, no pids) leaves the slot down for a
    backoff, then it is tried again; it used to end the slot's watch for good, silently."""
    real_exec = asyncio.create_subprocess_exec
    failures = []

    async def flaky_exec(*args, **kwargs):
        if not failures and os.environ.get("FAKE_FORK_FAILS"):
            failures.append(1)
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return await real_exec(*args, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", flaky_exec)

    async def scenario():
        with listener() as sock:
            supervisor = RouterSupervisor(spec(), 1, sock, grace_s=2.0, command=FAKE)
            await supervisor.start()
            monkeypatch.setenv("FAKE_FORK_FAILS", "1")
            first = supervisor.pids[0]
            os.kill(first, signal.SIGKILL)
            try:
                await wait_for(lambda: supervisor.restarts == 1 and supervisor.pids and supervisor.pids[0] != first, 30.0)
            finally:
                await supervisor.stop()
            assert failures == [1]
    asyncio.run(scenario())
