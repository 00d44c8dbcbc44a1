"""OpenTelemetry traces of a pdserve process (router, decode worker, prefill worker): one trace per
request across them, the W3C `traceparent` carried in gRPC metadata from the router to the decode
worker and on to the prefill worker.

Off unless `--otlp-traces-endpoint URL` is given (`add_traces_endpoint_argument`: `python -m
router`, both worker mains and `pdserve serve`, which hands it to its routers and workers). Off,
nothing is set up: no SDK is imported, the global tracer provider stays the API's proxy, and every
per-request site is one check of the module-level `enabled`. On, `setup` installs a tracer
provider with a resource (`service.name` pdserve-router / pdserve-decode / pdserve-prefill, and
the process's address), a `BatchSpanProcessor` (its schedule: the standard `OTEL_BSP_*`
variables) and an OTLP/gRPC exporter: OTLP/gRPC, not OTLP/HTTP, because grpcio is already every
pdserve process's dependency (the HTTP exporter would add `requests`) and 4317 is what collectors
(the OpenTelemetry Collector, Jaeger, Tempo) listen on by default. The spans still queued are sent
at exit (`shutdown`, also registered with atexit) and when a worker stops (`flush`).

What each process records: router/traces.py (the HTTP request, routing, the Generate calls) and
serving/traces.py (the workers' Generate and Prefill calls, the KV hand-off). Torch-free, like the
rest of `wire`; this module imports OpenTelemetry only in `setup`.
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Iterable

logger = logging.getLogger(__name__)

TRACES_FLAG = "--otlp-traces-endpoint"
INSTRUMENTATION = "pdserve"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

enabled = False  # whether this process exports traces (`setup` succeeded); read as `tracing.enabled`
_provider: Any = None
_tracer: Any = None
_otel: Any = None  # opentelemetry.trace, once set up
_propagator: Any = None  # the W3C trace-context propagator


def add_traces_endpoint_argument(parser: argparse.ArgumentParser | Any) -> None:
    """`--otlp-traces-endpoint URL` (dest `otlp_traces_endpoint`; default: no tracing)."""
    parser.add_argument(TRACES_FLAG, dest="otlp_traces_endpoint", metavar="URL", type=_checked_endpoint,
                        default=None,
                        help="export OpenTelemetry traces (OTLP over gRPC) to this collector, e.g. "
                             "http://localhost:4317; the spans of a request's router, decode worker and prefill "
                             "worker form one trace (default: no tracing)")


def check_endpoint(url: str | None) -> str | None:
    """`url` if it is an http:// or https:// URL (or None); ValueError otherwise. (https: TLS to
    the collector; http: plaintext.)"""
    if url is None:
        return None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL such as "
                         f"http://localhost:4317, got {url!r}")
    return url


def _checked_endpoint(text: str) -> str:
    try:
        return check_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("otlp_traces_endpoint ", "")) from None


def setup(endpoint: str | None, service: str, attributes: dict[str, Any] | None = None) -> bool:
    """Export this process's spans to `endpoint` as `service` (its resource also gets `attributes`
    and the process id). Nothing at all without an endpoint. Once per process: a second call keeps
    the first provider. Returns `enabled`."""
    global enabled, _provider, _tracer, _otel, _propagator
    if not endpoint or enabled:
        return enabled
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    resource = Resource.create({"service.name": service, "process.pid": os.getpid(), **(attributes or {})})
    provider = TracerProvider(resource=resource)  # (shuts down, sending what is queued, at exit)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=check_endpoint(endpoint))))
    trace.set_tracer_provider(provider)
    _provider, _otel, _propagator = provider, trace, TraceContextTextMapPropagator()
    _tracer = provider.get_tracer(INSTRUMENTATION)
    enabled = True
    logger.info("tracing: spans of %s go to %s (OTLP/gRPC)", service, endpoint)
    return True


def flush(timeout_s: float = 5.0) -> None:
    """Send the spans queued so far (blocks up to `timeout_s`; e.g. when a worker stops)."""
    if enabled:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Send what is queued and stop exporting (a process's exit; atexit does it otherwise)."""
    global enabled
    if enabled:
        enabled = False
        _provider.shutdown()


# ---- spans --------------------------------------------------------------------------------------

def tracer() -> Any:
    return _tracer


def kind(name: str) -> Any:
    """A SpanKind by name: "SERVER", "CLIENT", "INTERNAL"."""
    return getattr(_otel.SpanKind, name)


def context_of(parent: Any) -> Any:
    """An OpenTelemetry Context from a span, a Context, or None (a new trace)."""
    if parent is None or not isinstance(parent, _otel.Span):
        return parent
    return _otel.set_span_in_context(parent)


def start_span(name: str, parent: Any = None, kind_name: str = "INTERNAL", attributes: dict[str, Any] | None = None,
               start_ns: int | None = None) -> Any:
    """A span under `parent` (a span or a Context; None: the root of a new trace), ended by the
    caller (`span.end()`)."""
    return _tracer.start_span(name, context=context_of(parent), kind=kind(kind_name),
                              attributes=_clean(attributes), start_time=start_ns)


def record_span(name: str, parent: Any, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None,
                error: str | None = None) -> Any:
    """A span recorded after the fact, between two known times (e.g. a KV transfer from its outcome)."""
    span = start_span(name, parent, attributes=attributes, start_ns=start_ns)
    if error:
        set_error(span, error)
    span.end(end_time=max(start_ns, end_ns))
    return span


def set_error(span: Any, description: str) -> None:
    span.set_status(_otel.Status(_otel.StatusCode.ERROR, description))


def set_attributes(span: Any, attributes: dict[str, Any]) -> None:
    span.set_attributes(_clean(attributes))


def _clean(attributes: dict[str, Any] | None) -> dict[str, Any] | None:
    """Without None values (OpenTelemetry drops them with a warning each)."""
    if not attributes:
        return attributes
    return {key: value for key, value in attributes.items() if value is not None}


def ns(wall_seconds: float) -> int:
    """A span timestamp (ns since the epoch) of a `time.time()` reading."""
    return int(wall_seconds * 1e9)


# ---- W3C trace context: HTTP headers and gRPC metadata -------------------------------------------

def extract(pairs: Iterable[tuple[Any, Any]] | None) -> Any:
    """The Context a caller's `traceparent` (and `tracestate`) names, from (key, value) pairs: gRPC
    invocation metadata, or ASGI headers (bytes); an empty Context (a new trace) without one."""
    carrier = {}
    for key, value in pairs or ():
        key = key.decode("latin-1") if isinstance(key, bytes) else key
        if key.lower() in (TRACEPARENT, TRACESTATE):
            carrier[key.lower()] = value.decode("latin-1") if isinstance(value, bytes) else value
    return _propagator.extract(carrier)


def metadata(span: Any) -> list[tuple[str, str]]:
    """gRPC metadata that carries `span` as the callee's parent (`traceparent`, `tracestate`)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context_of(span))
    return list(carrier.items())
