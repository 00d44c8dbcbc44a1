"""Deployment configuration: what every worker actor gets, and how the controller runs the pools.

Dataclasses validated at construction; no module globals. `WorkerSpec` travels to each worker
actor (it must stay picklable: plain values only).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from deploy.planner import PlannerConfig
from engine.config import KV_ROLES, ROLES, Role  # noqa: F401  (re-exported: deploy's modules take them from here)
from engine.model.default_model import DEFAULT_MODEL_NAME
from engine.model.packaged_models import PACKAGED_MODELS
from router.config import LOOPBACK_HOST
from serving.bringup import KVOptions, WorkerOptions
from wire.cluster_auth import INSECURE, ClusterAuth
DEVICES = ("cpu", "cuda")
DEVICE_CHOICES = ("auto", *DEVICES)  # `--device`; auto: cuda when the Ray cluster has GPUs
NODE_IP_HOST = "node-ip"  # WorkerSpec.host / --worker-host: listen on the IP of the worker's Ray node
DEFAULT_CONTROLLER_NAME = "pdserve-controller"
DEFAULT_NAMESPACE = "pdserve"
# How often each router process asks the controller for the pools' membership (deploy/router_sync.py).
SYNC_INTERVAL_S = 0.5
SYNC_TIMEOUT_S = 10.0  # a membership call not answered by then fails its round (the last membership stays)
# Ray resources a worker holds through WorkerSpec.num_cpus / num_gpus (or that Ray accounts
# itself): not accepted among a pool's custom resources.
RESERVED_RESOURCES = {"CPU": "--worker-cpus", "GPU": "--worker-gpus", "memory": None, "object_store_memory": None}
RESOURCE_UNITS = 10_000  # Ray counts a resource in units of 1/10,000


def parse_resources(text: str) -> dict[str, float]:
    """`--prefill-resources '{"node_a": 1}'`: a JSON object of Ray custom resources, validated."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg}): give an object such as '{{\"node_a\": 1}}'") from None
    return validate_resources(value)


def validate_resources(resources: Any) -> dict[str, float]:
    """Ray custom resources each worker of a pool requires (name -> quantity > 0); returns them as
    floats. ValueError names the problem: not an object, a reserved name, a bad quantity."""
    if not isinstance(resources, dict):
        raise ValueError(f"must be a JSON object of resource name -> quantity, such as {{\"node_a\": 1}}; "
                         f"got {json.dumps(resources)}")
    checked: dict[str, float] = {}
    for name, quantity in resources.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"resource names must be non-empty strings, got {name!r}")
        if name in RESERVED_RESOURCES:
            flag = RESERVED_RESOURCES[name]
            raise ValueError(f"{name!r} is not a custom resource" + (f": use {flag}" if flag else ""))
        if isinstance(quantity, bool) or not isinstance(quantity, (int, float)) or not math.isfinite(quantity) \
                or quantity <= 0:
            raise ValueError(f"resource {name!r} needs a number > 0, got {json.dumps(quantity)}")
        if int(quantity * RESOURCE_UNITS) == 0:
            raise ValueError(f"resource {name!r}: Ray counts fractions down to {1 / RESOURCE_UNITS:g}, got {quantity}")
        checked[name] = float(quantity)
    return checked


@dataclass
class WorkerSpec:
    """How to build one worker (engine + gRPC server + KV transport endpoint) inside its actor:
    `worker_options(role, node_ip)` are the `serving.WorkerOptions` its actor starts it with
    (`serving.start_worker`, the bring-up `python -m prefill_worker|decode_worker` use too).

    `kv`: the KV transport and connector settings of every worker (each side reads its own).
    `host` is where the worker's gRPC server and KV receiver listen (`NODE_IP_HOST`: the IP
    of the Ray node the worker runs on); `advertise_node_ip` writes the Ray node's IP into the
    reported addresses instead (for `host="0.0.0.0"` on multi-node clusters). `num_cpus` /
    `num_gpus` are the Ray resources of one process of a worker; `resources` the Ray custom
    resources each worker of a role requires, by role (`{"prefill": {"node_a": 1}}` places the
    prefill pool on the nodes started with `--resources '{"node_a": ...}'`).

    Tensor parallelism: `tensor_parallel_size` is each role's TP degree N (absent: 1); prefill and
    decode degrees may differ (rank 0 of each is its KV endpoint, engine/model_runner.py). A worker of TP degree N is its actor
    (rank 0) plus N-1 follower processes that rank 0 starts as its children (engine/tp_worker.py),
    so the whole worker runs on one node, and its actor holds the resources of all N ranks:
    `num_cpus` x N, `num_gpus` x N (whole GPUs: Ray's CUDA_VISIBLE_DEVICES then lists the N
    devices and rank r uses cuda:r) and `omp_num_threads` x N torch threads, which the engine
    splits evenly over its ranks. Custom `resources` are per worker, whatever N.
    `actor_options(role)` and `threads(role)` are that arithmetic, in one place.

    `cluster_auth`: the workers' gRPC security, the cluster secret itself (pickled with the spec
    to the controller and each worker actor, on whatever node: no file to copy there); whoever
    calls a worker (the controller, a decode worker, the routers) uses the same secret.
    `pdserve serve` always sets one; `INSECURE` is for tests only.
    """
    model: str = DEFAULT_MODEL_NAME
    device: str = "cpu"
    engine_options: dict[str, Any] = field(default_factory=dict)
    kv: KVOptions = field(default_factory=KVOptions)
    host: str = LOOPBACK_HOST
    advertise_node_ip: bool = False
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    omp_num_threads: int = 1  # torch threads per process (each TP rank)
    tensor_parallel_size: dict[str, int] = field(default_factory=dict)  # by role; absent: 1
    log_level: str = "WARNING"
    cluster_auth: ClusterAuth = INSECURE
    otlp_traces_endpoint: str | None = None  # the workers' OpenTelemetry traces (wire/tracing.py)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string: a model folder, a .gguf file or a packaged "
                             f"model ({', '.join(PACKAGED_MODELS)})")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)} once resolved, got {self.device!r}")
        if not self.host:
            raise ValueError("host must be a non-empty host name or IP address")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus and num_gpus must be >= 0, got {self.num_cpus} and {self.num_gpus}")
        unknown = sorted(set(self.resources) - set(ROLES))
        if unknown:
            raise ValueError(f"resources are by role ({', '.join(ROLES)}), got {', '.join(map(repr, unknown))}")
        checked = {}
        for role, resources in self.resources.items():
            try:
                checked[role] = validate_resources(resources)
            except ValueError as exc:
                raise ValueError(f"{pool_flag(role, 'resources')}: {exc}") from None
        self.resources = checked
        if self.device == "cuda" and self.num_gpus <= 0:
            raise ValueError("a cuda worker needs num_gpus > 0 (one GPU per worker: num_gpus=1)")
        if self.omp_num_threads < 1:
            raise ValueError(f"omp_num_threads must be >= 1, got {self.omp_num_threads}")
        if {"device", "role", "tensor_parallel_size"} & set(self.engine_options):
            raise ValueError("engine_options must not set device, role or tensor_parallel_size: use "
                             "WorkerSpec.device, the pool role and WorkerSpec.tensor_parallel_size")
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        unknown = sorted(set(self.tensor_parallel_size) - set(ROLES))
        if unknown:
            raise ValueError(f"tensor_parallel_size is by role ({', '.join(ROLES)}), got "
                             f"{', '.join(map(repr, unknown))}")
        for role, size in self.tensor_parallel_size.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{tp_flag(role)} must be an integer >= 1, got {size!r}")
            if size > 1 and self.device == "cuda" and self.num_gpus != 1:
                raise ValueError(f"{tp_flag(role)} {size} on cuda takes one whole GPU per rank ({size} per worker): "
                                 f"--worker-gpus must be 1 with tensor parallelism, got {self.num_gpus:g}")

    def tp(self, role: str) -> int:
        """The tensor-parallel degree of a worker of `role` (1: one process)."""
        return self.tensor_parallel_size.get(role, 1)

    def actor_options(self, role: str) -> dict[str, Any]:
        """The Ray resources one worker of `role` holds (`ray.remote(...).options(**...)`): those of
        all its tensor-parallel ranks, which run on the actor's node."""
        size = self.tp(role)
        return {"num_cpus": self.num_cpus * size, "num_gpus": self.num_gpus * size,
                "resources": dict(self.resources.get(role, {}))}

    def threads(self, role: str) -> int:
        """torch threads of a worker of `role`, all its ranks together (the engine gives each of
        its N ranks 1/N of them, engine/tp_worker.py)."""
        return self.omp_num_threads * self.tp(role)

    def worker_options(self, role: str, node_ip: str) -> WorkerOptions:
        """What a worker of `role` on the Ray node of IP `node_ip` is started with: it listens on
        `host` (that IP for `NODE_IP_HOST`) at any free port, its addresses say the node's IP with
        `advertise_node_ip`, and rank 0 (its actor) starts the N-1 followers of TP degree N."""
        host = node_ip if self.host == NODE_IP_HOST else self.host
        engine_options = dict(self.engine_options, device=self.device)
        if self.tp(role) > 1:
            engine_options["tensor_parallel_size"] = self.tp(role)
        return WorkerOptions(model=self.model, engine_options=engine_options, kv=self.kv, host=host,
                             advertise_host=node_ip if self.advertise_node_ip else host,
                             threads=self.threads(role), log_level=self.log_level, cluster_auth=self.cluster_auth,
                             otlp_traces_endpoint=self.otlp_traces_endpoint)


@dataclass
class PoolTargets:
    """How many workers of each role the controller keeps alive. Prefill and decode pools are
    both empty or both non-empty (disaggregation needs both ends)."""
    prefill: int = 1
    decode: int = 1
    colocated: int = 0

    def __post_init__(self) -> None:
        for role, count in self.counts().items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"the {pool_name(role)} pool size must be an integer >= 0, got {count!r}")
        if self.prefill and not self.decode:
            raise ValueError(f"{self.prefill} prefill worker(s) but no decode worker to send their KV to: "
                             "ask for at least one decode worker, or set the prefill pool to 0")
        if self.decode and not self.prefill:
            raise ValueError(f"{self.decode} decode worker(s) but no prefill worker: keep at least one prefill "
                             "worker, or use colocated workers (which prefill themselves); the router only "
                             "reports healthy with a prefill + decode pair or a colocated worker")
        if self.decode + self.colocated == 0:
            raise ValueError("no worker could answer requests: ask for at least one prefill + decode pair "
                             "or one colocated worker")

    def counts(self) -> dict[str, int]:
        """The pool sizes by role (the fields are named by pool: `Role.pool`)."""
        return {role: getattr(self, role.pool) for role in Role}

    @classmethod
    def from_counts(cls, counts: dict[str, int]) -> "PoolTargets":
        """The inverse of `counts()`."""
        return cls(**{role.pool: counts[role] for role in Role})

    def replace(self, prefill: int | None = None, decode: int | None = None,
                colocated: int | None = None) -> "PoolTargets":
        """A new, validated target with the given pools changed."""
        return PoolTargets(prefill=self.prefill if prefill is None else prefill,
                           decode=self.decode if decode is None else decode,
                           colocated=self.colocated if colocated is None else colocated)


@dataclass
class ControllerConfig:
    """The controller's pools and timings.

    Health: every `health_interval_s` each worker's gRPC Stats is polled (`rpc_timeout_s`);
    `unhealthy_after_failures` failed polls in a row mark it unhealthy, `replace_after_failures`
    replace it. A dead actor is noticed at once (its watch call fails) and replaced.
    Draining: a worker leaves after every router reports none of its requests in flight and
    its own Stats say nothing runs or waits, or after `drain_timeout_s`. A decode or colocated
    worker still streaming `drain_grace_s` into its drain hands its streams over (None: never):
    it ends them unfinished and the routers resume each on another worker (their migration), so
    a drain under load takes seconds; `pdserve serve` turns this off with `--max-migrations 0`.
    """
    targets: PoolTargets = field(default_factory=PoolTargets)
    worker: WorkerSpec = field(default_factory=WorkerSpec)
    name: str = DEFAULT_CONTROLLER_NAME
    namespace: str = DEFAULT_NAMESPACE
    health_interval_s: float = 1.0
    rpc_timeout_s: float = 5.0
    unhealthy_after_failures: int = 2
    replace_after_failures: int = 10
    start_timeout_s: float = 900.0
    drain_timeout_s: float = 120.0
    drain_grace_s: float | None = 5.0
    stop_grace_s: float = 5.0
    router_stale_after_s: float = 10.0
    max_start_backoff_s: float = 60.0
    max_events: int = 100
    # The goodput planner (deploy/planner.py): sizes the prefill and decode pools from what they
    # are measured to do under the SLO; None: the pools keep the sizes `scale()` sets.
    planner: PlannerConfig | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.namespace:
            raise ValueError("the controller name and namespace must be non-empty")
        if ":" in self.name:  # its workers are the actors named "<name>:<worker id>"
            raise ValueError(f"the controller name must not contain ':', got {self.name!r}")
        for name in ("health_interval_s", "rpc_timeout_s", "start_timeout_s", "drain_timeout_s",
                     "router_stale_after_s", "max_start_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.drain_grace_s is not None and not self.drain_grace_s >= 0:
            raise ValueError(f"drain_grace_s must be >= 0 when set, got {self.drain_grace_s}")
        if self.stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must be >= 0, got {self.stop_grace_s}")
        if self.unhealthy_after_failures < 1 or self.replace_after_failures < self.unhealthy_after_failures:
            raise ValueError("need 1 <= unhealthy_after_failures <= replace_after_failures, got "
                             f"{self.unhealthy_after_failures} and {self.replace_after_failures}")
        if self.max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {self.max_events}")


def capacity_shortfall(targets: PoolTargets, worker: WorkerSpec, resources: dict[str, float],
                       nodes: list[dict[str, float]] | None = None) -> str | None:
    """Why the pools cannot all be placed on a cluster with these total Ray `resources`, or None.
    (Workers beyond the capacity wait for resources: on a fixed cluster, forever.) Each worker
    holds `worker.actor_options(role)`: a tensor-parallel worker the CPUs and GPUs of all its
    ranks. Totals (custom resources included) are counted over the whole cluster; with `nodes`
    (each alive node's resources) a worker must also fit on one node, since all the ranks of a
    tensor-parallel worker run on its actor's node."""
    counts = targets.counts()
    workers = sum(counts.values())
    needs: dict[str, float] = {"CPU": 0.0, "GPU": 0.0}
    custom: dict[str, float] = {}
    for role, count in counts.items():
        options = worker.actor_options(role)
        needs["CPU"] += count * options["num_cpus"]
        needs["GPU"] += count * options["num_gpus"]
        for name, quantity in options["resources"].items():
            custom[name] = custom.get(name, 0.0) + count * quantity
    short = [f"{need:g} {name}s (the cluster has {resources.get(name, 0):g})"
             for name, need in needs.items() if need > resources.get(name, 0) + 1e-9]
    short += [f"{need:g} {name!r} (the cluster has {resources.get(name, 0):g})"
              for name, need in custom.items() if need > resources.get(name, 0) + 1e-9]
    if short:
        tp = " / --tensor-parallel-size" if any(worker.tp(role) > 1 for role, count in counts.items() if count) else ""
        return (f"{workers} worker(s) need {' and '.join(short)}; lower the pool sizes, --worker-cpus / "
                f"--worker-gpus / --<pool>-resources{tp}, or add nodes")
    if nodes is None:
        return None
    for role, count in counts.items():
        options = worker.actor_options(role)
        one = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **options["resources"]}
        if count and not any(all(node.get(name, 0) + 1e-9 >= need for name, need in one.items() if need)
                             for node in nodes):
            what = " and ".join(f"{need:g} {name}" for name, need in one.items() if need)
            size = worker.tp(role)
            ranks = f" (tensor parallel {size}: all its ranks run on its node)" if size > 1 else ""
            flags = ["--worker-cpus", "--worker-gpus"] + ([tp_flag(role)] if size > 1 else []) \
                + ([pool_flag(role, "resources")] if options["resources"] else [])
            return (f"a {pool_name(role)} worker needs {what} on one node{ranks}, and no node of the cluster has "
                    f"them; lower {' / '.join(flags)}, or add a bigger node")
    return None


def pool_flag(role: str, suffix: str) -> str:
    """The `pdserve serve` flag of a pool's setting: pool_flag("both", "resources") is --colocated-resources."""
    return f"--{pool_name(role)}-{suffix}"


def tp_flag(role: str) -> str:
    """The `pdserve serve` flag of a pool's tensor-parallel degree (or --tensor-parallel-size, all pools')."""
    return pool_flag(role, "tp")


def pool_name(role: str) -> str:
    """What users call a role's pool: "colocated" for role "both" (`Role.pool`)."""
    return Role.parse(role).pool
