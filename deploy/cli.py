"""The `pdserve` command line.

    pdserve serve   [--model default|gemma-3-270m|PATH] [--prefill N] [--decode M] [--colocated K] [--host H] [--port P]
                    [--device auto|cpu|cuda] [--transport auto|ucx|nccl|tcp|shm] [--ray-address ADDR]
                    [--api-key KEY] [--cluster-secret-file PATH] [--routers N] [--otlp-traces-endpoint URL]
                    [--tensor-parallel-size N] [--prefill-tp N] [--decode-tp N]
                    [engine and KV options: those of the workers, serving.add_worker_arguments]
                                                               run the cluster until Ctrl-C / SIGTERM
    pdserve scale   [--prefill N] [--decode M] [--colocated K] [--drain ADDRESS ...] [--no-wait]
    pdserve status  [--json] [--events N]
    pdserve bench   ARGS...                                    the serving benchmark (deploy/bench.py)

`scale` and `status` find the running controller through the state file that `serve` writes
(`$PDSERVE_CACHE_DIR/serve.json`, default `~/.cache/pdserve/serve.json`, or --state-file /
$PDSERVE_STATE_FILE), or through --ray-address (then --namespace / --controller-name name it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from deploy.cluster import RaySettings
from deploy.config import (DEFAULT_CONTROLLER_NAME, DEFAULT_NAMESPACE, DEVICE_CHOICES, NODE_IP_HOST, ROLES,
                           ControllerConfig, parse_resources, pool_flag, pool_name)
from deploy.planner import PlannerConfig
from deploy.serve import ServeOptions
from router.config import (LOCAL_PREFILL_WEIGHT_HELP, LOOPBACK_HOST, RouterConfig, add_shared_router_arguments,
                           shared_router_options)
from serving.bringup import add_worker_arguments, engine_options, kv_options
from wire.cluster_auth import add_secret_file_argument
from wire.tracing import add_traces_endpoint_argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,scale,status,bench}")

    serve = commands.add_parser("serve", help="start (or join) a Ray cluster and serve the OpenAI API")
    serve.add_argument("--served-model-name", default=None, help="the name clients send as 'model'")
    serve.add_argument("--prefill", type=int, default=ServeOptions.prefill,
                       help="prefill workers (default %(default)s)")
    serve.add_argument("--decode", type=int, default=ServeOptions.decode, help="decode workers (default %(default)s)")
    serve.add_argument("--colocated", type=int, default=ServeOptions.colocated,
                       help="colocated (prefill+decode) workers (default %(default)s)")
    serve.add_argument("--host", default=ServeOptions.host, help="HTTP bind address (default %(default)s)")
    serve.add_argument("--port", type=int, default=ServeOptions.port,
                       help="HTTP port (default %(default)s; 0: any free port)")
    serve.add_argument("--device", default=ServeOptions.device, choices=DEVICE_CHOICES,
                       help="auto: cuda when the Ray cluster has GPUs (one GPU per worker)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize and /admin "
                            "(default: $PDSERVE_API_KEY)")
    add_secret_file_argument(serve, without="a new secret for this run, next to the state file, removed at exit")
    add_traces_endpoint_argument(serve)  # handed to every router and worker it starts
    add_worker_arguments(serve, ROLES)  # --model, the engine's and the KV connector's: every worker's
    serve.add_argument("--routers", type=int, default=ServeOptions.routers,
                       help="router processes sharing the HTTP port; one that dies is restarted (default %(default)s)")
    serve.add_argument("--local-prefill-weight", type=float, default=RouterConfig.local_prefill_weight,
                       help=LOCAL_PREFILL_WEIGHT_HELP)
    add_shared_router_arguments(serve)  # every router process's
    serve.add_argument("--max-inflight-requests", type=int, default=RouterConfig.max_inflight_requests,
                       help="requests each router process admits at once; more get 429 with Retry-After "
                            "(default: %(default)s)")
    serve.add_argument("--batch-share", type=float, default=RouterConfig.batch_share,
                       help="the share of --max-inflight-requests that requests of priority > 0 may hold, so a "
                            "flood of them leaves room for the rest (default: %(default)s)")
    serve.add_argument("--max-migrations", type=int, default=RouterConfig.max_migrations,
                       help="resume a generation on another worker when its decode worker fails mid-stream, at most "
                            "this many times per request; 0: never (default: %(default)s)")
    placement = serve.add_argument_group("Ray and placement")
    placement.add_argument("--ray-address", default=None,
                           help="join this Ray cluster ('auto': the local `ray start` head); default: start a "
                                "local instance")
    placement.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Ray namespace (default %(default)s)")
    placement.add_argument("--controller-name", default=DEFAULT_CONTROLLER_NAME)
    placement.add_argument("--worker-cpus", type=float, default=None,
                           help="Ray CPUs each worker holds (default 0.5 on CPU, 1 with a GPU)")
    placement.add_argument("--worker-gpus", type=float, default=None,
                           help="Ray GPUs each cuda worker holds (default 1; 0.5 puts two workers on one GPU)")
    for role in ROLES:
        placement.add_argument(pool_flag(role, "resources"), dest=f"{role}_resources", type=_resources_argument,
                               default=None, metavar="JSON",
                               help=f"Ray custom resources each {pool_name(role)} worker requires, e.g. "
                                    "'{\"node_a\": 1}': places the pool on the nodes started with them "
                                    "(`ray start --resources`)")
    placement.add_argument("--omp-num-threads", type=int, default=None,
                           help="torch threads per worker process, each tensor-parallel rank (default: cores / "
                                "initial processes, at least 1)")
    parallel = serve.add_argument_group("tensor parallelism")
    parallel.add_argument("--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1, metavar="N",
                          help="every worker runs the model on N processes (rank 0 in its Ray actor, N-1 child "
                               "processes on the same node), holding N x --worker-cpus (CPU) or N GPUs (CUDA, rank "
                               "r on cuda:r) and N x --omp-num-threads threads (default 1); a pool's own flag "
                               "below overrides it")
    for role in ROLES:
        parallel.add_argument(pool_flag(role, "tp"), dest=f"{role}_tp", type=int, default=None, metavar="N",
                              help=f"tensor-parallel degree of the {pool_name(role)} workers (default: "
                                   "--tensor-parallel-size); prefill and decode degrees may differ")
    placement.add_argument("--worker-host", default=None,
                           help=f"where workers listen (default {LOOPBACK_HOST} locally, 0.0.0.0 when joining; "
                                f"{NODE_IP_HOST}: the IP of each worker's Ray node)")
    placement.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray instance (default: all)")
    placement.add_argument("--object-store-mb", type=int, default=RaySettings.object_store_memory_mb,
                           help="object store of a local instance (default %(default)s)")
    placement.add_argument("--include-dashboard", action="store_true", help="start Ray's dashboard (local instance)")
    placement.add_argument("--ray-temp-dir", default=None, help="Ray's temp/session folder for a local instance")
    placement.add_argument("--drain-timeout", type=float, default=ControllerConfig.drain_timeout_s,
                           help="longest wait for a draining worker's requests (s; default: %(default)s)")
    placement.add_argument("--drain-grace", type=float, default=ControllerConfig.drain_grace_s,
                           help="a draining decode worker still streaming after this long hands its streams over: "
                                "the routers resume them on other workers (s; needs --max-migrations > 0; "
                                "default: %(default)s)")
    placement.add_argument("--worker-start-timeout", type=float, default=ControllerConfig.start_timeout_s,
                           help="model load limit (s; default: %(default)s)")
    planner = serve.add_argument_group("goodput planner (deploy/planner.py)")
    planner.add_argument("--planner", action="store_true",
                         help="size the prefill and decode pools from their measured load under the SLO below")
    planner.add_argument("--planner-dry-run", action="store_true",
                         help="the planner only logs what it would do (pdserve status shows its decisions)")
    planner.add_argument("--slo-ttft-ms", type=float, default=PlannerConfig.slo_ttft_ms,
                         help="time-to-first-token target (default: %(default)s)")
    planner.add_argument("--slo-tpot-ms", type=float, default=PlannerConfig.slo_tpot_ms,
                         help="time-per-output-token target (default: %(default)s)")
    planner.add_argument("--max-workers", type=int, default=PlannerConfig.max_workers,
                         help="prefill + decode workers the planner may run (default: %(default)s)")
    planner.add_argument("--planner-interval", type=float, default=PlannerConfig.interval_s,
                         help="seconds between its decisions; a change needs 3 in a row (default: %(default)s)")
    planner.add_argument("--planner-cooldown", type=float, default=PlannerConfig.cooldown_s,
                         help="seconds after a change before the next (default: %(default)s)")
    _add_locator_arguments(serve, with_ray_address=False)
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))

    scale = commands.add_parser("scale", help="resize the pools of a running `pdserve serve`")
    scale.add_argument("--prefill", type=int, default=None)
    scale.add_argument("--decode", type=int, default=None)
    scale.add_argument("--colocated", type=int, default=None)
    scale.add_argument("--drain", action="append", default=[], metavar="ADDRESS",
                       help="when shrinking, drain this worker (gRPC address) first; repeatable")
    scale.add_argument("--no-wait", action="store_true", help="return at once instead of waiting for the pools")
    scale.add_argument("--timeout", type=float, default=900.0, help="longest wait (s)")
    _add_locator_arguments(scale)

    status = commands.add_parser("status", help="the workers of a running `pdserve serve`")
    status.add_argument("--json", action="store_true", help="print the controller's status as JSON")
    status.add_argument("--events", type=int, default=5, help="recent controller events to show (default 5)")
    _add_locator_arguments(status)

    bench = commands.add_parser("bench", help="the serving benchmark against a running server (deploy/bench.py)")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _planner_config(args: argparse.Namespace) -> PlannerConfig | None:
    if not (args.planner or args.planner_dry_run):
        return None
    return PlannerConfig(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, max_workers=args.max_workers,
                         interval_s=args.planner_interval, cooldown_s=args.planner_cooldown,
                         dry_run=args.planner_dry_run)


def _resources_argument(text: str) -> dict[str, float]:
    try:
        return parse_resources(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tensor_parallel_sizes(args: argparse.Namespace) -> dict[str, int]:
    """Each pool's degree: its own flag, else --tensor-parallel-size (checked by WorkerSpec)."""
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be an integer >= 1, got {args.tensor_parallel_size}")
    sizes = {role: getattr(args, f"{role}_tp") for role in ROLES}
    sizes = {role: args.tensor_parallel_size if size is None else size for role, size in sizes.items()}
    return {role: size for role, size in sizes.items() if size != 1}


def _pool_resources(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    return {role: getattr(args, f"{role}_resources") for role in ROLES if getattr(args, f"{role}_resources")}


def _add_locator_arguments(parser: argparse.ArgumentParser, with_ray_address: bool = True) -> None:
    parser.add_argument("--state-file", type=Path, default=None,
                        help="the serve state file (default $PDSERVE_STATE_FILE, else serve.json in "
                             "$PDSERVE_CACHE_DIR or ~/.cache/pdserve)")
    if with_ray_address:
        parser.add_argument("--ray-address", default=None, help="reach the controller through this Ray cluster")
        parser.add_argument("--namespace", default=DEFAULT_NAMESPACE)
        parser.add_argument("--controller-name", default=DEFAULT_CONTROLLER_NAME)


# ---- serve --------------------------------------------------------------------------------------

def serve_options(args: argparse.Namespace) -> ServeOptions:
    ray_settings = RaySettings(address=args.ray_address, namespace=args.namespace, num_cpus=args.num_cpus,
                               object_store_memory_mb=args.object_store_mb, include_dashboard=args.include_dashboard,
                               temp_dir=args.ray_temp_dir)
    return ServeOptions(model=args.model, served_model_name=args.served_model_name, prefill=args.prefill,
                        decode=args.decode, colocated=args.colocated, host=args.host, port=args.port,
                        device=args.device, api_key=_api_key(args.api_key),
                        cluster_secret_file=args.cluster_secret_file and Path(args.cluster_secret_file),
                        engine_options=engine_options(args),
                        kv=kv_options(args), worker_cpus=args.worker_cpus,
                        worker_gpus=args.worker_gpus, pool_resources=_pool_resources(args),
                        tensor_parallel_size=_tensor_parallel_sizes(args),
                        omp_num_threads=args.omp_num_threads, worker_host=args.worker_host,
                        max_migrations=args.max_migrations,
                        local_prefill_weight=args.local_prefill_weight,
                        max_inflight_requests=args.max_inflight_requests, batch_share=args.batch_share,
                        router_options=shared_router_options(args),
                        routers=args.routers, ray=ray_settings,
                        controller_name=args.controller_name, state_file=args.state_file,
                        drain_timeout_s=args.drain_timeout, drain_grace_s=args.drain_grace,
                        planner=_planner_config(args), otlp_traces_endpoint=args.otlp_traces_endpoint,
                        start_timeout_s=args.worker_start_timeout,
                        log_level=args.log_level.upper())


def run_serve(args: argparse.Namespace) -> int:
    from engine.process import configure_logging
    configure_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        options = serve_options(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    from deploy.serve import serve
    return serve(options)


# ---- scale / status -----------------------------------------------------------------------------

def _controller(args: argparse.Namespace) -> Any:
    from deploy.cluster import RAY_AUTH_ENV, connect, default_state_file, find_controller, read_state
    if args.ray_address:
        address, namespace, name = args.ray_address, args.namespace, args.controller_name
        token_auth = os.environ.get(RAY_AUTH_ENV, "").lower() == "token"
    else:
        state = read_state(args.state_file or default_state_file())
        address, namespace, name = state.ray_address, state.namespace, state.controller
        token_auth = state.token_auth
    connect(address, namespace, token_auth)
    return find_controller(name, namespace)


CONTROLLER_CALL_TIMEOUT_S = 60.0  # a controller answers status and scale at once, or restarts within this


def _controller_unavailable(exc: BaseException) -> str:
    import ray.exceptions
    if not isinstance(exc, ray.exceptions.RayError):
        raise exc
    kind = "did not answer in time" if isinstance(exc, ray.exceptions.GetTimeoutError) else "is unavailable"
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return (f"the controller {kind} (it may be restarting: try again in a minute; a scale it accepted "
            f"goes on): {first_line}")


def _api_key(flag: str | None) -> str | None:
    """--api-key as given (an empty one is refused: an unset shell variable, not "no key"), else
    $PDSERVE_API_KEY, where empty means none."""
    return flag if flag is not None else (os.environ.get("PDSERVE_API_KEY") or None)


def run_scale(args: argparse.Namespace) -> int:
    if args.prefill is None and args.decode is None and args.colocated is None:
        print("pdserve: error: nothing to scale: give --prefill, --decode and/or --colocated", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"pdserve: error: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    try:
        controller = _controller(args)
        import ray
        result = ray.get(controller.scale.remote(args.prefill, args.decode, args.colocated, args.drain),
                         timeout=CONTROLLER_CALL_TIMEOUT_S)
        if "error" in result:
            raise ValueError(result["error"])
        targets = result["targets"]
        if "warning" in result:
            print(f"pdserve: warning: {result['warning']}", file=sys.stderr)
        print(f"scaling to {targets['prefill']} prefill, {targets['decode']} decode, {targets['both']} colocated")
        if args.no_wait:
            return 0
        status = ray.get(controller.wait_settled.remote(args.timeout), timeout=args.timeout + CONTROLLER_CALL_TIMEOUT_S)
    except (ValueError, ConnectionError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # ray.exceptions.RayError: the controller died, restarts or does not answer
        print(f"pdserve: error: {_controller_unavailable(exc)}", file=sys.stderr)
        return 1
    print(format_status(status, events=3))
    if not status["settled"]:
        print(f"pdserve: the pools did not settle within {args.timeout:.0f} s (see the events above)",
              file=sys.stderr)
        return 1
    return 0


def run_status(args: argparse.Namespace) -> int:
    try:
        controller = _controller(args)
        import ray
        status = ray.get(controller.status.remote(), timeout=CONTROLLER_CALL_TIMEOUT_S)
    except (ValueError, ConnectionError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # ray.exceptions.RayError: the controller died, restarts or does not answer
        print(f"pdserve: error: {_controller_unavailable(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status, events=args.events))
    return 0


COLUMNS = (("ID", "worker_id"), ("ROLE", "role"), ("TP", "tensor_parallel_size"), ("STATE", "state"),
           ("ADDRESS", "address"), ("PID", "pid"), ("NODE", "node_id"), ("HEALTH", "healthy"),
           ("RUNNING", "running"), ("WAITING", "waiting"),
           ("KV USE", "kv_usage"), ("PREFIX HIT", "prefix_cache_hit_rate"), ("RSS", "rss_bytes"),
           ("WEIGHTS", "weight_bytes"))
NODE_ID_CHARS = 8  # of a Ray node id (56 hex digits) in the table; `--json` has all of it


def format_status(status: dict[str, Any], events: int = 5) -> str:
    """A fixed-width table of the workers (TP: each one's tensor-parallel degree; NODE: the Ray
    node it runs on, with all its ranks), the pool targets, and the last few events."""
    def cell(key: str, worker: dict[str, Any]) -> str:
        value = worker.get(key)
        if key == "healthy":
            return "ok" if value else "down"
        if key == "node_id":  # the Ray node: the start of its id, and its IP
            return f"{value[:NODE_ID_CHARS]}@{worker.get('node_ip') or '?'}" if value else "-"
        if key == "role":
            return pool_name(value)
        if key in ("rss_bytes", "weight_bytes"):
            return f"{value / 2**30:.2f} GiB" if value else "-"
        if key in ("kv_usage", "prefix_cache_hit_rate"):
            return "-" if value is None else f"{100 * value:.1f}%"
        return "-" if value in (None, "") else str(value)

    rows = [[title for title, _ in COLUMNS]]
    rows += [[cell(key, worker) for _, key in COLUMNS] for worker in status["workers"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in rows]
    targets = status["targets"]
    lines.append(f"targets: {targets['prefill']} prefill, {targets['decode']} decode, {targets['both']} colocated"
                 f" ({'settled' if status['settled'] else 'changing'}); routers: {status['routers']}")
    for event in status["events"][-events:] if events > 0 else []:
        lines.append(f"  {_clock(event['time'])}  {event['message']}")
    return "\n".join(lines)


def _clock(timestamp: float) -> str:
    import time
    return time.strftime("%H:%M:%S", time.localtime(timestamp))


# ---- bench --------------------------------------------------------------------------------------

def run_bench(args: argparse.Namespace) -> int:
    """The serving benchmark, in this process (part of the installed package; torch-free)."""
    from deploy.bench import main as bench_main
    return bench_main(list(args.args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # Everything after `bench` belongs to deploy/bench.py's parser, options included (argparse's
        # REMAINDER does not take a leading `--option`).
        return run_bench(argparse.Namespace(command="bench", args=argv[1:]))
    args = build_parser().parse_args(argv)
    handlers = {"serve": run_serve, "scale": run_scale, "status": run_status, "bench": run_bench}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
