"""One bring-up for every worker, whoever starts it: `python -m prefill_worker|decode_worker` and
deploy's Ray `WorkerActor` both call `start_worker(role, options, build)`.

- `add_worker_arguments(parser, roles)`: the engine and KV flags of workers of `roles`, defined
  once for the worker mains and `pdserve serve` (all roles); `engine_options(args)` and
  `kv_options(args)` read them back. The worker mains add `add_process_arguments` (device,
  tensor parallelism, listen address, log level, cluster secret file), which `pdserve serve` sets its own way.
- `WorkerOptions` / `KVOptions`: what a worker is built from; plain values, torch-free (deploy
  builds them in the CLI and pickles them to its actors).
- `Worker`: what a worker server offers whoever runs it (PrefillWorker, DecodeWorker).
- `start_worker`: the worker built off the event loop, its gRPC server bound and started
  (`RunningWorker`); `serve` / `run`: a worker process's main around it (the ready line, until
  SIGTERM / SIGINT).

Lifecycle of `start_worker` (one step per line):

    logging      configured at `options.log_level`; torch threads set (`options.threads`)
    build        `build(role, options)` on a thread: the engine (tensor parallel N: with its N-1
                 follower processes) and its KV endpoint
    listen       gRPC server on `options.host:options.port`, mutual TLS under the cluster secret
                 (`options.cluster_auth`; without one plaintext, with a warning beyond loopback);
                 addresses written with `options.advertise_host` (default: the host); with
                 `options.otlp_traces_endpoint`, tracing set up (wire/tracing.py, serving/traces.py)
    serving      startup objects frozen (engine/process.py); `RunningWorker.stop(grace_s)` stops
                 the server (open calls get the grace), then closes the worker
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import grpc

import kvtransfer
import wire
from engine import config as engine_config
from engine.config import Role
from engine.kv_hooks import FAULTS, ON_TRANSFER_FAILURE, KVConnectorConfig
from engine.model.default_model import DEFAULT_MODEL_NAME
from engine.model.packaged_models import PACKAGED_MODELS
from engine.process import configure_logging, freeze_startup_objects
from wire import tracing
from wire.cluster_auth import INSECURE, ClusterAuth, add_secret_file_argument

@dataclass(frozen=True)
class KVOptions:
    """A worker's KV transfer: its transports, how long a silent peer may stay silent, and its KV
    connector's settings: the fields of engine/kv_hooks.py's `KVConnectorConfig`, with its
    defaults (`connector_config()` builds it). Each side reads its own fields and ignores the
    other's: a prefill worker the lease, layer-wise push and send hold; a decode worker the
    local-prefill threshold, the failure policy and the transfer timeout; a colocated worker none."""
    transport: str = "auto"
    kv_timeout_s: float = kvtransfer.TransferConfig.timeout_s
    lease_s: float = KVConnectorConfig.lease_s
    transfer_timeout_s: float = KVConnectorConfig.transfer_timeout_s
    local_prefill_threshold: int = KVConnectorConfig.local_prefill_threshold
    on_transfer_failure: str = KVConnectorConfig.on_transfer_failure
    layerwise: bool = KVConnectorConfig.layerwise
    hold_send_s: float = KVConnectorConfig.hold_send_s
    inject_fault: str | None = KVConnectorConfig.inject_fault

    def __post_init__(self) -> None:
        kvtransfer.check_transport_choice(self.transport)
        if not self.kv_timeout_s > 0:
            raise ValueError(f"kv_timeout_s must be > 0, got {self.kv_timeout_s}")

    def connector_config(self, mac_key: bytes | None = None) -> KVConnectorConfig:
        """The engine's `KVConnectorConfig` (which checks the settings; ValueError names the field),
        its transfer checksum keyed by `mac_key` (the cluster secret's, `ClusterAuth.kv_mac_key`)."""
        return KVConnectorConfig(**{name: value for name, value in dataclasses.asdict(self).items()
                                    if name not in ("transport", "kv_timeout_s")}, mac_key=mac_key)

    def check(self) -> None:
        """ValueError, naming the flag, unless a worker's connector takes these settings."""
        try:
            self.connector_config()
        except ValueError as exc:
            raise _naming_the_flag(exc) from None


@dataclass
class WorkerOptions:
    """What one worker is built from, whoever starts it. `engine_options`: the flat options of
    `engine.llm.build_engine_config` (device, seed and tensor_parallel_size included); `host` is
    where its gRPC server and KV receiver listen, `advertise_host` what their addresses say
    (None: `host`); `threads`: torch threads of the worker, all its ranks together (None: torch's
    default); `cluster_auth`: its gRPC server's security (and its channels' to other workers:
    mutual TLS under the cluster secret; `INSECURE`: plaintext); `otlp_traces_endpoint`: where its
    OpenTelemetry traces go (wire/tracing.py; None: no tracing)."""
    model: str = DEFAULT_MODEL_NAME
    engine_options: dict[str, Any] = field(default_factory=dict)
    kv: KVOptions = field(default_factory=KVOptions)
    host: str = kvtransfer.TransferConfig.host
    port: int = 0
    advertise_host: str | None = None
    threads: int | None = None
    log_level: str = "WARNING"
    cluster_auth: ClusterAuth = INSECURE
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        tracing.check_endpoint(self.otlp_traces_endpoint)


class Worker(Protocol):
    """A worker server, as `start_worker` and whoever runs it (a worker process, a Ray actor) use it."""
    role: Role
    transport_address: str  # where its KV receiver listens ("" without one: prefill, colocated)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register its gRPC service (PrefillService or DecodeService)."""

    def hand_over(self) -> int:
        """Draining: end its streams unfinished, for their callers to resume elsewhere; how many."""

    def kv_settings(self) -> dict[str, Any]:
        """The KV settings in effect, read from its live connector and transport ({} without one)."""

    async def close(self) -> None:
        """Stop the engine and close the KV endpoint (after the gRPC server stopped)."""


WorkerBuilder = Callable[[Role, WorkerOptions], Worker]  # e.g. PrefillWorker.from_options


@dataclass
class RunningWorker:
    """A worker whose gRPC server serves at `grpc_address`."""
    worker: Worker
    server: grpc.aio.Server
    grpc_address: str

    def ready_line(self) -> str:
        """`READY grpc=HOST:PORT transport=ADDRESS role=ROLE`, what tests and tools parse (`transport=`
        is empty for a worker without a KV receiver)."""
        return f"READY grpc={self.grpc_address} transport={self.worker.transport_address} role={self.worker.role}"

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace=grace_s)
        await self.worker.close()
        if tracing.enabled:  # its last spans (the streams the stop ended), before a Ray actor is killed
            await asyncio.to_thread(tracing.flush)


async def start_worker(role: Role | str, options: WorkerOptions, build: WorkerBuilder) -> RunningWorker:
    """Bring a worker of `role` up (module docstring); RuntimeError when it cannot listen."""
    role = Role.parse(role)
    configure_logging(options.log_level)
    worker = await asyncio.to_thread(_build, role, options, build)
    server = grpc.aio.server(options=list(wire.GRPC_OPTIONS))
    worker.add_to_server(server)
    try:
        port = options.cluster_auth.add_port(server, f"{options.host}:{options.port}")
    except RuntimeError:  # (grpc raises where older releases returned 0)
        port = 0
    if port == 0:
        await worker.close()
        raise RuntimeError(f"the {role.pool} worker cannot listen on {options.host}:{options.port}")
    address = f"{options.advertise_host or options.host}:{port}"
    tracing.setup(options.otlp_traces_endpoint, "pdserve-prefill" if role is Role.PREFILL else "pdserve-decode",
                  {"service.instance.id": address, "pdserve.worker.role": role.value})
    await server.start()
    freeze_startup_objects()
    return RunningWorker(worker, server, address)


def _build(role: Role, options: WorkerOptions, build: WorkerBuilder) -> Worker:
    if options.threads is not None:
        import torch  # (this module is torch-free: deploy's CLI and router processes import it)
        torch.set_num_threads(options.threads)
    return build(role, options)


async def serve(role: Role | str, options: WorkerOptions, build: WorkerBuilder) -> None:
    """A worker process: start it, print the ready line, serve until SIGTERM / SIGINT, stop (grace 2 s)."""
    try:
        running = await start_worker(role, options, build)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    print(running.ready_line(), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop(grace_s=2.0)


def run(role: Role | str, options: WorkerOptions, build: WorkerBuilder) -> None:
    """A worker process's main: `serve` until stopped."""
    asyncio.run(serve(role, options, build))


# ---- the flags ----------------------------------------------------------------------------------

# The flag of each KVOptions field (its argparse dest is the field's name).
KV_FLAGS = {"transport": "--transport", "kv_timeout_s": "--kv-timeout-s", "inject_fault": "--inject-kv-fault",
            "lease_s": "--export-lease-s", "layerwise": "--no-layerwise-push", "hold_send_s": "--hold-kv-send-s",
            "local_prefill_threshold": "--local-prefill-threshold", "on_transfer_failure": "--on-transfer-failure",
            "transfer_timeout_s": "--transfer-timeout-s"}


def add_worker_arguments(parser: argparse.ArgumentParser, roles: Iterable[Role]) -> None:
    """The model, engine and KV flags of workers of `roles` (the KV flags of the sending side only
    where one of them sends KV, of the importing side where one imports). Unset engine flags stay
    None, so the engine's (and the role's) defaults apply; the KV flags default to `KVOptions`'."""
    roles = [Role.parse(role) for role in roles]
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=DEFAULT_MODEL_NAME,
                        help="model folder, .gguf file or a packaged model: "
                             + ", ".join(f"{m.name!r} ({m.description})" for m in PACKAGED_MODELS.values())
                             + " (default: %(default)s)")
    engine.add_argument("--seed", type=int, default=None, help="engine seed for unseeded sampling")
    engine_config.add_engine_arguments(engine)
    kv = parser.add_argument_group("kv transfer")
    kv.add_argument("--transport", default=KVOptions.transport, choices=kvtransfer.TRANSPORT_CHOICES,
                    help="KV transport between prefill and decode workers: auto (what the receiver offers; shm "
                         "and tcp on CPU) or one of them (default: %(default)s)")
    kv.add_argument("--kv-timeout-s", dest="kv_timeout_s", type=float, metavar="S", default=KVOptions.kv_timeout_s,
                    help="a silent peer fails a transfer after this (s; default: %(default)s)")
    kv.add_argument("--inject-kv-fault", dest="inject_fault", default=None, choices=FAULTS,
                    help="testing only: break every transfer")
    if any(role.sends_kv for role in roles):
        kv.add_argument("--export-lease-s", dest="lease_s", type=float, metavar="S", default=KVOptions.lease_s,
                        help="prefill: longest time blocks stay pinned for a send without progress "
                             "(s; default: %(default)s)")
        kv.add_argument("--no-layerwise-push", dest="layerwise", action="store_false",
                        help="prefill: push a prompt's KV after its whole prefill instead of layer group by "
                             "layer group")
        kv.add_argument("--hold-kv-send-s", dest="hold_send_s", type=float, metavar="S", default=KVOptions.hold_send_s,
                        help="testing only: delay every KV send")
    if any(role.imports_kv for role in roles):
        kv.add_argument("--local-prefill-threshold", dest="local_prefill_threshold", type=int, metavar="N",
                        default=KVOptions.local_prefill_threshold,
                        help="decode: prefill locally when fewer prompt tokens than this are not in the prefix "
                             "cache (default: %(default)s)")
        kv.add_argument("--on-transfer-failure", dest="on_transfer_failure", default=KVOptions.on_transfer_failure,
                        choices=ON_TRANSFER_FAILURE,
                        help="decode: after a failed, timed-out or unverifiable KV transfer, prefill locally "
                             "(fallback) or fail the request (default: %(default)s)")
        kv.add_argument("--transfer-timeout-s", dest="transfer_timeout_s", type=float, metavar="S",
                        default=KVOptions.transfer_timeout_s,
                        help="decode: longest wait for a remote prefill's progress: its first KV (queue and "
                             "first chunk), then more KV, then its answer (s; default: %(default)s)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags of `add_worker_arguments` that were given, as `build_engine_config` options."""
    seed = {} if args.seed is None else {"seed": args.seed}
    return {**seed, **engine_config.engine_options(args)}


def kv_options(args: argparse.Namespace) -> KVOptions:
    """The KV flags of `add_worker_arguments` (those of the side it left out: KVOptions' defaults)."""
    given = vars(args)
    try:
        return KVOptions(**{name: given[name] for name in KV_FLAGS if name in given})
    except ValueError as exc:
        raise _naming_the_flag(exc) from None


def _naming_the_flag(exc: ValueError) -> ValueError:
    """A KVOptions / KVConnectorConfig message, which starts with the field's name, with its flag's."""
    name, _, rest = str(exc).partition(" ")
    return ValueError(f"{KV_FLAGS[name]} {rest}" if name in KV_FLAGS else str(exc))


def add_process_arguments(parser: argparse.ArgumentParser) -> None:
    """What a worker started by hand takes besides `add_worker_arguments` (`pdserve serve` places
    its workers itself: --device, --tensor-parallel-size, --worker-host, --log-level, and has its
    own --cluster-secret-file and --otlp-traces-endpoint)."""
    device = parser.add_argument_group("device")
    device.add_argument("--device", default="auto", help="auto, cpu or cuda")
    device.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="processes (one GPU each on CUDA) that split the model's heads and MLP (default 1)")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=kvtransfer.TransferConfig.host, help="gRPC and transport listen host")
    group.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    group.add_argument("--advertise-host", default=None, help="host written into the printed addresses")
    group.add_argument("--log-level", default="WARNING")
    add_secret_file_argument(group, without="plaintext gRPC, which anyone who reaches the port can drive")
    tracing.add_traces_endpoint_argument(group)


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    """A worker process's options from `add_worker_arguments` and `add_process_arguments`."""
    device = {"device": args.device}
    if args.tensor_parallel_size is not None:
        device["tensor_parallel_size"] = args.tensor_parallel_size
    return WorkerOptions(model=args.model, engine_options={**device, **engine_options(args)}, kv=kv_options(args),
                         host=args.host, port=args.port, advertise_host=args.advertise_host, log_level=args.log_level,
                         cluster_auth=ClusterAuth.from_file(args.cluster_secret_file),
                         otlp_traces_endpoint=args.otlp_traces_endpoint)
