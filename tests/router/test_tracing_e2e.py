"""OpenTelemetry traces across real processes: a router, two decode workers and a prefill worker
on the default model, each started with `--otlp-traces-endpoint` pointing at an OTLP/gRPC
receiver in this test (TraceService/Export), which keeps every span with its resource.

Each request must make ONE trace spanning the processes it touched (each span's resource says
its `service.name`), with the spans of router/traces.py and serving/traces.py and the right
parent links: (a) a disaggregated request (continuing the client's `traceparent`), (b) one
prefilled on its decode worker (prompt_logprobs), (c) one migrated: its decode worker killed
mid-stream, the generation resumed on the other, a second Generate under the same request span.
"""
from __future__ import annotations

import json
import secrets
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.helpers import child_env, wait_until
from tests.router.processes import grpc_address, start_router, start_worker

pytestmark = pytest.mark.slow

SERVER, CLIENT, INTERNAL = 2, 3, 1  # opentelemetry.proto.trace.v1 Span.SpanKind
STATUS_ERROR = 2
GENERATE, PREFILL = "pdserve.v1.DecodeService/Generate", "pdserve.v1.PrefillService/Prefill"


@dataclass
class Span:
    service: str
    instance: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    events: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: bool = False
    start: int = 0  # ns since the epoch


def _value(any_value) -> Any:
    which = any_value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, which) if which else None


def _attributes(pairs) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on 127.0.0.1 that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(Span(resource["service.name"], resource.get("service.instance.id", ""),
                                         span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                                         span.name, span.kind, _attributes(span.attributes),
                                         {e.name: _attributes(e.attributes) for e in span.events},
                                         span.status.code == STATUS_ERROR, span.start_time_unix_nano))
        with self._lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for(self, trace_id: str, *wanted: tuple[str, str], timeout: float = 30.0) -> list[Span]:
        """The trace once it holds a span of each (service, name) in `wanted`."""
        def complete():
            spans = self.trace(trace_id)
            have = {(s.service, s.name) for s in spans}
            return spans if all(w in have for w in wanted) else None
        try:
            return wait_until(complete, timeout=timeout, interval=0.1, what=f"the spans {wanted}")
        except AssertionError:
            raise AssertionError(f"trace {trace_id}: missing spans; got "
                                 f"{sorted((s.service, s.name) for s in self.trace(trace_id))}") from None

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture(scope="module")
def cluster():
    receiver = Receiver()
    env = child_env(OTEL_BSP_SCHEDULE_DELAY="50")  # (ms) spans leave each process at once
    tracing = ["--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}"]
    engine = ["--num-blocks", "128", *tracing]
    processes = []
    try:
        # threshold 0: a decode worker named a prefill worker always imports the prompt's KV
        processes += [start_worker("prefill_worker", *engine, env=env)]
        processes += [start_worker("decode_worker", *engine, "--local-prefill-threshold", "0", env=env)
                      for _ in range(2)]
        prefill, *decodes = [grpc_address(p) for p in processes]
        router, url = start_router("--model", "default", "--prefill", prefill, "--decode", ",".join(decodes),
                                   *tracing, env=env)
        processes.append(router)
        yield {"url": url, "receiver": receiver, "prefill": prefill, "decode": decodes,
               "decode_processes": dict(zip(decodes, processes[1:3]))}
    finally:
        for process in reversed(processes):
            process.stop()
        receiver.stop()


def new_traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def one(spans: list[Span], service: str, name: str) -> Span:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{len(found)} spans {service}/{name}"
    return found[0]


def children(spans: list[Span], parent: Span, name: str | None = None) -> list[Span]:
    return [s for s in spans if s.parent_id == parent.span_id and (name is None or s.name == name)]


def check_parents(spans: list[Span], root: Span) -> None:
    """Every span but the root has its parent in the trace."""
    ids = {s.span_id for s in spans}
    orphans = [(s.service, s.name) for s in spans if s is not root and s.parent_id not in ids]
    assert not orphans, orphans


def test_a_disaggregated_request_is_one_trace_across_the_three_processes(cluster):
    receiver = cluster["receiver"]
    traceparent, trace_id, client_span = new_traceparent()
    response = httpx.post(cluster["url"] + "/v1/completions", headers={"traceparent": traceparent}, timeout=120,
                          json={"model": "default", "prompt": "A disaggregated request about lighthouses and ships",
                                "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    spans = receiver.wait_for(trace_id, ("pdserve-router", "text_completion default"), ("pdserve-decode", GENERATE),
                              ("pdserve-prefill", PREFILL), ("pdserve-decode", "kv_transfer"))
    assert {s.service for s in spans} == {"pdserve-router", "pdserve-decode", "pdserve-prefill"}

    # router: the request (continuing the client's span), its queue, the route, the Generate call
    root = one(spans, "pdserve-router", "text_completion default")
    assert root.kind == SERVER and root.parent_id == client_span
    assert root.attributes["gen_ai.request.model"] == "default"
    assert root.attributes["gen_ai.request.max_tokens"] == 4
    assert root.attributes["gen_ai.request.temperature"] == 0
    assert root.attributes["gen_ai.response.id"] == body["id"]
    assert root.attributes["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert root.attributes["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 4
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["http.response.status_code"] == 200 and "admitted" in root.events
    assert children(spans, root, "queue")
    [route] = children(spans, root, "route")
    assert route.attributes["pdserve.route.prefill"] == "remote"
    assert route.attributes["pdserve.route.prefill.reason"] == "prefill_worker"
    assert route.attributes["pdserve.route.prefill.worker"] == cluster["prefill"]
    assert route.attributes["pdserve.route.decode.worker"] in cluster["decode"]
    assert route.attributes["pdserve.route.decode.hit_tier"] in ("none", "device", "host")
    [call] = children(spans, root, GENERATE)
    assert call.kind == CLIENT and call.attributes["pdserve.migration"] is False and not call.error

    # decode worker: Generate under the router's call; the KV wait, the Prefill call, the transfer
    generate = one(spans, "pdserve-decode", GENERATE)
    assert generate.kind == SERVER and generate.parent_id == call.span_id
    assert generate.instance == route.attributes["pdserve.route.decode.worker"]
    assert generate.attributes["pdserve.prefill"] == "remote"
    assert generate.attributes["gen_ai.usage.output_tokens"] == 4
    assert generate.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert generate.events["first_token"]["pdserve.first_token.source"] == "prefill_worker"
    assert generate.events["stream_end"]["pdserve.stream_end"] == "finished"
    assert len(children(spans, generate, "wait_for_kv")) == 1
    [transfer] = children(spans, generate, "kv_transfer")
    assert transfer.attributes["pdserve.kv.verified"] is True and transfer.attributes["pdserve.kv.bytes"] > 0
    assert transfer.attributes["pdserve.kv.transport"] in ("shm", "tcp")
    [prefill_call] = children(spans, generate, PREFILL)
    assert prefill_call.kind == CLIENT and prefill_call.attributes["pdserve.kv.bytes_sent"] > 0

    # prefill worker: Prefill under the decode worker's call; its queue, compute and KV send
    prefill = one(spans, "pdserve-prefill", PREFILL)
    assert prefill.kind == SERVER and prefill.parent_id == prefill_call.span_id
    assert prefill.instance == cluster["prefill"] and prefill.attributes["pdserve.answered"] is True
    assert "first_token" in prefill.events
    assert [len(children(spans, prefill, name)) for name in ("queue", "prefill", "kv_send")] == [1, 1, 1]
    [send] = children(spans, prefill, "kv_send")
    assert send.attributes["pdserve.kv.bytes_sent"] > 0
    assert not any(s.error for s in spans)
    check_parents(spans, root)


def test_a_locally_prefilled_request_starts_its_own_trace(cluster):
    receiver = cluster["receiver"]
    response = httpx.post(cluster["url"] + "/v1/completions", timeout=120,
                          json={"model": "default", "prompt": "Prompt logprobs are computed where the prompt is "
                                "prefilled", "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1})
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]

    def root_span():
        return next((s for s in list(receiver.spans) if s.attributes.get("gen_ai.response.id") == request_id), None)
    root = wait_until(root_span, timeout=30, interval=0.1, what="the request's span")
    assert root.parent_id == ""  # no traceparent: the router started the trace
    spans = receiver.wait_for(root.trace_id, ("pdserve-decode", GENERATE), ("pdserve-decode", "prefill"))
    assert {s.service for s in spans} == {"pdserve-router", "pdserve-decode"}  # no prefill worker
    [route] = children(spans, root, "route")
    assert (route.attributes["pdserve.route.prefill"], route.attributes["pdserve.route.prefill.reason"]) == \
        ("local", "prompt_logprobs")
    [call] = children(spans, root, GENERATE)
    generate = one(spans, "pdserve-decode", GENERATE)
    assert generate.parent_id == call.span_id
    assert (generate.attributes["pdserve.prefill"], generate.attributes["pdserve.prefill.reason"]) == ("local", "router")
    assert generate.events["first_token"]["pdserve.first_token.source"] == "local"
    assert [len(children(spans, generate, name)) for name in ("queue", "prefill", "wait_for_kv")] == [1, 1, 0]
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    check_parents(spans, root)


def test_a_migrated_request_stays_one_trace(cluster):
    receiver = cluster["receiver"]
    traceparent, trace_id, _ = new_traceparent()
    payload = {"model": "default", "prompt": "Write a long story about a lighthouse keeper and the sea.",
               "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
    text, killed = "", None
    with httpx.stream("POST", cluster["url"] + "/v1/completions", json=payload, timeout=120,
                      headers={"traceparent": traceparent}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            if killed is None:  # kill the decode worker that serves it (SIGKILL: no goodbye), which the
                # router's `route` span names (exported at once)
                route = one(receiver.wait_for(trace_id, ("pdserve-router", "route")), "pdserve-router", "route")
                killed = route.attributes["pdserve.route.decode.worker"]
                cluster["decode_processes"][killed].popen.kill()
    assert killed is not None, "the stream ended before its decode worker could be killed"
    survivor = next(address for address in cluster["decode"] if address != killed)
    spans = receiver.wait_for(trace_id, ("pdserve-router", "text_completion default"), ("pdserve-decode", GENERATE))
    root = one(spans, "pdserve-router", "text_completion default")
    assert root.attributes["pdserve.migrations"] == 1, "no migration: did the stream end before the kill?"
    assert "migration" in root.events
    assert root.events["migration"]["pdserve.failed_worker"] == killed
    assert root.attributes["gen_ai.usage.output_tokens"] == 64
    calls = sorted(children(spans, root, GENERATE), key=lambda s: s.attributes["pdserve.num_resumed_tokens"])
    assert len(calls) == 2
    first, resumed = calls
    assert first.attributes["pdserve.migration"] is False and first.error  # the broken stream
    assert resumed.attributes["pdserve.migration"] is True and resumed.attributes["pdserve.num_resumed_tokens"] > 0
    routes = sorted(children(spans, root, "route"), key=lambda s: s.start)
    assert [r.attributes["pdserve.route.decode.worker"] for r in routes] == [killed, survivor]
    assert "pdserve-prefill" in {s.service for s in spans}  # the first dispatch's remote prefill
    # the survivor's Generate continues the second call; the killed worker's never ended (lost with it)
    [generate] = [s for s in spans if s.name == GENERATE and s.service == "pdserve-decode"]
    assert generate.instance == survivor and generate.parent_id == resumed.span_id
    assert generate.attributes["pdserve.num_resumed_tokens"] == resumed.attributes["pdserve.num_resumed_tokens"]
