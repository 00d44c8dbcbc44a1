"""Worker actors: one prefill, decode or colocated worker (engine + gRPC server + KV transport
endpoint) per Ray actor, and the controller's handle on them.

`WorkerActor` lifecycle (one state per line):

    created    the actor process exists, with OMP_NUM_THREADS set before torch loads
    start()    `serving.start_worker`, the bring-up `python -m prefill_worker|decode_worker` use too,
               with `WorkerSpec.worker_options` for its role and node: engine built off the event
               loop (tensor parallel N: with its N-1 follower processes, children of this one:
               engine/tp_worker.py); gRPC server listening; returns both addresses (gRPC and KV
               transport), the process id, the Ray node it runs on (id and IP) and the KV settings
               in effect (`Worker.kv_settings`)
    serving    `run_until_stopped()` stays pending while it serves: the controller's watch call,
               which fails at once when the actor dies
    stop()     gRPC server stopped with a grace period, engine and transport closed
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

from deploy.config import PoolTargets, WorkerSpec, capacity_shortfall
from engine.config import Role
from serving.bringup import RunningWorker, Worker, WorkerOptions, start_worker
from wire.cluster_auth import ClusterAuth

if TYPE_CHECKING:
    from wire.stats import WorkerStats

logger = logging.getLogger(__name__)


def build_worker(role: Role, options: WorkerOptions) -> Worker:
    """The worker server of `role` (loads the engine: torch, imported here, in the worker's actor)."""
    if role is Role.PREFILL:
        from prefill_worker.server import PrefillWorker
        return PrefillWorker.from_options(role, options)
    from decode_worker.server import DecodeWorker
    return DecodeWorker.from_options(role, options)


class WorkerActor:
    """One worker inside a Ray actor. `role` is "prefill", "decode" or "both" (colocated)."""

    def __init__(self, role: str, spec: WorkerSpec) -> None:
        self.role = Role.parse(role)
        self.spec = spec
        self._running: RunningWorker | None = None
        self._stopped: asyncio.Event | None = None

    async def start(self) -> dict[str, Any]:
        import ray
        if self._stopped is not None:
            raise RuntimeError(f"this {self.role.pool} worker was already started")
        self._stopped = asyncio.Event()
        node_id = ray.get_runtime_context().get_node_id()
        node_ip = ray.util.get_node_ip_address()
        self._running = running = await start_worker(self.role, self.spec.worker_options(self.role, node_ip),
                                                     build_worker)
        return {"role": self.role.value, "grpc_address": running.grpc_address,
                "transport_address": running.worker.transport_address, "pid": os.getpid(), "node_id": node_id,
                "node_ip": node_ip, "kv_settings": running.worker.kv_settings()}

    async def run_until_stopped(self) -> None:
        """Pending while the worker serves; returns after `stop()`."""
        if self._stopped is None:
            raise RuntimeError("the worker has not been started")
        await self._stopped.wait()

    async def hand_over(self) -> int:
        """Draining: the worker ends its streams for their callers to resume elsewhere (decode and
        colocated workers; a prefill worker has none). Returns how many."""
        return self._running.worker.hand_over() if self._running is not None else 0

    async def stop(self, grace_s: float) -> None:
        if self._running is not None:
            running, self._running = self._running, None
            await running.stop(grace_s)
        if self._stopped is not None:
            self._stopped.set()

    async def pid(self) -> int:
        return os.getpid()


class RayWorkerHandle:
    """The controller's handle on one `WorkerActor` (see `deploy.controller.WorkerHandle`); `auth`:
    how its Stats calls reach the worker (the workers' `WorkerSpec.cluster_auth`)."""

    def __init__(self, actor: Any, role: str, auth: ClusterAuth) -> None:
        self.actor = actor
        self.role = role
        self.auth = auth
        self._client: Any = None
        self._dead = False

    async def start(self) -> dict[str, Any]:
        info = await self.actor.start.remote()
        self.adopt(info)
        return info

    def adopt(self, info: dict[str, Any]) -> None:
        """Bind to a worker that serves at `info["grpc_address"]` (its start's report)."""
        from router.client import WorkerClient
        self._client = WorkerClient(info["grpc_address"], self.role, self.auth)

    async def wait_dead(self) -> str:
        import ray
        try:
            await self.actor.run_until_stopped.remote()
        except ray.exceptions.RayActorError as exc:
            self._dead = True
            return _actor_death_reason(exc)
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc)[:300]}"
        return "stopped"

    async def stats(self, timeout_s: float) -> WorkerStats:
        from wire.stats import worker_stats_from_wire
        if self._client is None:
            raise RuntimeError("the worker has not reported its address yet")
        return worker_stats_from_wire(await self._client.stats(timeout_s))

    async def hand_over(self) -> int:
        return await self.actor.hand_over.remote()

    async def stop(self, grace_s: float) -> None:
        import ray
        try:
            if self._client is not None and not self._dead:
                await asyncio.wait_for(self.actor.stop.remote(grace_s), grace_s + 10.0)
        except Exception as exc:  # dead or stuck: the kill below ends it either way
            logger.info("graceful stop of a %s worker failed: %s", self.role, _actor_death_reason(exc))
        finally:
            if self._client is not None:
                client, self._client = self._client, None
                await client.close()
            ray.kill(self.actor, no_restart=True)


class RayWorkerLauncher:
    """Creates `WorkerActor`s with their resources (`WorkerSpec.actor_options(role)`): `num_gpus`
    per worker on GPU, fractional `num_cpus` on CPU, both times the worker's tensor-parallel
    degree (its follower ranks are child processes of the actor, on its node, inside its
    reservation), the custom resources of the worker's role (which pin a pool to the nodes that
    have them), and OMP_NUM_THREADS (the worker's thread share) set in the actor's environment. They are detached
    actors named `<controller>:<worker id>`: a controller that dies takes none of them with it,
    and a restarted one finds them by name (`find`); `stop_all` ends every one of them."""

    def __init__(self, spec: WorkerSpec, controller_name: str, namespace: str) -> None:
        self.spec = spec
        self.controller_name = controller_name
        self.namespace = namespace
        self._actor_class: Any = None

    def launch(self, role: str, worker_id: str) -> RayWorkerHandle:
        import ray
        if self._actor_class is None:
            self._actor_class = ray.remote(WorkerActor)
        threads = str(self.spec.threads(role))
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        actor_class = self._actor_class.options(
            name=f"{self.controller_name}:{worker_id}", namespace=self.namespace,
            **self.spec.actor_options(role),
            max_restarts=0, max_concurrency=1000,
            lifetime="detached", runtime_env={"env_vars": env})
        return RayWorkerHandle(actor_class.remote(role, self.spec), role, self.spec.cluster_auth)

    def find(self, role: str, worker_id: str, info: dict[str, Any] | None) -> RayWorkerHandle | None:
        import ray
        try:
            actor = ray.get_actor(f"{self.controller_name}:{worker_id}", namespace=self.namespace)
        except ValueError:
            return None
        handle = RayWorkerHandle(actor, role, self.spec.cluster_auth)
        if info is not None:
            handle.adopt(info)
        return handle

    def live_worker_ids(self) -> list[str]:
        return worker_ids(self.controller_name, self.namespace)

    def capacity_shortfall(self, targets: PoolTargets) -> str | None:
        import ray
        from deploy.cluster import node_resources
        return capacity_shortfall(targets, self.spec, ray.cluster_resources(), node_resources())


def worker_ids(controller_name: str, namespace: str) -> list[str]:
    """Ids of the live worker actors named under `controller_name` in `namespace`."""
    import ray
    prefix = f"{controller_name}:"
    return [entry["name"][len(prefix):] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == namespace and entry["name"].startswith(prefix)]


def stop_all(controller_name: str, namespace: str) -> int:
    """Kill every worker actor named under `controller_name` (no orphans after a shutdown, also
    of workers a dead controller launched). Returns how many there were."""
    import ray
    ids = worker_ids(controller_name, namespace)
    for worker_id in ids:
        try:
            ray.kill(ray.get_actor(f"{controller_name}:{worker_id}", namespace=namespace), no_restart=True)
        except ValueError:
            pass  # gone meanwhile
    return len(ids)


def _actor_death_reason(exc: BaseException) -> str:
    """One line out of Ray's multi-line actor error, preferring the one that says why."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "because" in line:
            return line[:300]
    return (lines[0] if lines else type(exc).__name__)[:300]
