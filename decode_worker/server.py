"""The decode worker: an engine in `decode` role (or `both`, colocated) behind `DecodeService`, an
adapter between gRPC and the engine. The engine's KV connector (engine/kv_connector.py) does the
hand-off; this module only carries the Prefill call to the prefill worker and its answer back.

Lifecycle of one Generate call. `add_imported` matches the worker's own prefix cache and
allocates blocks for the rest of the prompt; a short uncached tail (below
--local-prefill-threshold), no prefill worker named, or a colocated worker: the prompt is
prefilled locally (WAITING, the engine queue). Otherwise, one RequestStatus per line:

    WAITING_FOR_KV  the receiver expects the blocks; Prefill called on the prefill worker; the
                    engine admits the request once every layer of every block is in and verified
                    (epoch, block hashes, checksum)
    RUNNING         the prefill worker's first token appended, tokens stream as the engine decodes
                    (the first one goes out as the prefill worker answers, before the KV is checked:
                    it is right whatever becomes of the bytes; a fallback keeps it)
    FINISHED_*      stop / length / abort / error: every block freed (or kept in the prefix cache)

A failed, late, short or unverifiable transfer (dead prefill worker, silent peer, flipped byte,
refused request) falls back to local prefill, or ends the request with an error
(--on-transfer-failure); each is counted by reason in Stats. Abort (the `Abort` RPC or the caller
cancelling its stream) in any state stops the transfer before the blocks are freed, and cancels
the prefill worker's side.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc

import kvtransfer
import serving
import wire
from engine.async_engine import EngineUnavailable
from engine.config import Role
from engine.engine import LLMEngine
from engine.kv_hooks import KVConnectorConfig
from engine.kv_hooks import KVCacheFullError
from engine.model.default_model import DEFAULT_MODEL_NAME
from serving.traces import GenerateTrace
from wire import tracing
from wire.cluster_auth import INSECURE, ClusterAuth
from wire.convert import chunk_from_delta, prefill_request_to_wire, producer_report_from_wire


@dataclass
class DecodeWorkerConfig:
    model: str = DEFAULT_MODEL_NAME
    role: Role = Role.DECODE  # decode, or both (colocated: always prefills locally); a name is parsed
    engine_options: dict[str, Any] = field(default_factory=dict)
    transport: str = "auto"  # the receiver's transports: auto (shm + tcp on CPU), tcp, shm, ucx, nccl
    kv_timeout_s: float = kvtransfer.TransferConfig.timeout_s  # a silent sender fails the transfer after this long
    # local-prefill threshold, transfer timeout (a remote prefill without progress), on_transfer_failure
    connector: KVConnectorConfig = field(default_factory=KVConnectorConfig)
    advertise_host: str | None = None
    host: str = kvtransfer.TransferConfig.host  # where the KV receiver listens
    # its channels to prefill workers (the cluster's, as its server's) and its KV receiver's handshake
    cluster_auth: ClusterAuth = INSECURE

    def __post_init__(self) -> None:
        self.role = Role.parse(self.role)
        if not self.role.decodes:
            raise ValueError(f"a decode worker's role is decode or both, got {self.role.value!r}")
        kvtransfer.check_transport_choice(self.transport)


class PrefillChannels:
    """One gRPC channel per prefill worker address, shared by the calls to it (gRPC reconnects by
    itself when the worker there restarts). Prefill workers come and go on new addresses (scaling,
    restarts), so a channel with no call in flight for `idle_close_s` is closed when the next call
    starts: the map holds the addresses in use, not every address ever used. `auth` secures them
    (the cluster secret the workers share)."""

    def __init__(self, idle_close_s: float = 300.0, auth: ClusterAuth = INSECURE) -> None:
        self.idle_close_s = idle_close_s
        self.auth = auth
        self._channels: dict[str, Any] = {}
        self._in_flight: dict[str, int] = {}
        self._last_used: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._channels)

    @contextlib.asynccontextmanager
    async def use(self, address: str) -> AsyncIterator[Any]:
        await self._close_idle(exclude=address)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.auth.channel(address, options=wire.GRPC_OPTIONS)
        self._in_flight[address] = self._in_flight.get(address, 0) + 1
        try:
            yield channel
        finally:
            self._in_flight[address] -= 1
            self._last_used[address] = time.monotonic()

    async def _close_idle(self, exclude: str) -> None:
        now = time.monotonic()
        idle = [address for address in self._channels if address != exclude and not self._in_flight[address]
                and now - self._last_used[address] >= self.idle_close_s]
        closing = []
        for address in idle:  # all out of the map before the first await: a concurrent sweep finds none
            closing.append(self._channels.pop(address))
            del self._in_flight[address], self._last_used[address]
        for channel in closing:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()


class DecodeWorker(wire.services().DecodeServiceServicer):
    """The engine (decode or colocated role), whose connector's receiver takes the KV, and the
    DecodeService over it (a `serving.Worker`)."""

    @classmethod
    def from_options(cls, role: Role, options: serving.WorkerOptions) -> DecodeWorker:
        """The worker `serving.start_worker` brings up (role decode or both)."""
        return cls(DecodeWorkerConfig(model=options.model, role=role, engine_options=options.engine_options,
                                      transport=options.kv.transport, kv_timeout_s=options.kv.kv_timeout_s,
                                      connector=options.kv.connector_config(options.cluster_auth.kv_mac_key),
                                      host=options.host,
                                      advertise_host=options.advertise_host, cluster_auth=options.cluster_auth))

    def __init__(self, config: DecodeWorkerConfig) -> None:
        self.config = config
        self.role = config.role
        make_receiver = None
        # The receiver (decode role) its engine's connector gets: the connector needs only its
        # KVReceiverTransport part, this server keeps the rest of kvtransfer.KVReceiver (address,
        # layout, bytes, close).
        self.receiver: kvtransfer.KVReceiver | None = None
        if config.role.imports_kv:
            # pending_timeout_s None: the connector times a transfer that does not start or stalls
            # (--transfer-timeout-s, from the last progress) and cancels it; one timer, one reason.
            transfer_config = kvtransfer.TransferConfig(timeout_s=config.kv_timeout_s, host=config.host,
                                                        pending_timeout_s=None,
                                                        advertise_host=config.advertise_host,
                                                        auth_key=config.cluster_auth.kv_handshake_key)

            def make_receiver(kv_cache, on_transfer_end):
                self.receiver = kvtransfer.create_receiver(config.transport, kv_cache.layers, transfer_config,
                                                           on_transfer_end, packed=kv_cache.kv_format,
                                                           layer_windows=kv_cache.layer_windows)
                return self.receiver
        self.engine = serving.build_async_engine(config.model, config.engine_options, config.role, make_receiver,
                                                 config.connector)
        self.transport_address = self.receiver.address if self.receiver is not None else ""
        self.prefill_channels = PrefillChannels(auth=config.cluster_auth)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        wire.services().add_DecodeServiceServicer_to_server(self, server)

    def hand_over(self) -> int:
        """Draining: end every Generate stream now, unfinished, so that each caller (the router)
        resumes its request on another worker from the tokens it already has; the requests are
        aborted here as their streams close. Returns how many streams there were."""
        return self.engine.hand_over()

    def kv_settings(self) -> dict[str, Any]:
        if self.receiver is None:  # colocated: no KV moves
            return {}
        return serving.kv_settings(self.config.transport, self.receiver.config, self.config.connector)

    async def close(self) -> None:
        await self.prefill_channels.close()
        await asyncio.to_thread(self.engine.shutdown)  # joins the engine thread: not on this event loop
        if self.receiver is not None:
            self.receiver.close()

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext):
        engine = self.engine
        async with serving.unavailable_when_engine_down(context):  # the router tries another worker
            try:
                engine_request = await serving.request_from_wire(engine, request,
                                                                 request.request_id or f"decode-{uuid.uuid4().hex}")
                stream = engine.open_stream(engine_request.request_id)
            except ValueError as exc:
                in_use = "already in use" in str(exc)
                code = grpc.StatusCode.ALREADY_EXISTS if in_use else grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, str(exc))
            want_logprobs = engine_request.sampling_params.logprobs is not None
            prefill = None
            trace = GenerateTrace(request, context, self.role.value) if tracing.enabled else None
            try:
                try:
                    prefill = await self._start(engine_request, request.prefill_address, trace)
                except ValueError as exc:  # refused on the engine thread (e.g. larger than the cache)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                except EngineUnavailable:
                    raise  # UNAVAILABLE (above)
                except RuntimeError as exc:  # a host-cache copy failed; the engine already ended the request
                    await context.abort(grpc.StatusCode.INTERNAL, str(exc))
                async for delta in stream:
                    if delta.invalid_request:  # the request's own error (a constraint no text satisfies): a 400
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, delta.error)
                    if delta.kv_import is not None and not delta.kv_import.prefilled_remotely and prefill is not None:
                        prefill.cancel()  # the load failed and this worker prefills: stop the prefill worker's side
                    if trace is not None:
                        trace.delta(delta)
                    yield chunk_from_delta(delta, want_logprobs)  # (that news may come alone: how the KV came)
            finally:
                stream.close()  # aborts an unfinished request (stopping its transfer) in the engine
                if prefill is not None and not prefill.done():
                    prefill.cancel()  # cancels the Prefill call: the prefill worker aborts its side
                if trace is not None:
                    trace.end(sys.exc_info()[1])

    async def _start(self, engine_request, prefill_address: str,
                     trace: GenerateTrace | None = None) -> asyncio.Task | None:
        """Put the request in the engine: prefill locally, or wait for its KV while a task asks the
        prefill worker and hands its answer to the engine. (`trace`: where, and why, with tracing on.)"""
        engine = self.engine
        if not self.role.imports_kv or not prefill_address:
            if trace is not None:
                trace.prefill_here(engine_request, "colocated" if not self.role.imports_kv else "router")
            await asyncio.wrap_future(engine.call(LLMEngine.add, engine_request, False))
            return None
        try:
            plan = await asyncio.wrap_future(engine.call(LLMEngine.add_imported, engine_request))
        except KVCacheFullError:  # no room to receive now: queue for local prefill (waits for blocks)
            if trace is not None:
                trace.prefill_here(engine_request, "kv_cache_full")
            await asyncio.wrap_future(engine.call(LLMEngine.add, engine_request, False))
            return None
        if plan is None:  # a short uncached tail: the engine prefills it here
            if trace is not None:
                trace.prefill_here(engine_request, "below_threshold")
            return None
        if trace is not None:
            trace.waiting_for_kv(engine_request, plan, self.transport_address)
        return asyncio.ensure_future(self._remote_prefill(engine_request, plan, prefill_address, trace))

    async def _remote_prefill(self, engine_request, plan, address: str, trace: GenerateTrace | None = None) -> None:
        message = prefill_request_to_wire(engine_request, plan, self.transport_address, self.receiver.layout)
        report, error, response = None, None, None
        span = trace.prefill_call(address) if trace is not None else None
        try:
            # No deadline on the call: the connector bounds the wait by progress (a long prompt's KV
            # arrives chunk by chunk) and the call is cancelled when the load ends without it.
            async with self.prefill_channels.use(address) as channel:
                response = await wire.services().PrefillServiceStub(channel).Prefill(
                    message, metadata=None if span is None else tracing.metadata(span))
            if response.finish_reason:
                error = f"prefill worker {address}: {response.finish_reason}: {response.error}"
            else:
                report = producer_report_from_wire(response, engine_request.sampling_params.logprobs is not None)
        except grpc.RpcError as exc:
            error = f"prefill worker {address}: {exc.code().name}: {exc.details()}"
        except Exception as exc:  # e.g. an answer that does not convert: fall back now, not at the timeout
            error = f"prefill worker {address}: {type(exc).__name__}: {exc}"
        finally:
            if span is not None:  # (cancelled too: the load ended without the answer)
                GenerateTrace.prefill_answered(span, response, error or (None if response is not None else "cancelled"))
        self.engine.report_kv_producer(engine_request, report, error)  # streams the first token at once

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return serving.abort(self.engine, request.request_id)

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return serving.health(self.engine, self.role, self.config.model, self.transport_address)

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        received = self.receiver.total_bytes_received if self.receiver is not None else 0
        return await serving.stats(self.engine, self.role, context, kv_bytes_received=received)

    async def KVEvents(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for batch in serving.kv_events(self.engine, context):
            yield batch
