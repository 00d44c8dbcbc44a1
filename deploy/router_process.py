"""One router process of `pdserve serve` (`python -m deploy.router_process`, started by
deploy/supervisor.py; not a command for users).

It joins the serve process's Ray cluster as a client, finds the controller by name, and serves
the OpenAI API (router/app.py) plus the admin routes (deploy/admin.py) on the listening socket it
inherits. Its `WorkerPool` follows the controller's membership (deploy/router_sync.py) under the
router id `router-<index>-pid<pid>`.

Contract with the supervisor:
- the spec arrives as JSON in $PDSERVE_ROUTER_SPEC (the API key is in it: not on the command line;
  so is the path of the cluster secret's file, which the router reads for its worker channels);
- before it accepts a connection, a router that finds workers in the membership waits (up to
  `warm_up_s`) until its pool can route, so a restarted router never answers 503 for a cluster
  that is up; connections meanwhile wait in the shared socket's backlog or go to other routers;
- it writes one line to `ready_fd` once it accepts connections, then closes it;
- SIGTERM: stop accepting, finish in-flight requests (up to 5 s), exit 0. SIGINT is ignored
  (Ctrl-C reaches the whole process group; the serve process decides the order of the stop);
- it dies with the serve process (PR_SET_PDEATHSIG), so no router outlives its supervisor.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import uvicorn

from deploy.config import KV_ROLES, SYNC_INTERVAL_S, SYNC_TIMEOUT_S
from engine.process import configure_logging, freeze_startup_objects

SPEC_ENV = "PDSERVE_ROUTER_SPEC"
_PR_SET_PDEATHSIG = 1

logger = logging.getLogger("pdserve.router")


@dataclass
class RouterSpec:
    index: int
    listen_fd: int
    ready_fd: int
    parent_pid: int
    ray_address: str
    namespace: str
    token_auth: bool
    controller: str
    router: dict[str, Any]  # RouterConfig's fields
    planner: bool = False  # the controller runs the goodput planner: its decisions go on /metrics
    sync_interval_s: float = SYNC_INTERVAL_S
    warm_up_s: float = 10.0
    log_level: str = "INFO"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RouterSpec":
        return cls(**json.loads(text))


def router_id(index: int, pid: int) -> str:
    return f"router-{index}-pid{pid}"


def main() -> int:
    spec = RouterSpec.from_json(os.environ.pop(SPEC_ENV))
    _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(spec.log_level, prefix=f"[router {spec.index}]")
    asyncio.run(_run(spec))
    return 0


async def _run(spec: RouterSpec) -> None:
    from deploy.admin import admin_routes
    from deploy.client import ControllerClient
    from deploy.cluster import connect, find_controller
    from deploy.router_sync import MembershipSync
    from engine.tokenizer import Tokenizer
    from router.app import create_app
    from router.config import RouterConfig

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    connect(spec.ray_address, spec.namespace, spec.token_auth)
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # after ray.init, which installs its own handler
    client = ControllerClient(find_controller(spec.controller, spec.namespace))
    config = RouterConfig(**spec.router)
    from wire import tracing  # before create_app, which adds the request spans' middleware when it is on
    tracing.setup(config.otlp_traces_endpoint, "pdserve-router",
                  {"service.instance.id": router_id(spec.index, os.getpid())})
    tokenizer = await asyncio.to_thread(Tokenizer.from_pretrained, config.model)
    planner = PlannerMetrics(client)
    app = create_app(config, tokenizer=tokenizer, collectors=[planner])
    app.include_router(admin_routes(client, config.api_key))
    pool = app.state.router.pool
    sync = MembershipSync(pool, client.router_sync, spec.sync_interval_s, router_id=router_id(spec.index, os.getpid()))
    await _warm_up(sync, pool, spec.warm_up_s)
    sync.start()
    if spec.planner:  # (without one there is nothing to read: no call to the controller every 2 s)
        planner.start()
    freeze_startup_objects()
    server = _Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on"))
    sock = socket.socket(fileno=spec.listen_fd)
    serving = loop.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            with os.fdopen(spec.ready_fd, "w") as ready:
                ready.write(f"{sync.router_id}\n")
        stopping = loop.create_task(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
    finally:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        await sync.stop()
        await planner.stop()
    serving.result()  # an error of the HTTP server ends the process with it (the supervisor restarts it)


async def _warm_up(sync: Any, pool: Any, timeout_s: float) -> None:
    """One membership sync, then (when it lists workers) poll them until the pool can route."""
    try:
        await asyncio.wait_for(sync.sync_once(), timeout_s)  # a restarting controller answers late
    except Exception as exc:  # the controller is away: serve from an empty pool until it is back
        logger.warning("cannot sync workers from the controller yet: %s", exc)
        return
    deadline = time.monotonic() + timeout_s
    while pool.workers() and not pool.ready and time.monotonic() < deadline:
        await pool.poll_all()
        if not pool.ready:
            await asyncio.sleep(0.1)


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handling (SIGTERM is handled above)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM when the process that started this one exits (Linux); if it already did, exit."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        sys.exit(0)




class PlannerMetrics:
    """The goodput planner's decisions on this router's /metrics (deploy/planner.py): read from
    the controller every `interval_s`; nothing is exported when it runs no planner."""

    def __init__(self, client: Any, interval_s: float = 2.0) -> None:
        self.client = client
        self.interval_s = interval_s
        self.status: dict[str, Any] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(), name="pdserve-planner-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            try:
                self.status = await asyncio.wait_for(self.client.planner_status(), SYNC_TIMEOUT_S)
            except Exception as exc:  # the controller is away: keep the last numbers
                logger.debug("planner status: %s", exc)
            await asyncio.sleep(self.interval_s)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        status = self.status
        if status is None:
            return
        decisions = CounterMetricFamily("pdserve:planner_decisions", "Goodput planner decisions, by outcome "
                                        "(change: a new size, applied or, in a dry run, logged; keep).",
                                        labels=["outcome"])
        decisions.add_metric(["change"], float(status["changes_total"]))
        decisions.add_metric(["keep"], float(status["decisions_total"] - status["changes_total"]))
        yield decisions
        wanted = GaugeMetricFamily("pdserve:planner_wanted_workers", "Workers the planner's model wants now, by "
                                   "role.", labels=["role"])
        target = GaugeMetricFamily("pdserve:planner_target_workers", "The pools' target sizes, by role.",
                                   labels=["role"])
        last = status["last"]
        for index, role in enumerate(KV_ROLES):  # the pools the planner sizes, in its (prefill, decode) order
            if last is not None:
                wanted.add_metric([role], float(last["wanted"][index]))
            target.add_metric([role], float(status["targets"][role]))
        yield wanted
        yield target

    def describe(self):
        return []


if __name__ == "__main__":
    sys.exit(main())
