"""The workers' spans of a request (OpenTelemetry; set up by `start_worker` with
`--otlp-traces-endpoint`, wire/tracing.py). Without it the servers make no trace object: each
Generate or Prefill call checks `tracing.enabled` once and every later site is a None check.

Everything is recorded on the servers' event loop, from what the engine already reports (its
stream's deltas, the Prefill answer, `KVImportOutcome`, the request's `arrival_time` and
`first_scheduled_time`), with explicit timestamps where a span is known only after the fact:
nothing runs on the engine thread. The spans continue the caller's trace (W3C `traceparent` in
the call's gRPC metadata):

decode worker (`GenerateTrace`):

    pdserve.v1.DecodeService/Generate   SERVER; `pdserve.prefill`: remote or local, and
                                        `pdserve.prefill.reason` (prefill_worker; local: router, no
                                        prefill worker named; colocated; below_threshold, a short
                                        uncached tail; kv_cache_full; kv_failed, a failed transfer
                                        fell back); gen_ai.usage.input/output_tokens,
                                        gen_ai.response.finish_reasons; events `first_token`
                                        (`pdserve.first_token.source`: prefill_worker or local) and
                                        `stream_end`
      wait_for_kv                       remote: blocks allocated -> the KV verified (or the
                                        transfer failed: `pdserve.kv.failure_reason`)
      pdserve.v1.PrefillService/Prefill CLIENT: the call to the prefill worker (its answer: bytes
                                        sent, its prefix-cache hit), whose spans continue under it
      kv_transfer                       from the KV import's outcome: transport (the receiver's
                                        first, which senders use), bytes, seconds, verified or the
                                        failure reason
      queue, prefill                    local: arrival -> first scheduled -> first token

prefill worker (`PrefillTrace`):

    pdserve.v1.PrefillService/Prefill   SERVER; prompt and cached tokens, the destination
      queue                             arrival -> first scheduled
      prefill                           first scheduled -> first token sampled (event `first_token`)
      kv_send                           the push (layer group by layer group, from the first
                                        scheduled step; else from the first token) -> the answer:
                                        bytes acknowledged, transport, error
"""
from __future__ import annotations

import time
from typing import Any

from wire import tracing

DECODE_SERVICE = "pdserve.v1.DecodeService"
PREFILL_SERVICE = "pdserve.v1.PrefillService"


def _rpc(service: str, method: str) -> dict[str, Any]:
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def first_transport(address: str) -> str:
    """The transport a KV receiver's address offers first (kvtransfer: the order of the receiver's
    address picks among the sender's transports)."""
    return address.split(",", 1)[0].partition("://")[0] if address else ""


def _local_prefill(parent: Any, request: Any, first_token_ns: int) -> None:
    """The `queue` and `prefill` spans of a prompt this engine computed, from the request's clock."""
    scheduled = request.first_scheduled_time
    if scheduled is None:
        return
    scheduled_ns = tracing.ns(scheduled)
    tracing.record_span("queue", parent, tracing.ns(request.arrival_time), scheduled_ns)
    tracing.record_span("prefill", parent, scheduled_ns, first_token_ns,
                        {"pdserve.num_cached_tokens": request.num_cached_tokens,
                         "pdserve.prompt_tokens": request.num_prompt_tokens})


class GenerateTrace:
    """A decode worker's spans of one Generate call (module docstring)."""

    def __init__(self, message: Any, context: Any, role: str) -> None:
        self.span = tracing.start_span(f"{DECODE_SERVICE}/Generate", tracing.extract(context.invocation_metadata()),
                                       "SERVER", {
                                           **_rpc(DECODE_SERVICE, "Generate"),
                                           "pdserve.request_id": message.request_id, "pdserve.worker.role": role,
                                           "gen_ai.usage.input_tokens": len(message.prompt_token_ids),
                                           "gen_ai.request.max_tokens": message.sampling.max_tokens,
                                           "pdserve.num_resumed_tokens": message.num_resumed_tokens,
                                           "pdserve.prefill_address": message.prefill_address})
        self.request: Any = None
        self.remote = False
        self.wait: Any = None  # the open wait_for_kv span
        self.transport = ""
        self.output_tokens = 0
        self.first_token = False
        self.finish_reason: str | None = None

    def prefill_here(self, request: Any, reason: str) -> None:
        self.request = request
        tracing.set_attributes(self.span, {"pdserve.prefill": "local", "pdserve.prefill.reason": reason})

    def waiting_for_kv(self, request: Any, plan: Any, receiver_address: str) -> None:
        """Its blocks are allocated and the receiver expects the KV (`ImportPlan`)."""
        self.request, self.remote = request, True
        self.transport = first_transport(receiver_address)
        blocks = len(plan.blocks_to_fill) or sum(len(group.block_ids) for group in plan.groups)
        tracing.set_attributes(self.span, {"pdserve.prefill": "remote", "pdserve.prefill.reason": "prefill_worker",
                                           "pdserve.num_cached_tokens": plan.num_cached_tokens})
        self.wait = tracing.start_span("wait_for_kv", self.span, attributes={
            "pdserve.kv.blocks": blocks, "pdserve.num_cached_tokens": plan.num_cached_tokens,
            "pdserve.kv.transport": self.transport})

    def prefill_call(self, address: str) -> Any:
        """The CLIENT span of the Prefill call to `address` (its metadata: `tracing.metadata`)."""
        host, _, port = address.rpartition(":")
        return tracing.start_span(f"{PREFILL_SERVICE}/Prefill", self.span, "CLIENT", {
            **_rpc(PREFILL_SERVICE, "Prefill"), "server.address": host,
            "server.port": int(port) if port.isdigit() else None})

    @staticmethod
    def prefill_answered(span: Any, response: Any, error: str | None) -> None:
        if response is not None:
            tracing.set_attributes(span, {"pdserve.kv.bytes_sent": response.kv_bytes_sent,
                                          "pdserve.prefill.num_cached_tokens": response.num_cached_tokens})
        if error is not None:
            tracing.set_error(span, error)
        span.end()

    def delta(self, delta: Any) -> None:
        """One of the engine stream's deltas, as it goes out."""
        now = time.time_ns()
        if delta.kv_import is not None:
            self._kv_import(delta.kv_import, now)
        if delta.new_token_ids:
            if not self.first_token:
                self.first_token = True
                remote = self.remote and (self.wait is not None or self.request.kv_import is None
                                          or self.request.kv_import.prefilled_remotely)
                self.span.add_event("first_token", {"pdserve.first_token.source":
                                                    "prefill_worker" if remote else "local"}, timestamp=now)
                if not self.remote and self.request is not None:
                    _local_prefill(self.span, self.request, now)
            self.output_tokens += len(delta.new_token_ids)
        if delta.finished:
            self.finish_reason = delta.finish_reason

    def _kv_import(self, outcome: Any, now: int) -> None:
        failure = outcome.failure_reason or ("" if outcome.prefilled_remotely else "failed")
        attributes = {"pdserve.kv.transport": self.transport, "pdserve.kv.bytes": outcome.bytes_received,
                      "pdserve.kv.seconds": outcome.seconds, "pdserve.kv.verified": outcome.prefilled_remotely,
                      "pdserve.kv.failure_reason": failure or None,
                      "pdserve.prefill.num_cached_tokens": outcome.num_cached_tokens}
        tracing.record_span("kv_transfer", self.span, now - int(outcome.seconds * 1e9), now, attributes,
                            error=f"KV transfer failed: {failure}" if failure else None)
        if self.wait is not None:
            tracing.set_attributes(self.wait, {"pdserve.kv.verified": outcome.prefilled_remotely,
                                               "pdserve.kv.failure_reason": failure or None})
            self.wait.end(end_time=now)
            self.wait = None
        if failure:  # this worker prefills the prompt itself (or the request ends: --on-transfer-failure)
            tracing.set_attributes(self.span, {"pdserve.prefill": "local", "pdserve.prefill.reason": "kv_failed"})

    def end(self, error: BaseException | None) -> None:
        """The call ends: finished, failed, cancelled by its caller or handed over."""
        if self.wait is not None:  # the request ended before its KV did
            self.wait.end()
        ended = ("finished" if self.finish_reason else "cancelled" if error is not None
                 and type(error).__name__ in ("CancelledError", "GeneratorExit") else "error" if error else "closed")
        tracing.set_attributes(self.span, {
            "gen_ai.usage.output_tokens": self.output_tokens,
            "gen_ai.response.finish_reasons": [self.finish_reason] if self.finish_reason else None,
            "pdserve.stream_end": ended})
        self.span.add_event("stream_end", {"pdserve.stream_end": ended,
                                           "pdserve.finish_reason": self.finish_reason or ""})
        if ended == "error" or self.finish_reason == "error":
            tracing.set_error(self.span, f"{type(error).__name__}: {error}" if error else "the request failed")
        self.span.end()


class PrefillTrace:
    """A prefill worker's spans of one Prefill call (module docstring)."""

    def __init__(self, message: Any, context: Any) -> None:
        self.span = tracing.start_span(f"{PREFILL_SERVICE}/Prefill", tracing.extract(context.invocation_metadata()),
                                       "SERVER", {
                                           **_rpc(PREFILL_SERVICE, "Prefill"),
                                           "pdserve.request_id": message.request_id,
                                           "gen_ai.usage.input_tokens": len(message.prompt_token_ids),
                                           "pdserve.kv.destination": message.destination.address,
                                           "pdserve.kv.transport": first_transport(message.destination.address)})
        self.first_token_ns: int | None = None

    def delta(self, request: Any, delta: Any, layerwise: bool) -> None:
        now = time.time_ns()
        if delta.new_token_ids and self.first_token_ns is None:
            self.first_token_ns = now
            self.span.add_event("first_token", timestamp=now)
            _local_prefill(self.span, request, now)
            self.span.set_attribute("pdserve.num_cached_tokens", request.num_cached_tokens)
        if delta.answers_prefill:
            send = delta.kv_send
            scheduled = request.first_scheduled_time
            start = tracing.ns(scheduled) if layerwise and scheduled is not None else self.first_token_ns or now
            tracing.record_span("kv_send", self.span, start, now, {
                "pdserve.kv.transport": first_transport(request.kv_destination.address
                                                        if request.kv_destination is not None else ""),
                "pdserve.kv.bytes_sent": send.bytes_sent if send is not None else None,
                "pdserve.kv.epoch": send.epoch if send is not None else None, "pdserve.kv.layerwise": layerwise},
                error=send.error if send is not None and send.error else None)

    def end(self, error: BaseException | None, answered: bool) -> None:
        if error is not None and not answered:
            tracing.set_error(self.span, f"{type(error).__name__}: {error}")
        elif not answered:
            tracing.set_error(self.span, "ended before its answer")
        self.span.set_attribute("pdserve.answered", answered)
        self.span.end()
