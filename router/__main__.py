"""`python -m router --model default --prefill HOST:PORT --decode HOST:PORT [--colocated HOST:PORT]`

Serves the OpenAI-compatible API on --host/--port (127.0.0.1:8000 by default) over the given
static worker pool. `--api-key` (or the PDSERVE_API_KEY environment variable) makes every /v1
route require `Authorization: Bearer <key>`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.model.packaged_models import PACKAGED_MODELS
from engine.process import configure_logging, freeze_startup_objects
from router.config import (DECODE_POLICIES, LOCAL_PREFILL_WEIGHT_HELP, LOOPBACK_HOSTS, PREFILL_POLICIES, RouterConfig,
                           add_shared_router_arguments, shared_router_options)
from wire import tracing
from wire.cluster_auth import add_secret_file_argument


def _addresses(values: list[str] | None) -> list[str]:
    """Accepts repeated flags and comma-separated lists."""
    return [a.strip() for value in values or [] for a in value.split(",") if a.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router", description="pdserve router: the OpenAI-compatible HTTP API")
    p.add_argument("--model", default=RouterConfig.model,
                   help="tokenizer source: a Hugging Face folder, a .gguf file or a packaged model "
                        f"({', '.join(PACKAGED_MODELS)}) (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model)")
    p.add_argument("--prefill", action="append", metavar="HOST:PORT", help="a prefill worker (repeatable)")
    p.add_argument("--decode", action="append", metavar="HOST:PORT", help="a decode worker (repeatable)")
    p.add_argument("--colocated", action="append", metavar="HOST:PORT",
                   help="a colocated (prefill+decode) worker (repeatable)")
    p.add_argument("--host", default=RouterConfig.host, help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=RouterConfig.port, help="(default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize "
                        "(default: $PDSERVE_API_KEY)")
    add_secret_file_argument(p, without="plaintext gRPC to the workers, which then must have none either")
    tracing.add_traces_endpoint_argument(p)
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-request-body-bytes", type=int, default=RouterConfig.max_request_body_bytes)
    p.add_argument("--max-inflight-requests", type=int, default=RouterConfig.max_inflight_requests)
    p.add_argument("--batch-share", type=float, default=RouterConfig.batch_share,
                   help="the share of --max-inflight-requests that priority > 0 requests may hold")
    p.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default=RouterConfig.prefill_policy)
    p.add_argument("--decode-policy", choices=DECODE_POLICIES, default=RouterConfig.decode_policy)
    p.add_argument("--stats-interval", type=float, default=RouterConfig.stats_interval_s,
                   help="seconds between worker health/stats polls (default: %(default)s)")
    p.add_argument("--max-migrations", type=int, default=RouterConfig.max_migrations,
                   help="resume a generation on another worker when its decode worker fails mid-stream, at most "
                        "this many times per request; 0: never (default: %(default)s)")
    p.add_argument("--local-prefill-weight", type=float, default=RouterConfig.local_prefill_weight,
                   help=LOCAL_PREFILL_WEIGHT_HELP)
    p.add_argument("--no-kv-events", action="store_true",
                   help="do not follow the workers' KV-cache events; route on what this router sent where "
                        "(an estimate: it cannot see evictions, host-tier copies or other routers' requests)")
    p.add_argument("--host-hit-cost", type=float, default=RouterConfig.host_hit_cost,
                   help="what a host-tier KV hit costs next to recomputing the block, in [0, 1] (default: %(default)s)")
    add_shared_router_arguments(p)  # (pdserve serve's too)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    config = RouterConfig(
        model=args.model, served_model_name=args.served_model_name, prefill=_addresses(args.prefill),
        decode=_addresses(args.decode), colocated=_addresses(args.colocated), host=args.host, port=args.port,
        api_key=args.api_key or None, cluster_secret_file=args.cluster_secret_file,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        max_model_len=args.max_model_len,
        max_request_body_bytes=args.max_request_body_bytes, max_inflight_requests=args.max_inflight_requests,
        batch_share=args.batch_share,
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy, stats_interval_s=args.stats_interval,
        max_migrations=args.max_migrations, local_prefill_weight=args.local_prefill_weight,
        kv_events=not args.no_kv_events, host_hit_cost=args.host_hit_cost, **shared_router_options(args))
    if not (config.decode or config.colocated):
        raise ValueError("no worker to send requests to: pass --decode HOST:PORT (with --prefill HOST:PORT) "
                         "or --colocated HOST:PORT")
    return config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = config_from_args(args)
        # before the app: create_app adds the request spans' middleware only when tracing is on
        tracing.setup(config.otlp_traces_endpoint, "pdserve-router",
                      {"service.instance.id": f"{config.host}:{config.port}"})
        from router.app import create_app
        app = create_app(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import uvicorn
    if config.host not in LOOPBACK_HOSTS and config.api_key is None:
        logging.getLogger("router").warning("binding %s without --api-key: anyone who can reach it can use it",
                                            config.host)
    freeze_startup_objects()
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level)
    tracing.shutdown()  # (the app's shutdown sent the queued spans already: router/traces.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
