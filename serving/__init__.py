"""What both worker servers need, once: engine flags and bring-up (with its KV connector), the
conversion of a wire request into an engine request, the gRPC server and the ready line.

A worker prints exactly one line when it serves, for tests and Ray to parse:

    READY grpc=HOST:PORT transport=ADDRESS role=ROLE

(`transport=` is empty for a colocated worker.) SIGTERM / SIGINT stop it gracefully.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

import kvtransfer
import wire

from engine import config as engine_config
from engine.model.default_model import DEFAULT_MODEL_NAME
from engine.model.packaged_models import PACKAGED_MODELS
from engine.process import configure_logging, freeze_startup_objects

logger = logging.getLogger(__name__)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEFAULT_MODEL_NAME,
                       help="model folder, GGUF file or a packaged model: "
                            + ", ".join(f"{m.name!r} ({m.description})" for m in PACKAGED_MODELS.values())
                            + " (default: %(default)s)")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda")
    group.add_argument("--seed", type=int, default=None, help="engine seed for unseeded sampling")
    group.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="processes (one GPU each on CUDA) that split the model's heads and MLP (default 1)")
    engine_config.add_engine_arguments(group)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=kvtransfer.TransferConfig.host, help="gRPC and transport listen host")
    group.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    group.add_argument("--advertise-host", default=None, help="host written into the printed addresses")
    group.add_argument("--log-level", default="WARNING")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as `engine.llm.build_engine_config` keyword options (unset ones left out)."""
    options = {name: getattr(args, name) for name in ("device", "seed", "tensor_parallel_size")
               if getattr(args, name) is not None}
    return {**options, **engine_config.engine_options(args)}


def add_kv_arguments(parser: argparse.ArgumentParser, side: str) -> None:
    """The KV connector's flags; `side` is "sender" (prefill) or "receiver" (decode)."""
    from engine.kv_connector import FAULTS  # (torch) here: deploy's router processes import this module
    group = parser.add_argument_group("kv transfer")
    group.add_argument("--transport", default="auto", choices=kvtransfer.TRANSPORT_CHOICES,
                       help=f"the KV {side}'s transports: auto (what the receiver offers / shm and tcp on CPU)")
    group.add_argument("--kv-timeout-s", type=float, default=kvtransfer.TransferConfig.timeout_s,
                       help="a silent peer fails a transfer after this (s; default: %(default)s)")
    group.add_argument("--inject-kv-fault", default=None, choices=FAULTS, help="testing only: break every transfer")


def build_async_engine(model: str, options: dict[str, Any], role: str, kv_transport=None, kv_connector_config=None):
    """The worker's engine on its own thread; `kv_transport(layer_caches, on_transfer_end)` builds
    its KV connector's sender or receiver (engine/kv_connector.py)."""
    from engine.async_engine import AsyncEngine
    from engine.engine import LLMEngine
    from engine.llm import build_engine_config
    # kv_events: the routers follow this worker's prefix cache through its KVEvents stream
    engine = LLMEngine(build_engine_config(model, role=role, kv_events=True, **options), kv_transport=kv_transport,
                       kv_connector_config=kv_connector_config)
    return AsyncEngine(engine)


async def request_from_wire(engine, message: Any, request_id: str, **extra):
    """The engine request for a Generate or Prefill message (ValueError for a client's mistake),
    with its priority (a prefill worker serves a batch prompt after an interactive one, as the
    decode worker does). A structured-output constraint is parsed and compiled off the event loop."""
    def build():
        return engine.engine.make_request(list(message.prompt_token_ids), wire.sampling_from_wire(message.sampling),
                                          request_id, priority=message.priority, cache_salt=message.cache_salt or None,
                                          num_resumed_tokens=message.num_resumed_tokens, **extra)
    if message.sampling.HasField("structured_output"):
        return await asyncio.to_thread(build)
    return build()


# ---- the RPCs both services answer alike ------------------------------------------------------

def abort(engine, request_id: str) -> Any:
    """Abort in any state (the engine stops a transfer before it frees the blocks)."""
    found = engine.is_open(request_id)
    engine.abort(request_id)
    return wire.messages().AbortResponse(found=found)


@contextlib.asynccontextmanager
async def unavailable_when_engine_down(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Around a Generate or Prefill call's use of the engine: `EngineUnavailable` (the engine
    cannot take requests, or stopped while this call ran) ends the call UNAVAILABLE, which the
    router (and a decode worker's remote prefill) treats as "try elsewhere"."""
    from engine.async_engine import EngineUnavailable
    try:
        yield
    except EngineUnavailable as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


def health(engine, role: str, model: str, transport_address: str = "") -> Any:
    """ok unless the engine cannot take requests (`AsyncEngine.down_reason`): the router then stops routing
    here at once and the controller replaces it."""
    ok = engine.down_reason is None
    return wire.messages().HealthResponse(ok=ok, role=role, model=model, transport_address=transport_address)


async def stats(engine, role: str, context: grpc.aio.ServicerContext, **kv_bytes) -> Any:
    """The worker's Stats from the engine thread's latest snapshot, also once the engine is down
    (its last one): the router polls Health and Stats together and must see Health's ok=False."""
    from wire.stats import worker_stats_to_wire
    snapshot, queued = engine.last_stats()
    return worker_stats_to_wire(role, snapshot, queued, engine.engine.config.cache.block_size,
                                rss_bytes=resident_bytes(), weight_bytes=engine.engine.runner.weight_bytes,
                                **kv_bytes)


KV_EVENTS_PER_MESSAGE = 4096  # ~0.5 MB of BlockStored events


async def kv_events(engine, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """KVEvents (both services): the engine's KV-cache snapshot, then every batch of events,
    until the caller leaves. A caller that falls behind gets RESOURCE_EXHAUSTED and subscribes
    again (a new snapshot); a dead engine, UNAVAILABLE."""
    from engine.async_engine import KVEventsOverflow
    from wire.kv_events import kv_event_batch_to_wire
    try:
        feed = await engine.subscribe_kv_events()
    except RuntimeError as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    try:
        async for batch in feed:
            # in parts: a whole cache's snapshot would exceed the message limit, and converting it
            # at once would hold this event loop (Generate, Health) for a second or more
            for part in batch.parts(KV_EVENTS_PER_MESSAGE):
                yield kv_event_batch_to_wire(part)
    except KVEventsOverflow as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    except RuntimeError as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    finally:
        feed.close()


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


async def serve(add_servicer: Callable[[grpc.aio.Server], None], host: str, port: int, advertise_host: str | None,
                ready_fields: Callable[[str], str], on_stop: Callable[[], Awaitable[None]]) -> None:
    """Bind, print the ready line, run until SIGTERM/SIGINT, then stop (grace 2 s) and `on_stop()`."""
    server = grpc.aio.server(options=list(wire.GRPC_OPTIONS))
    add_servicer(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"cannot listen on {host}:{port}")
    await server.start()
    freeze_startup_objects()
    address = f"{advertise_host or host}:{bound}"
    print(f"READY grpc={address} {ready_fields(address)}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)
    await on_stop()


def run(args: argparse.Namespace, serve_worker: Callable[[argparse.Namespace], Awaitable[None]]) -> None:
    """A worker process's main: logging at `--log-level`, then `serve_worker(args)` until stopped."""
    configure_logging(args.log_level)
    asyncio.run(serve_worker(args))


