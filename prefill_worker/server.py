"""The prefill worker: an engine in `prefill` role behind `PrefillService`.

Lifecycle of one Prefill call (one state per line):

    WAITING      admitted to the engine queue; the KV destination is registered with the pusher
    PREFILLING   prefix-cache match, chunked prefill batched with other prompts, first token sampled
    SENDING_KV   blocks pinned; blocks [first_block_index, ...) are pushed to the decode worker
    DONE         transfer acknowledged (or failed / lease expired): blocks unpinned, they stay in
                 the prefix cache; the response carries the first token and the bytes sent

Abort (the `Abort` RPC, or the decode worker cancelling the call) in any state stops the send
first, then frees or unpins the blocks.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine import wire
from engine.engine import LLMEngine
from prefill_worker.exporter import KVPusher
from prefill_worker.wire_convert import (describe_wire_layout, layout_to_wire, token_logprob_to_wire,
                                         worker_stats_to_wire)

logger = logging.getLogger(__name__)


@dataclass
class PrefillWorkerConfig:
    model: str = "default"
    engine_options: dict[str, Any] = field(default_factory=dict)
    transport: str = "auto"  # the sender's transports; "auto": whatever the receiver offers
    kv_timeout_s: float = 5.0  # a silent receiver fails the transfer after this long
    export_lease_s: float = 60.0  # blocks stay pinned at most this long for one transfer
    hold_kv_send_s: float = 0.0  # fault injection for tests: wait before every send

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "tcp", "shm", "ucx", "nccl"):
            raise ValueError(f"transport must be auto, tcp, shm, ucx or nccl, got {self.transport!r}")
        for name in ("kv_timeout_s", "export_lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hold_kv_send_s < 0:
            raise ValueError(f"hold_kv_send_s must be >= 0, got {self.hold_kv_send_s}")


class PrefillWorker:
    """Owns the engine (prefill role), the KV sender and the pusher; `servicer()` serves them."""

    def __init__(self, config: PrefillWorkerConfig) -> None:
        import kvtransfer

        from prefill_worker.serving import build_async_engine
        self.config = config
        self.role = "prefill"
        self.pusher = KVPusher(lease_s=config.export_lease_s, hold_s=config.hold_kv_send_s)
        # The KV cache goes into shared memory (a no-op on GPU) so that same-host decode workers
        # map it and copy blocks out in one memcpy (kvtransfer shm, "mapped" path).
        options = {"shared_memory": True, **config.engine_options}
        self.engine = build_async_engine(config.model, options, "prefill", kv_exporter=self.pusher)
        kv_cache = self.engine.engine.runner.kv_cache
        self._caches = kv_cache.layers
        self._shared_memory = None
        if kv_cache.memory_fd is not None:
            self._shared_memory = kvtransfer.SharedMemory(kv_cache.memory_fd, kv_cache.data.data_ptr(),
                                                          kv_cache.data.numel() * kv_cache.data.element_size())
        self._transfer_config = kvtransfer.TransferConfig(timeout_s=config.kv_timeout_s)
        self._senders: dict[str, Any] = {}
        self._senders_lock = threading.Lock()
        self.layout = kvtransfer.KVLayout.from_caches(self._caches)
        self.pusher.release = lambda request_id: self.engine.call(LLMEngine.release_export, request_id)
        self.pusher.abort_in_engine = self.engine.abort
        self.block_size = self.layout.block_size

    def sender_for(self, destination_transport: str, address: str) -> Any:
        """The sender for a destination, created on first use (blocking: call it off the event
        loop): the destination's transport, or kvtransfer's `auto` choice when the receiver
        offers several. With a fixed `--transport`, it must be among those offered."""
        import kvtransfer
        offered = [part.split("://", 1)[0] for part in address.split(",")]
        if self.config.transport != "auto":
            if self.config.transport not in offered:
                raise ValueError(f"this prefill worker sends KV over {self.config.transport} only, "
                                 f"the destination offers {', '.join(offered)}")
            transport = self.config.transport
        elif len(offered) > 1:
            transport = "auto"
        else:
            transport = destination_transport or offered[0]
        if transport != "auto" and transport not in kvtransfer.TRANSPORT_NAMES:
            raise ValueError(f"unknown KV transport {transport!r}; known: {', '.join(kvtransfer.TRANSPORT_NAMES)}")
        with self._senders_lock:
            sender = self._senders.get(transport)
            if sender is None:
                try:
                    sender = kvtransfer.create_sender(transport, self._caches, self._transfer_config,
                                                      shared_memory=self._shared_memory)
                except kvtransfer.TransportUnavailableError as exc:
                    raise ValueError(str(exc)) from exc
                self._senders[transport] = sender
            return sender

    @property
    def kv_bytes_sent(self) -> int:
        with self._senders_lock:
            return sum(sender.total_bytes_sent for sender in self._senders.values())

    def close(self) -> None:
        self.pusher.close()
        self.engine.shutdown()
        with self._senders_lock:
            for sender in self._senders.values():
                sender.close()

    def servicer(self):
        return _PrefillServicer(self)


def _servicer_base():
    return wire.services().PrefillServiceServicer


class _PrefillServicer(_servicer_base()):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker
        self.pb = wire.messages()

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        worker = self.worker
        try:
            engine_request = await wire.off_loop_if_constrained(
                request.sampling, lambda: worker.engine.engine.make_request(
                    list(request.prompt_token_ids), wire.sampling_from_wire(request.sampling),
                    request.request_id or None, cache_salt=request.cache_salt or None,
                    num_resumed_tokens=request.num_resumed_tokens))
            self._check_destination(request.destination, engine_request.num_tokens)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = engine_request.request_id
        destination = request.destination
        try:
            sender = await asyncio.get_running_loop().run_in_executor(None, worker.sender_for, destination.transport,
                                                                       destination.address)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            done = worker.pusher.expect(request_id, sender, destination.address, list(destination.block_ids),
                                        destination.first_block_index)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        stream = None
        try:
            stream = worker.engine.open_stream(request_id)
            worker.engine.add(engine_request, False)
            final = None
            try:
                async for delta in stream:
                    final = delta
            except ValueError as exc:  # refused by the scheduler (e.g. larger than the whole cache)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if final.finish_reason != "prefill_done":
                return self.pb.PrefillResponse(finish_reason=final.finish_reason or "error",
                                               error=final.error or "", num_cached_tokens=final.num_cached_tokens)
            result = await asyncio.wrap_future(done)
            first = final.new_logprobs[0] if final.new_logprobs else None
            token = token_logprob_to_wire(final.new_token_ids[0], first.logprob if first else None,
                                          first.top_logprobs if first else None)
            if not result.ok:
                return self.pb.PrefillResponse(first_token=token, num_cached_tokens=final.num_cached_tokens,
                                               kv_bytes_sent=result.bytes_sent, finish_reason="error",
                                               error=result.error or "KV transfer failed")
            return self.pb.PrefillResponse(first_token=token, num_cached_tokens=final.num_cached_tokens,
                                           kv_bytes_sent=result.bytes_sent)
        except BaseException:
            # Cancelled by the decode worker (or shutting down): stop the send, free the blocks.
            worker.pusher.abort(request_id)
            raise
        finally:
            worker.pusher.forget(request_id)
            if stream is not None:
                stream.close()

    def _check_destination(self, destination: Any, num_prompt_tokens: int) -> None:
        worker = self.worker
        if not destination.address:
            raise ValueError("destination.address is empty: name the decode worker's KV receiver")
        if not destination.block_ids:
            raise ValueError("destination.block_ids is empty")
        mine = layout_to_wire(worker.layout)
        theirs = destination.layout
        if (theirs.num_layers, theirs.block_size, theirs.num_kv_heads, theirs.head_dim, theirs.dtype) != (
                mine.num_layers, mine.block_size, mine.num_kv_heads, mine.head_dim, mine.dtype):
            raise ValueError(f"KV layout mismatch: decode worker has [{describe_wire_layout(theirs)}], "
                             f"this prefill worker has [{describe_wire_layout(mine)}]")
        num_blocks = -(-num_prompt_tokens // worker.block_size)
        end = destination.first_block_index + len(destination.block_ids)
        if end != num_blocks:
            raise ValueError(f"destination covers prompt blocks [{destination.first_block_index}, {end}) but the "
                             f"prompt of {num_prompt_tokens} tokens has {num_blocks} blocks")

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        found = self.worker.pusher.abort(request.request_id)
        return self.pb.AbortResponse(found=found)

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.pb.HealthResponse(ok=True, role="prefill", model=self.worker.config.model, transport_address="")

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            stats, queued = self.worker.engine.stats()  # the engine thread's latest snapshot
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return worker_stats_to_wire("prefill", stats, queued, self.worker.block_size,
                                    kv_bytes_sent=self.worker.kv_bytes_sent)
