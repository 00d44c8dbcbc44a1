"""gRPC clients for the workers: one `grpc.aio` channel and stub per worker address.

The router talks to decode and colocated workers through `DecodeService` (Generate, Abort,
Health, Stats, KVEvents) and to prefill workers only through `PrefillService` Health, Stats and
KVEvents (the decode worker is the one that calls `Prefill`). Channels are mutual TLS under the
cluster secret, or plaintext without one (`ClusterAuth`, wire/cluster_auth.py).
"""
from __future__ import annotations

from typing import Any

import grpc

import wire
from wire.cluster_auth import ClusterAuth

# The shared message limits, and keepalives: a dead worker is noticed on an idle channel too.
CHANNEL_OPTIONS = [*wire.GRPC_OPTIONS, ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000)]


class WorkerClient:
    """Stubs for one worker; `role` is "prefill", "decode" or "both" (colocated); `auth`: how its
    channel is secured (the workers' own)."""

    def __init__(self, address: str, role: str, auth: ClusterAuth) -> None:
        messages, services = wire.load()
        self.address = address
        self.role = role
        self.messages = messages
        self._channel = auth.channel(address, options=CHANNEL_OPTIONS)
        if role == "prefill":
            self._stub = services.PrefillServiceStub(self._channel)
        else:
            self._stub = services.DecodeServiceStub(self._channel)

    async def health(self, timeout: float) -> Any:
        return await self._stub.Health(self.messages.HealthRequest(), timeout=timeout)

    async def stats(self, timeout: float) -> Any:
        return await self._stub.Stats(self.messages.StatsRequest(), timeout=timeout)

    async def abort(self, request_id: str, timeout: float) -> bool:
        response = await self._stub.Abort(self.messages.AbortRequest(request_id=request_id), timeout=timeout)
        return bool(response.found)

    def generate(self, request: Any, metadata: Any = None) -> grpc.aio.UnaryStreamCall:
        """Open the server stream of TokenChunks (decode and colocated workers only); `metadata`:
        the call's (a trace's `traceparent`, wire/tracing.py)."""
        if self.role == "prefill":
            raise ValueError(f"worker {self.address} is a prefill worker; Generate goes to a decode worker")
        return self._stub.Generate(request, wait_for_ready=False, metadata=metadata)

    def kv_events(self) -> grpc.aio.UnaryStreamCall:
        """Open the worker's KVEvents stream: a snapshot batch, then one batch per change."""
        return self._stub.KVEvents(self.messages.KVEventsRequest(), wait_for_ready=False)

    async def close(self) -> None:
        await self._channel.close()
