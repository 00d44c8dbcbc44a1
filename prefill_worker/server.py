"""The prefill worker: an engine in `prefill` role behind `PrefillService`, an adapter between
gRPC and the engine. The engine's KV connector (engine/kv_connector.py) does the hand-off.

Lifecycle of one Prefill call (the request's RequestStatus, one per line):

    WAITING      queued in the engine with its KV destination (blocks for the whole prompt at admission)
    RUNNING      prefix-cache match, chunked prefill batched with other prompts; after each layer
                 group, the blocks it completed are pushed to the decode worker (layer-wise push)
    SENDING_KV   first token sampled; once every layer group is pushed, the answer goes out with
                 it: the first token, the bytes sent, the sender's epoch, the block hashes and the
                 checksum (a send held back or failed before then is answered when it ends);
                 blocks pinned until every block is acknowledged or the lease expires
    FINISHED_*   blocks unpinned (they stay in the prefix cache)

Abort (the `Abort` RPC, or the decode worker cancelling the call) in any state stops the send
first, then frees the blocks.
"""
from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc

import kvtransfer
import serving
import wire
from engine.config import Role
from engine.kv_hooks import KVConnectorConfig
from engine.model.default_model import DEFAULT_MODEL_NAME
from serving.traces import PrefillTrace
from wire import tracing
from wire.cluster_auth import INSECURE, ClusterAuth
from wire.convert import describe_wire_layout, destination_from_wire, layout_to_wire, prefill_response, same_layout


@dataclass
class PrefillWorkerConfig:
    model: str = DEFAULT_MODEL_NAME
    engine_options: dict[str, Any] = field(default_factory=dict)
    transport: str = "auto"  # the sender's transports; "auto": whatever the receiver offers
    kv_timeout_s: float = kvtransfer.TransferConfig.timeout_s  # a silent receiver fails the transfer after this long
    # the lease (how long blocks stay pinned for a send), layer-wise push, test-only faults
    connector: KVConnectorConfig = field(default_factory=KVConnectorConfig)
    cluster_auth: ClusterAuth = INSECURE  # its KV sender's handshake: only receivers that hold the secret

    def __post_init__(self) -> None:
        kvtransfer.check_transport_choice(self.transport)


class PrefillWorker(wire.services().PrefillServiceServicer):
    """The engine (prefill role), whose connector's sender pushes over `config.transport`, and
    the PrefillService over it (a `serving.Worker`)."""

    @classmethod
    def from_options(cls, role: Role, options: serving.WorkerOptions) -> PrefillWorker:
        """The worker `serving.start_worker` brings up (role prefill)."""
        if role is not Role.PREFILL:
            raise ValueError(f"a prefill worker's role is prefill, got {str(role)!r}")
        return cls(PrefillWorkerConfig(model=options.model, engine_options=options.engine_options,
                                       transport=options.kv.transport, kv_timeout_s=options.kv.kv_timeout_s,
                                       connector=options.kv.connector_config(options.cluster_auth.kv_mac_key),
                                       cluster_auth=options.cluster_auth))

    def __init__(self, config: PrefillWorkerConfig) -> None:
        self.config = config
        self.role = Role.PREFILL
        self.transport_address = ""  # a prefill worker listens for no KV
        transfer_config = kvtransfer.TransferConfig(timeout_s=config.kv_timeout_s,
                                                    auth_key=config.cluster_auth.kv_handshake_key)

        def make_sender(kv_cache, on_transfer_end):
            # The KV cache lies in shared memory (a no-op on GPU), so same-host decode workers map it
            # and copy blocks out in one memcpy (kvtransfer shm, "mapped" path).
            shared = None
            if kv_cache.memory_fd is not None:
                shared = kvtransfer.SharedMemory(kv_cache.memory_fd, kv_cache.data.data_ptr(),
                                                 kv_cache.data.numel() * kv_cache.data.element_size())
            # The engine's connector needs only its KVSenderTransport part; this server keeps the
            # rest of kvtransfer.KVSender (layout, reachability, byte count, close).
            self.sender = kvtransfer.create_sender(config.transport, kv_cache.layers, transfer_config,
                                                   shared_memory=shared, on_transfer_end=on_transfer_end,
                                                   packed=kv_cache.kv_format, layer_windows=kv_cache.layer_windows)
            return self.sender

        self.engine = serving.build_async_engine(config.model, {"shared_memory": True, **config.engine_options},
                                                 self.role, make_sender, config.connector)
        self.layout = layout_to_wire(self.sender.layout)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        wire.services().add_PrefillServiceServicer_to_server(self, server)

    def hand_over(self) -> int:
        """Draining: nothing to hand over (a prefill ends with its prompt, within the drain)."""
        return 0

    def kv_settings(self) -> dict[str, Any]:
        return serving.kv_settings(self.config.transport, self.sender.config, self.config.connector)

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)  # joins the engine thread: not on this event loop
        self.sender.close()

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        engine = self.engine
        async with serving.unavailable_when_engine_down(context):  # the decode worker prefills itself
            try:
                destination = self._destination(request.destination)
                engine_request = await serving.request_from_wire(engine, request, request.request_id or None,
                                                                 kv_destination=destination)
                stream = engine.open_stream(engine_request.request_id)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            first = None
            answered = False
            trace = PrefillTrace(request, context) if tracing.enabled else None
            try:
                engine.add(engine_request, False)
                async for delta in stream:  # the first token (with the send's report), then the send's end
                    first = first or (delta if delta.new_token_ids else None)
                    if trace is not None:
                        trace.delta(engine_request, delta, self.config.connector.layerwise)
                    if delta.answers_prefill:
                        answered = True
                        return prefill_response(delta, first)
            except ValueError as exc:  # refused by the engine (e.g. larger than the whole cache)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            finally:
                # Cancelled by the decode worker before the answer: abort, stopping the send. After
                # it, the send goes on (the engine frees the blocks when it ends).
                stream.close(abort=not answered)
                if trace is not None:
                    trace.end(sys.exc_info()[1], answered)

    def _destination(self, message: Any):
        if not same_layout(message.layout, self.layout):
            raise ValueError(f"KV layout mismatch: decode worker has [{describe_wire_layout(message.layout)}], "
                             f"this prefill worker has [{describe_wire_layout(self.layout)}]")
        destination = destination_from_wire(message)
        reason = self.sender.unreachable_reason(destination.address)
        if reason is not None:
            raise ValueError(f"cannot send KV to the destination: {reason}")
        return destination

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return serving.abort(self.engine, request.request_id)

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return serving.health(self.engine, self.role, self.config.model)

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await serving.stats(self.engine, self.role, context, kv_bytes_sent=self.sender.total_bytes_sent)

    async def KVEvents(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for batch in serving.kv_events(self.engine, context):
            yield batch
