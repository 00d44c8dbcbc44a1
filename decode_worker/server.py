"""The decode worker: an engine in `decode` role (or `both`, colocated) behind `DecodeService`.

Lifecycle of one Generate call (one state per line):

    ALLOCATED       own prefix-cache match, blocks allocated for the rest of the prompt; a short
                    uncached tail (below --local-prefill-threshold), no prefill worker named, or a
                    colocated worker: prefill locally (the request joins the engine queue)
    WAITING_FOR_KV  the receiver expects the blocks to fill; Prefill called on the prefill worker;
                    the receiver is polled, never blocking the engine thread
    RUNNING         KV complete and the first token back: `finish_import`, tokens stream as the
                    engine decodes them
    FINISHED        stop / length / abort / error: every block freed (or kept in the prefix cache)

A failed or timed-out transfer (dead prefill worker, silent peer, refused request) cancels the
receiver and falls back to local prefill, or ends the request with an error
(--on-transfer-failure). Abort (the `Abort` RPC or the caller cancelling its stream) in any
state stops the transfer before the blocks are freed, and aborts the prefill worker's side.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine import wire
from engine.engine import LLMEngine
from engine.kv_hooks import ImportPlan, KVCacheFullError
from prefill_worker.wire_convert import (chunk_from_delta, layout_to_wire, sampled_token_from_wire,
                                         worker_stats_to_wire)

logger = logging.getLogger(__name__)


@dataclass
class DecodeWorkerConfig:
    model: str = "default"
    role: str = "decode"  # "decode" or "both" (colocated: always prefills locally)
    engine_options: dict[str, Any] = field(default_factory=dict)
    transport: str = "auto"  # the receiver's transports: auto (shm + tcp on CPU), tcp, shm, ucx, nccl
    local_prefill_threshold: int = 64  # uncached prompt tokens below this are prefilled locally
    on_transfer_failure: str = "fallback"  # "fallback" to local prefill, or "fail" the request
    transfer_timeout_s: float = 60.0  # whole remote prefill (queueing at P + compute + transfer)
    kv_timeout_s: float = 5.0  # a silent sender fails the transfer after this long
    poll_interval_s: float = 0.002
    advertise_host: str | None = None
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.role not in ("decode", "both"):
            raise ValueError(f"role must be decode or both, got {self.role!r}")
        if self.transport not in ("auto", "tcp", "shm", "ucx", "nccl"):
            raise ValueError(f"transport must be auto, tcp, shm, ucx or nccl, got {self.transport!r}")
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}")
        if self.on_transfer_failure not in ("fallback", "fail"):
            raise ValueError(f"on_transfer_failure must be fallback or fail, got {self.on_transfer_failure!r}")
        for name in ("transfer_timeout_s", "kv_timeout_s", "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class _Live:
    """One Generate call's place in the lifecycle, shared with the Abort RPC (same event loop)."""
    request_id: str
    phase: str = "ALLOCATED"  # ALLOCATED, WAITING_FOR_KV, RUNNING
    abort_requested: bool = False


@dataclass
class _RemoteOutcome:
    ok: bool
    first_token: Any = None
    num_cached_tokens: int = 0
    kv_bytes: int = 0
    seconds: float = 0.0
    error: str = ""
    aborted: bool = False


class DecodeWorker:
    def __init__(self, config: DecodeWorkerConfig) -> None:
        from prefill_worker.serving import build_async_engine
        self.config = config
        self.role = config.role
        self.engine = build_async_engine(config.model, config.engine_options, config.role)
        self.block_size = self.engine.engine.runner.block_size
        self.receiver = None
        self.transport_address = ""
        self.layout = None
        if config.role == "decode":
            import kvtransfer
            caches = self.engine.engine.runner.kv_cache.layers
            self.receiver = kvtransfer.create_receiver(
                config.transport, caches, kvtransfer.TransferConfig(
                    timeout_s=config.kv_timeout_s, pending_timeout_s=config.transfer_timeout_s,
                    host=config.host, advertise_host=config.advertise_host))
            self.transport_address = self.receiver.address
            self.layout = kvtransfer.KVLayout.from_caches(caches)
        self._channels: dict[str, Any] = {}

    def prefill_stub(self, address: str) -> Any:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address)
            self._channels[address] = channel
        return wire.services().PrefillServiceStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self.engine.shutdown()
        if self.receiver is not None:
            self.receiver.close()

    def servicer(self):
        return _DecodeServicer(self)


class _DecodeServicer(wire.services().DecodeServiceServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self.config = worker.config
        self.pb = wire.messages()
        self._live: dict[str, _Live] = {}

    # ---- Generate ---------------------------------------------------------------------------

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext):
        worker = self.worker
        try:
            engine_request = await wire.off_loop_if_constrained(
                request.sampling, lambda: worker.engine.engine.make_request(
                    list(request.prompt_token_ids), wire.sampling_from_wire(request.sampling),
                    request.request_id or f"decode-{uuid.uuid4().hex}", priority=request.priority,
                    cache_salt=request.cache_salt or None, num_resumed_tokens=request.num_resumed_tokens))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = engine_request.request_id
        try:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = worker.engine.open_stream(request_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        live = _Live(request_id)
        self._live[request_id] = live
        want_logprobs = engine_request.sampling_params.logprobs is not None
        try:
            try:
                remote = await self._start(engine_request, request.prefill_address, live)
            except ValueError as exc:  # refused on the engine thread (e.g. larger than the cache)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except RuntimeError as exc:  # a host-cache copy failed; the engine already ended the request
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
            live.phase = "RUNNING"
            if live.abort_requested:  # arrived while the request was being added
                worker.engine.abort(request_id)
            first = True
            async for delta in stream:
                chunk = chunk_from_delta(delta, want_logprobs)
                if first:
                    first = False
                    if remote is not None:
                        chunk.kv_bytes_received = remote.kv_bytes
                        chunk.kv_transfer_seconds = remote.seconds
                        chunk.prefilled_remotely = remote.ok
                        if remote.ok:
                            chunk.num_cached_tokens = remote.num_cached_tokens
                yield chunk
        finally:
            del self._live[request_id]
            stream.close()

    async def _start(self, engine_request, prefill_address: str, live: _Live) -> _RemoteOutcome | None:
        """Put the request in the engine: local prefill, or import after a remote prefill.
        Returns the remote prefill's outcome (None when none was tried)."""
        engine = self.worker.engine
        request_id = engine_request.request_id
        if self.worker.role == "both" or not prefill_address:
            await asyncio.wrap_future(engine.call(LLMEngine.add, engine_request, False))
            return None
        try:
            plan: ImportPlan = await asyncio.wrap_future(engine.call(LLMEngine.add_imported, engine_request))
        except KVCacheFullError:  # no room to receive now: queue for local prefill (waits for blocks)
            await asyncio.wrap_future(engine.call(LLMEngine.add, engine_request, False))
            return None
        tail = engine_request.num_tokens - plan.num_cached_tokens
        if live.abort_requested:
            await asyncio.wrap_future(engine.call_and_deliver(LLMEngine.abort, request_id))
            return None
        if tail < self.config.local_prefill_threshold:
            await asyncio.wrap_future(engine.call(LLMEngine.fail_import, request_id, True))
            return None
        live.phase = "WAITING_FOR_KV"
        outcome = await self._remote_prefill(engine_request, plan, prefill_address, live)
        if outcome.ok:
            token = sampled_token_from_wire(outcome.first_token, engine_request.sampling_params.logprobs is not None)
            await asyncio.wrap_future(engine.call_and_deliver(LLMEngine.finish_import, request_id, token))
        elif outcome.aborted:
            await asyncio.wrap_future(engine.call_and_deliver(LLMEngine.abort, request_id))
        else:
            fallback = self.config.on_transfer_failure == "fallback"
            logger.warning("remote prefill of %s failed (%s): %s", request_id, outcome.error,
                           "prefilling locally" if fallback else "failing the request")
            await asyncio.wrap_future(engine.call_and_deliver(
                LLMEngine.fail_import, request_id, fallback, f"remote prefill failed: {outcome.error}"))
        return outcome

    async def _remote_prefill(self, engine_request, plan: ImportPlan, address: str, live: _Live) -> _RemoteOutcome:
        """Expect the blocks to fill, call Prefill, poll both until done, failed, aborted or timed out.
        Whatever happens, the receiver no longer writes into the blocks when this returns."""
        worker = self.worker
        receiver = worker.receiver
        request_id = engine_request.request_id
        dst_block_ids = [block_id for _, block_id in plan.blocks_to_fill]
        destination = self.pb.KVDestination(
            transport=worker.transport_address.split("://", 1)[0], address=worker.transport_address,
            layout=layout_to_wire(worker.layout), block_ids=dst_block_ids,
            first_block_index=plan.blocks_to_fill[0][0])
        prefill_request = self.pb.PrefillRequest(
            request_id=request_id, prompt_token_ids=engine_request.all_token_ids,
            sampling=wire.sampling_to_wire(engine_request.sampling_params), destination=destination,
            cache_salt=engine_request.cache_salt or "", num_resumed_tokens=engine_request.num_resumed_tokens)
        started = time.monotonic()
        deadline = started + self.config.transfer_timeout_s
        receiver.expect(request_id, dst_block_ids)
        call = None
        outcome = None
        try:
            call = worker.prefill_stub(address).Prefill(prefill_request, timeout=self.config.transfer_timeout_s)
            response = None
            while outcome is None:
                status = receiver.poll(request_id)
                if response is None and call.done():
                    try:
                        response = await call
                    except grpc.RpcError as exc:
                        outcome = _RemoteOutcome(False, error=f"prefill worker {address}: {exc.code().name}: "
                                                              f"{exc.details()}")
                        break
                    if response.finish_reason:
                        outcome = _RemoteOutcome(False, error=f"prefill worker {address}: {response.finish_reason}: "
                                                              f"{response.error}")
                        break
                if status.done and not status.ok:
                    outcome = _RemoteOutcome(False, error=f"KV transfer failed: {status.error}")
                elif status.ok and response is not None:
                    outcome = _RemoteOutcome(True, response.first_token, response.num_cached_tokens,
                                             status.bytes_transferred)
                elif live.abort_requested:
                    outcome = _RemoteOutcome(False, error="aborted", aborted=True)
                elif time.monotonic() > deadline:
                    outcome = _RemoteOutcome(False, error=f"no KV within {self.config.transfer_timeout_s} s")
                else:
                    await asyncio.sleep(self.config.poll_interval_s)
            outcome.seconds = time.monotonic() - started
            if not outcome.ok:
                outcome.kv_bytes = status.bytes_transferred
            return outcome
        finally:
            receiver.cancel(request_id)  # no byte is written into the blocks after this returns
            if outcome is None or not outcome.ok:
                if call is not None and not call.done():
                    call.cancel()
                asyncio.ensure_future(self._abort_on_prefill_worker(address, request_id))

    async def _abort_on_prefill_worker(self, address: str, request_id: str) -> None:
        try:
            await self.worker.prefill_stub(address).Abort(self.pb.AbortRequest(request_id=request_id), timeout=5.0)
        except grpc.RpcError:
            pass  # a dead prefill worker holds nothing any more

    # ---- other RPCs -------------------------------------------------------------------------

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        live = self._live.get(request.request_id)
        if live is None:
            return self.pb.AbortResponse(found=False)
        if live.phase == "RUNNING":
            self.worker.engine.abort(request.request_id)
        else:
            live.abort_requested = True  # the Generate call stops the transfer, then aborts
        return self.pb.AbortResponse(found=True)

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.pb.HealthResponse(ok=True, role=self.worker.role, model=self.config.model,
                                      transport_address=self.worker.transport_address)

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            stats, queued = self.worker.engine.stats()  # the engine thread's latest snapshot
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        received = self.worker.receiver.total_bytes_received if self.worker.receiver is not None else 0
        return worker_stats_to_wire(self.worker.role, stats, queued, self.worker.block_size,
                                    kv_bytes_received=received)
