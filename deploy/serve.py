"""`pdserve serve`: Ray (started or joined), the controller and its pools, and the routers.

The driver process (this one) holds the HTTP listening socket and supervises N router processes
that share it (deploy/supervisor.py, deploy/router_process.py): each serves the OpenAI API and
syncs its `WorkerPool` from the controller (deploy/router_sync.py); one that dies is restarted on
the same socket. The controller actor manages the (detached) worker actors. Startup order: Ray
-> controller (loads the pools) while the routers start -> HTTP served at once (`/health` is 503
until a prefill + decode pair, or a colocated worker, answers) -> the ready line `pdserve ready:
URL/v1 ...` -> the state file for `pdserve scale/status`.

The cluster secret (wire/cluster_auth.py): `--cluster-secret-file`, else one generated for this
run next to the state file (`<state file>.cluster-secret`, mode 0600, removed at exit). Every
worker's gRPC is mutual TLS under it: the worker actors and the controller get the secret in
`WorkerSpec.cluster_auth`, the router processes the file's path in their `RouterConfig`.

SIGINT / SIGTERM: stop the routers (in-flight requests get 5 s), stop every worker (grace), kill
the controller, stop Ray if this process started it, wait for the worker processes to exit,
remove the state file.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.cluster import (RaySettings, ServeState, check_state_file_free, default_state_file, process_started,
                            remove_state, start_or_join, write_state)
from deploy.config import (DEFAULT_CONTROLLER_NAME, DEVICE_CHOICES, ROLES, SYNC_INTERVAL_S, ControllerConfig,
                           PoolTargets, WorkerSpec, capacity_shortfall, tp_flag)
from deploy.planner import PlannerConfig
from engine.config import CacheConfig
from engine.model.default_model import DEFAULT_MODEL_NAME
from engine.model.packaged_models import PACKAGED_MODELS, is_packaged_model, package_installed, packaged_gguf_path
from router.config import LOOPBACK_HOST, LOOPBACK_HOSTS, RouterConfig
from serving.bringup import KVOptions
from wire.cluster_auth import ClusterAuth, generate_secret_file

logger = logging.getLogger("pdserve")

ROUTERS_READY_TIMEOUT_S = 120.0  # from the workers being up to the routers routing to them


@dataclass
class ServeOptions:
    """Everything `pdserve serve` takes; validated before Ray starts, so mistakes fail fast."""
    model: str = DEFAULT_MODEL_NAME
    served_model_name: str | None = None
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    host: str = RouterConfig.host
    port: int = RouterConfig.port
    device: str = "auto"  # auto: cuda when the Ray cluster has GPUs
    api_key: str | None = None
    # the workers' gRPC is mutual TLS under this secret; None: `serve` generates one for the run
    cluster_secret_file: Path | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    kv: KVOptions = field(default_factory=KVOptions)  # every worker's KV transport and connector settings
    worker_cpus: float | None = None  # Ray CPUs per worker (default: 0.5 on CPU, 1 with a GPU)
    worker_gpus: float | None = None  # Ray GPUs per cuda worker (default 1; 0.5 puts P and D on one GPU)
    # by role: Ray custom resources each worker of that pool requires (WorkerSpec.resources)
    pool_resources: dict[str, dict[str, float]] = field(default_factory=dict)
    omp_num_threads: int | None = None  # per process (TP rank); default: this machine's cores / initial ranks (>= 1)
    # by role: tensor-parallel degree of each worker of that pool (absent: 1)
    tensor_parallel_size: dict[str, int] = field(default_factory=dict)
    worker_host: str | None = None  # default: 127.0.0.1 on a local instance, 0.0.0.0 when joining; node-ip
    # router: resume a generation on another worker after its decode worker fails
    max_migrations: int = RouterConfig.max_migrations
    local_prefill_weight: float = RouterConfig.local_prefill_weight  # router: conditional disaggregation
    max_inflight_requests: int = RouterConfig.max_inflight_requests  # per router process
    batch_share: float = RouterConfig.batch_share  # of it, for requests of priority > 0
    # more RouterConfig fields, by name: router/config.py's SHARED_ROUTER_FLAGS
    router_options: dict[str, Any] = field(default_factory=dict)
    routers: int = 1  # router processes sharing the HTTP port
    ray: RaySettings = field(default_factory=RaySettings)
    controller_name: str = DEFAULT_CONTROLLER_NAME
    state_file: Path | None = None  # None: default_state_file()
    sync_interval_s: float = SYNC_INTERVAL_S
    health_interval_s: float = ControllerConfig.health_interval_s
    drain_timeout_s: float = ControllerConfig.drain_timeout_s
    # then a draining decode worker hands its streams over (with migrations)
    drain_grace_s: float = ControllerConfig.drain_grace_s
    start_timeout_s: float = ControllerConfig.start_timeout_s
    log_level: str = "INFO"
    planner: PlannerConfig | None = None  # the goodput planner; None: fixed pool sizes
    # every router's and worker's OpenTelemetry traces go to this collector (wire/tracing.py)
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        self.targets = PoolTargets(prefill=self.prefill, decode=self.decode, colocated=self.colocated)
        if not self.host:
            raise ValueError("--host must be a non-empty address")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {self.device!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must be non-empty when set")
        if self.worker_cpus is not None and self.worker_cpus <= 0:
            raise ValueError(f"--worker-cpus must be > 0, got {self.worker_cpus}")
        if self.worker_gpus is not None and not 0 < self.worker_gpus <= 1:
            raise ValueError(f"--worker-gpus must be in (0, 1] (a worker uses one GPU), got {self.worker_gpus}")
        if self.omp_num_threads is not None and self.omp_num_threads < 1:
            raise ValueError(f"--omp-num-threads must be >= 1, got {self.omp_num_threads}")
        if not self.sync_interval_s > 0:
            raise ValueError(f"sync_interval_s must be > 0, got {self.sync_interval_s}")
        if not 1 <= self.routers <= 64:
            raise ValueError(f"--routers must be in 1..64, got {self.routers}")
        if self.planner is not None and self.targets.prefill + self.targets.decode > self.planner.max_workers:
            raise ValueError(f"--prefill {self.targets.prefill} + --decode {self.targets.decode} is more than "
                             f"--max-workers {self.planner.max_workers}, the planner's limit")
        self.router_config(port=self.port)  # bad router options fail here
        if is_packaged_model(self.model):
            _check_package_installed(self.model)
        elif not Path(self.model).exists():
            raise ValueError(f"--model {self.model!r}: no such file or folder (give a Hugging Face model folder, "
                             f"a .gguf file, or a packaged model: {', '.join(map(repr, PACKAGED_MODELS))})")
        from engine.llm import build_engine_config
        build_engine_config(self.model, device="cpu", **self.engine_options)  # bad engine options fail here
        self.kv.check()  # and bad KV connector options
        cuda = self.device == "cuda"  # (auto: checked again once the device is known)
        self.controller_config(WorkerSpec(model=self.model, kv=self.kv, resources=self.pool_resources,
                                          tensor_parallel_size=dict(self.tensor_parallel_size),
                                          device="cuda" if cuda else "cpu",
                                          num_gpus=(self.worker_gpus or 1.0) if cuda else 0.0))

    def worker_spec(self, resources: dict[str, float], started_ray: bool) -> WorkerSpec:
        device = self.device
        if device == "auto":
            device = "cuda" if resources.get("GPU", 0) > 0 else "cpu"
        if device == "cuda" and resources.get("GPU", 0) <= 0:
            raise ValueError("--device cuda, but the Ray cluster has no GPU; use --device cpu, or join a cluster "
                             "with GPUs (--ray-address)")
        # Every rank of every worker is a process with its own threads.
        ranks = sum(count * self.tensor_parallel_size.get(role, 1) for role, count in self.targets.counts().items())
        threads = self.omp_num_threads or max(1, (os.cpu_count() or 1) // ranks)
        host = self.worker_host or (LOOPBACK_HOST if started_ray else "0.0.0.0")
        engine_options, kv = dict(self.engine_options), self.kv
        if device == "cuda" and (self.worker_gpus or 1.0) < 1.0:
            engine_options, transport = _sharing_a_gpu(engine_options, kv.transport, self.worker_gpus)
            kv = dataclasses.replace(kv, transport=transport)
        return WorkerSpec(model=self.model, device=device, engine_options=engine_options,
                          kv=kv, host=host, advertise_node_ip=host not in LOOPBACK_HOSTS,
                          num_cpus=self.worker_cpus or (1.0 if device == "cuda" else 0.5),
                          num_gpus=(self.worker_gpus or 1.0) if device == "cuda" else 0.0,
                          resources=self.pool_resources, omp_num_threads=threads,
                          tensor_parallel_size=dict(self.tensor_parallel_size),
                          cluster_auth=ClusterAuth.from_file(self.cluster_secret_file),
                          otlp_traces_endpoint=self.otlp_traces_endpoint)

    def router_config(self, port: int) -> RouterConfig:
        try:
            return RouterConfig(model=self.model, served_model_name=self.served_model_name, host=self.host,
                                port=port or 1, api_key=self.api_key,
                                cluster_secret_file=None if self.cluster_secret_file is None
                                else str(self.cluster_secret_file),
                                max_model_len=self.engine_options.get("max_model_len"),
                                block_size=self.engine_options.get("block_size", RouterConfig.block_size),
                                max_migrations=self.max_migrations, local_prefill_weight=self.local_prefill_weight,
                                max_inflight_requests=self.max_inflight_requests, batch_share=self.batch_share,
                                otlp_traces_endpoint=self.otlp_traces_endpoint, **self.router_options)
        except ValueError as exc:  # its messages start with the field's name: say the flag's
            field_name, _, rest = str(exc).partition(" ")
            raise ValueError(f"--{field_name.replace('_', '-')} {rest}") from None

    def controller_config(self, worker: WorkerSpec) -> ControllerConfig:
        # Handing streams over relies on the routers resuming them: not without migrations.
        grace = self.drain_grace_s if self.max_migrations > 0 else None
        return ControllerConfig(targets=self.targets, worker=worker, name=self.controller_name,
                                namespace=self.ray.namespace, health_interval_s=self.health_interval_s,
                                drain_timeout_s=self.drain_timeout_s, drain_grace_s=grace,
                                start_timeout_s=self.start_timeout_s, planner=self.planner)


class ServeError(Exception):
    """Startup failed for a reason the user can act on (message printed, exit status 1)."""


def serve(options: ServeOptions) -> int:
    """Run until SIGINT/SIGTERM; returns the process exit status."""
    state_file = options.state_file or default_state_file()
    stopping = _TerminateAsInterrupt()
    controller = None
    session: dict[str, Any] = {}
    worker_pids: list[int] = []
    status = 0
    sock = None
    generated_secret: Path | None = None
    try:
        check_state_file_free(state_file)
        if options.cluster_secret_file is None:  # from here on, the run's secret
            generated_secret = _generate_secret_file(state_file)
            options = dataclasses.replace(options, cluster_secret_file=generated_secret)
        # The port first: a busy one is reported at once, not after Ray, the model and the workers
        # started. Bound only: it listens once the routers are about to serve on it.
        sock = _bind(options.host, options.port)
        with stopping:
            session = start_or_join(options.ray)
            spec = options.worker_spec(session["resources"], session["started"])
            shortfall = capacity_shortfall(options.targets, spec, session["resources"], session["nodes"])
            if shortfall and session["started"]:
                raise ServeError(shortfall)
            if shortfall:
                logger.warning("%s; the workers that do not fit wait until nodes join", shortfall)
            _prepare_model(options.model)
            _check_model_splits(options.model, spec)
            controller = _create_controller(options.controller_config(spec))
            state = ServeState(pid=os.getpid(), ray_address=session["address"], namespace=options.ray.namespace,
                               controller=options.controller_name,
                               url=f"http://{_url_host(options.host)}:{sock.getsockname()[1]}",
                               started_ray=session["started"], token_auth=session["token_auth"],
                               pid_started=process_started(os.getpid()))
            write_state(state_file, state)  # `pdserve status` shows the workers as they start
            status = asyncio.run(_serve_async(options, spec, session, controller, state_file, state, worker_pids,
                                              sock))
    except (ServeError, ValueError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr, flush=True)
        status = 1
    except KeyboardInterrupt:
        pass
    finally:
        if sock is not None:
            sock.close()
        _teardown(controller, session, worker_pids, options.controller_name, options.ray.namespace)
        remove_state(state_file)
        if generated_secret is not None:
            generated_secret.unlink(missing_ok=True)
        print("pdserve stopped", flush=True)
    return status


async def _serve_async(options: ServeOptions, spec: WorkerSpec, session: dict[str, Any], controller: Any,
                       state_file: Path, state: ServeState, worker_pids: list[int], sock: socket.socket) -> int:
    from deploy.client import ControllerClient
    from deploy.router_process import RouterSpec
    from deploy.supervisor import RouterStartError, RouterSupervisor

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    client = ControllerClient(controller)
    sock.listen(2048)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    url = f"http://{_url_host(options.host)}:{port}"
    starting = loop.create_task(client.start())
    router_config = options.router_config(port)
    routers = RouterSupervisor(
        RouterSpec(index=0, listen_fd=-1, ready_fd=-1, parent_pid=os.getpid(), ray_address=session["address"],
                   namespace=options.ray.namespace, token_auth=session["token_auth"],
                   controller=options.controller_name, router=dataclasses.asdict(router_config),
                   planner=options.planner is not None, sync_interval_s=options.sync_interval_s,
                   log_level=options.log_level),
        options.routers, sock)
    try:
        try:
            await _unless_stopped(routers.start(), stop)
        except RouterStartError as exc:
            raise ServeError(str(exc)) from None
        try:
            status = await _unless_stopped(starting, stop)
        except ValueError as exc:
            raise ServeError(f"the worker pools did not start: {exc}") from None
        await _unless_stopped(_wait_healthy(url), stop)
        worker_pids.extend(w["pid"] for w in status["workers"] if w.get("pid"))
        write_state(state_file, dataclasses.replace(state, ready=True))
        colocated_tp = f" (tensor parallel {spec.tp('both')})" if spec.tp("both") > 1 else ""
        print(f"pdserve ready: {url}/v1 (model {options.model}; {options.prefill} prefill, {options.decode} "
              f"decode, {options.colocated} colocated worker(s){colocated_tp} on {spec.device}; "
              f"{options.routers} router(s); "
              f"Ray at {session['address']}; `pdserve status` / `pdserve scale`)", flush=True)
        if options.host not in LOOPBACK_HOSTS and options.api_key is None:
            logger.warning("listening on %s without --api-key: anyone who can reach it can use it", options.host)
        await stop.wait()
        return 0
    except _Stopped:
        return 0
    finally:
        logger.info("shutting down")
        await routers.stop()
        starting.cancel()
        try:
            final = await asyncio.wait_for(client.status(), 10)
            worker_pids.extend(w["pid"] for w in final["workers"] if w.get("pid"))
        except Exception as exc:  # only the local processes' exit check needs it
            logger.debug("no final status from the controller: %r", exc)
        try:
            await asyncio.wait_for(client.shutdown(), 60)
        except Exception as exc:  # _teardown still ends the workers by name
            logger.warning("the controller did not stop the workers (%r); ending them by name", exc)
        sock.close()


class _Stopped(Exception):
    pass


async def _unless_stopped(awaitable, stop: asyncio.Event):
    """Await `awaitable` unless SIGINT/SIGTERM comes first (then raise _Stopped)."""
    task = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise _Stopped()


async def _wait_healthy(url: str, timeout_s: float = ROUTERS_READY_TIMEOUT_S) -> None:
    """Until the routers can route (their /health: a healthy pair, or a colocated worker). The
    workers are up by then, so a router that cannot reach them (e.g. a wrong --worker-host) is an
    error with the router's last answer, not a silent wait."""
    import httpx
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with httpx.AsyncClient(timeout=5.0) as http:
        while time.monotonic() < deadline:
            try:
                answer = await http.get(f"{url}/health")
                if answer.status_code == 200:
                    return
                last = f"{answer.status_code} {answer.text}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)
    raise ServeError(f"the workers started, but the routers could not route to them within {timeout_s:g} s "
                     f"(their /health answered: {last}); check that this machine reaches the workers' "
                     "addresses in `pdserve status`")


def _generate_secret_file(state_file: Path) -> Path:
    """A new cluster secret for this run, next to the state file this run owns (one a run that
    died left there is replaced)."""
    path = state_file.with_name(state_file.name + ".cluster-secret")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    generate_secret_file(path)
    logger.info("worker gRPC: mutual TLS under a cluster secret generated for this run (%s)", path)
    return path


def _check_package_installed(model: str) -> None:
    """ValueError (the registry's message: which pip command installs it) when the package of the
    packaged model `model` is not installed; nothing is assembled yet (`_prepare_model` does it)."""
    if not package_installed(PACKAGED_MODELS[model].package):
        packaged_gguf_path(model)  # raises, saying how to install it


def _prepare_model(model: str) -> None:
    """Convert a GGUF model (a packaged one included: its GGUF assembled first if it comes in
    pieces) here, once, with a progress bar, before the workers start: otherwise each worker on
    this machine would convert it at the same time. A cached conversion costs only a stat."""
    from engine.model.gguf_loader import convert_gguf, converted_dir, is_complete_conversion
    path = packaged_gguf_path(model) if is_packaged_model(model) else os.path.expanduser(model)
    if not (path.endswith(".gguf") and os.path.isfile(path)) or is_complete_conversion(converted_dir(path)):
        return
    logger.info("converting %s to a cached float32 model (once; later runs reuse it)", path)
    started = time.monotonic()
    convert_gguf(path)
    logger.info("converted in %.0f s", time.monotonic() - started)


def _check_model_splits(model: str, spec: WorkerSpec) -> None:
    """ValueError unless the model's heads and MLP split over each pool's tensor-parallel degree
    (before any worker loads it; the model was just prepared, so this reads only its config)."""
    sizes = {role: spec.tp(role) for role in ROLES if spec.tp(role) > 1}
    if not sizes:
        return
    from engine.model.decoder import check_tensor_parallel
    from engine.model.loader import resolve_model
    arch = resolve_model(model).arch
    for role, size in sizes.items():
        try:
            check_tensor_parallel(arch, size)
        except ValueError as exc:
            raise ValueError(f"{tp_flag(role)} {size}: {exc}") from None


def _create_controller(config: ControllerConfig) -> Any:
    import ray

    from deploy.controller import ControllerActor
    from deploy.actors import stop_all
    from deploy.durable import GcsStateStore
    try:
        ray.get_actor(config.name, namespace=config.namespace)
    except ValueError:
        pass
    else:
        raise ServeError(f"a pdserve controller named {config.name!r} already runs in Ray namespace "
                         f"{config.namespace!r}; stop that `pdserve serve` or pass --controller-name")
    # What a `pdserve serve` of this name that died without stopping left behind.
    if stop_all(config.name, config.namespace):
        logger.warning("stopped the workers a previous controller %r left running", config.name)
    GcsStateStore(config.name, config.namespace).clear()
    # Ray restarts the controller whenever its process dies; it then recovers (deploy/controller.py).
    # It runs on this node, beside the routers it feeds: placed on another node, a partition that cut
    # that node off would have it replace workers that the routers still reach (soft: if this node
    # is gone, Ray may restart it elsewhere).
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    actor_class = ray.remote(ControllerActor).options(name=config.name, namespace=config.namespace, num_cpus=0,
                                                      max_restarts=-1, max_concurrency=1000, scheduling_strategy=here)
    return actor_class.remote(config)


def _sharing_a_gpu(engine_options: dict[str, Any], transport: str, share: float) -> tuple[dict[str, Any], str]:
    """Workers that share a GPU (`--worker-gpus` below 1): each sizes its KV cache from its share
    of the GPU's free memory (they start at once, each would take 85% of it), and `auto` KV
    transport leaves nccl out (it cannot join two ranks on one GPU): ucx where installed, else tcp."""
    options = dict(engine_options)
    if "num_blocks" not in options:
        options.setdefault("gpu_memory_utilization", round(CacheConfig.gpu_memory_utilization * share, 4))
    if transport == "auto":
        from kvtransfer import available_transports
        transport = "ucx" if "ucx" in available_transports() else "tcp"
        logger.info("workers share a GPU (--worker-gpus %g): KV transport %s (nccl needs one GPU per rank)",
                    share, transport)
    return options, transport


def _teardown(controller: Any, session: dict[str, Any], worker_pids: list[int], name: str, namespace: str) -> None:
    import ray

    from deploy.actors import stop_all
    from deploy.durable import GcsStateStore
    if not ray.is_initialized():
        return
    if controller is not None:
        with contextlib.suppress(Exception):
            ray.kill(controller, no_restart=True)
        try:  # the workers are detached: end them by name
            stop_all(name, namespace)
            GcsStateStore(name, namespace).clear()
        except Exception as exc:
            logger.warning("could not end the workers by name (%r): some may still run on the cluster; "
                           "`ray list actors` shows them (namespace %s)", exc, namespace)
    ray.shutdown()
    if session.get("started"):
        _wait_exited(worker_pids, timeout_s=30.0)


def _wait_exited(pids: list[int], timeout_s: float) -> None:
    """Local instance only: the worker processes exit once Ray is gone; make sure they did."""
    from deploy.cluster import pid_alive
    deadline = time.monotonic() + timeout_s
    remaining = [pid for pid in set(pids) if _is_ray_process(pid)]
    while remaining and time.monotonic() < deadline:
        time.sleep(0.2)
        remaining = [pid for pid in remaining if pid_alive(pid) and _is_ray_process(pid)]
    for pid in remaining:
        logger.warning("worker process %d did not exit with Ray; killing it", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _is_ray_process(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::")
    except OSError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port") from None
    return sock


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return LOOPBACK_HOST
    return f"[{host}]" if ":" in host else host


class _TerminateAsInterrupt:
    """While active, SIGTERM raises KeyboardInterrupt (so blocking startup calls unwind through
    the same cleanup as Ctrl-C); inside the event loop, signal handlers take over."""

    def __enter__(self) -> "_TerminateAsInterrupt":
        self._previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    def __exit__(self, *exc_info) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    @staticmethod
    def _raise(signum, frame) -> None:
        raise KeyboardInterrupt()
