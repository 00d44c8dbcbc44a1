"""What both worker servers need, once: their engine (with its KV connector), the conversion of a
wire request into an engine request, and the RPCs both answer alike. Their flags and bring-up,
shared with deploy's Ray actor, are serving/bringup.py (`start_worker`; re-exported here).

A worker process prints exactly one line when it serves, for tests and tools to parse:

    READY grpc=HOST:PORT transport=ADDRESS role=ROLE

(`transport=` is empty for a prefill or colocated worker.) SIGTERM / SIGINT stop it gracefully.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from typing import Any, AsyncIterator

import grpc

import wire
from engine.kv_hooks import KVConnectorConfig
from serving.bringup import (KV_FLAGS, KVOptions, RunningWorker, Worker, WorkerBuilder, WorkerOptions,  # noqa: F401
                             add_process_arguments, add_worker_arguments, engine_options, kv_options, run, serve,
                             start_worker, worker_options)

logger = logging.getLogger(__name__)


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
        return engine.make_request(list(message.prompt_token_ids), wire.sampling_from_wire(message.sampling),
                                   request_id, priority=message.priority, cache_salt=wire.cache_salt_from_wire(message),
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


def kv_settings(transport: str, transfer_config: Any, connector_config: KVConnectorConfig) -> dict[str, Any]:
    """`Worker.kv_settings`: the transport choice, the silent-peer timeout of the live sender or
    receiver (its kvtransfer.TransferConfig) and the config its engine's connector was built with;
    of the keys, only whether they are set."""
    settings = dataclasses.asdict(connector_config)
    settings["mac_key"] = connector_config.mac_key is not None
    return {"transport": transport, "kv_timeout_s": transfer_config.timeout_s,
            "auth_key": transfer_config.auth_key is not None, **settings}


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
    return worker_stats_to_wire(role, snapshot, queued, engine.block_size,
                                rss_bytes=resident_bytes(), weight_bytes=engine.weight_bytes,
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
