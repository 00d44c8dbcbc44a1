"""The router's spans of a generation request (OpenTelemetry; set up by wire/tracing.py, which
`python -m router` and deploy's router processes call with `--otlp-traces-endpoint`). Without it
`create_app` adds no middleware and `request_trace` is None: the request path checks
`tracing.enabled` or a None and does nothing else.

One trace per request, continuing the client's W3C `traceparent` header if it sent one:

    chat MODEL | text_completion MODEL   SERVER, the HTTP request (`RequestTracing`, an ASGI
        middleware: from the request's arrival to the last byte of its response; named
        `POST /v1/...` until the body names the model). GenAI attributes (gen_ai.request.*,
        gen_ai.usage.*, gen_ai.response.finish_reasons), the HTTP status, `pdserve.migrations`;
        events `admitted` (the router's requests in flight) and `migration` (which worker broke, why)
      queue                              arrival -> the first dispatch (body, tokenizing, admission)
      route                              one per dispatch: the decode worker and why
                                         (`pdserve.route.decode.*`: reason, hit tier, matched blocks),
                                         where the prompt is prefilled (`pdserve.route.prefill`:
                                         remote or local, `.reason`, the prefill worker and its match)
      pdserve.v1.DecodeService/Generate  CLIENT, one per dispatch: the stream on the decode worker,
                                         whose spans continue under it (serving/traces.py); a
                                         migration is another one, `pdserve.migration` true
"""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Sequence

from fastapi import FastAPI

from wire import tracing

SCOPE_KEY = "pdserve.trace"  # the request's RequestTrace, in its ASGI scope
# `FastAPI(**FASTAPI_OPTIONS)`: FastAPI's own telemetry (in releases that have it) traces every
# request once a tracer provider is set; off, so that a generation request has one SERVER span
# (this module's) and the health polls and metric scrapes none.
FASTAPI_OPTIONS: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters else {})
# gen_ai.operation.name of each traced route (a Responses API request is served as a chat completion)
OPERATIONS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat", "/v1/responses": "chat"}
GENERATE_SERVICE = "pdserve.v1.DecodeService"


class RequestTracing:
    """ASGI middleware (added only when tracing is on): the SERVER span of each generation request,
    ended with its status once the whole response (every SSE event) is sent. At the app's shutdown
    (its requests done) the spans still queued are sent: uvicorn ends a server stopped by SIGTERM
    by raising the signal again, which skips the exit handlers."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, _flushing_at_shutdown(send))
            return
        if scope["type"] != "http" or scope.get("path") not in OPERATIONS:
            await self.app(scope, receive, send)
            return
        trace = scope[SCOPE_KEY] = RequestTrace(scope)
        status = None

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException as exc:
            trace.end(status or 500, f"{type(exc).__name__}: {exc}")
            raise
        trace.end(status)


def _flushing_at_shutdown(send: Any) -> Any:
    async def flushing_send(message: Any) -> None:
        if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            await asyncio.to_thread(tracing.flush)
        await send(message)
    return flushing_send


def request_trace(http_request: Any) -> "RequestTrace | None":
    """The request's trace; None when tracing is off."""
    return http_request.scope.get(SCOPE_KEY) if tracing.enabled else None


class RequestTrace:
    """One request's SERVER span and what its end reports."""

    def __init__(self, scope: Any) -> None:
        self.operation = OPERATIONS[scope["path"]]
        self.span = tracing.start_span(f"{scope['method']} {scope['path']}", tracing.extract(scope.get("headers")),
                                       "SERVER", {"http.request.method": scope["method"], "url.path": scope["path"],
                                                  "http.route": scope["path"],
                                                  "gen_ai.operation.name": self.operation})
        self.started_ns = time.time_ns()
        self.streams: Sequence[Any] | None = None  # the response's ChoiceStreams (router/streaming.py), once built
        self.no_output = False
        self._queued = False

    def describe(self, request: Any, params: Any, prompts: Sequence[Sequence[int]], request_id: str,
                 served_model: str, no_output: bool) -> None:
        """What was asked (GenAI request attributes), once the body is read and tokenized."""
        self.span.update_name(f"{self.operation} {request.model}")
        stop = list(params.stop) if params.stop else None
        tracing.set_attributes(self.span, {
            "gen_ai.request.model": request.model, "gen_ai.response.model": served_model,
            "gen_ai.response.id": request_id, "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k if params.top_k and params.top_k > 0 else None,
            "gen_ai.request.seed": params.seed, "gen_ai.request.frequency_penalty": params.frequency_penalty,
            "gen_ai.request.presence_penalty": params.presence_penalty, "gen_ai.request.stop_sequences": stop,
            "gen_ai.request.choice.count": request.num_choices if request.num_choices != 1 else None,
            "pdserve.stream": bool(request.stream), "pdserve.priority": request.priority,
            "pdserve.prompts": len(prompts), "pdserve.prompt_tokens": sum(len(p) for p in prompts)})
        self.no_output = no_output  # echo with max_tokens 0: the one token generated is not returned

    def admitted(self, generations: Sequence[Any], inflight: int) -> None:
        """The request's Generations were admitted: they report their dispatches here."""
        for generation in generations:
            generation.trace = self
        self.span.add_event("admitted", {"pdserve.router.inflight_requests": inflight,
                                         "pdserve.sequences": len(generations)})

    def migration(self, generation: Any, failed: str, reason: str) -> None:
        self.span.add_event("migration", {"pdserve.request_id": generation.request_id, "pdserve.failed_worker": failed,
                                          "pdserve.reason": reason,
                                          "pdserve.num_resumed_tokens": len(generation.delivered)})

    def end(self, status: int | None, error: str | None = None) -> None:
        span = self.span
        attributes: dict[str, Any] = {"http.response.status_code": status}
        if self.streams:
            from router.streaming import usage
            used = usage(self.streams, self.no_output)
            attributes.update({
                "gen_ai.usage.input_tokens": used["prompt_tokens"],
                "gen_ai.usage.output_tokens": used["completion_tokens"],
                "pdserve.cached_tokens": used.get("prompt_tokens_details", {}).get("cached_tokens"),
                "gen_ai.response.finish_reasons": [stream.finish_reason for stream in self.streams],
                "pdserve.migrations": sum(stream.generation.migrations for stream in self.streams)})
        tracing.set_attributes(span, attributes)
        if error is not None:
            tracing.set_error(span, error)
        elif status is None:
            tracing.set_error(span, "the client went away before the response started")
        elif status >= 500:
            tracing.set_error(span, f"HTTP {status}")
        span.end()

    # ---- a Generation's dispatches (router/dispatch.py) ----------------------------------------

    def generate_started(self, generation: Any, routed_ns: int, decode: Any, prefill: Any, considered: Any,
                         attempt: int, resumed: int) -> Any:
        """The `route` span of a dispatch (from `routed_ns`, when it started choosing, to now) and
        the CLIENT span of its Generate call, returned (`watch` ends it with the call)."""
        if not self._queued:
            self._queued = True
            tracing.record_span("queue", self.span, self.started_ns, routed_ns)
        where, why = _prefill_route(generation, decode, prefill, considered)
        attributes = {
            "pdserve.request_id": generation.request_id, "pdserve.route.attempt": attempt,
            "pdserve.route.decode.worker": decode.worker.address, "pdserve.route.decode.role": decode.worker.role,
            "pdserve.route.decode.reason": decode.reason, "pdserve.route.decode.hit_tier": _hit_tier(decode),
            "pdserve.route.decode.matched_blocks": decode.match.device,
            "pdserve.route.decode.matched_host_blocks": decode.match.host,
            "pdserve.route.prefill": where, "pdserve.route.prefill.reason": why,
            "pdserve.route.prompt_tokens": len(generation.prompt_token_ids) + resumed,
            "pdserve.route.prompt_blocks": len(generation.hashes)}
        shown = prefill or considered  # the prefill worker used, or the one a local prefill was weighed against
        if shown is not None:
            attributes.update({
                "pdserve.route.prefill.worker": shown.worker.address, "pdserve.route.prefill.policy": shown.reason,
                "pdserve.route.prefill.hit_tier": _hit_tier(shown),
                "pdserve.route.prefill.matched_blocks": shown.match.device,
                "pdserve.route.prefill.matched_host_blocks": shown.match.host})
        tracing.record_span("route", self.span, routed_ns, time.time_ns(), attributes)
        host, _, port = decode.worker.address.rpartition(":")
        migration = generation.migrations > 0 and resumed > 0
        return tracing.start_span(f"{GENERATE_SERVICE}/Generate", self.span, "CLIENT", {
            "rpc.system": "grpc", "rpc.service": GENERATE_SERVICE, "rpc.method": "Generate",
            "server.address": host, "server.port": int(port) if port.isdigit() else None,
            "pdserve.request_id": generation.request_id, "pdserve.route.attempt": attempt,
            "pdserve.prefill_address": prefill.worker.address if prefill is not None else "",
            "pdserve.migration": migration, "pdserve.migration.number": generation.migrations if migration else None,
            "pdserve.num_resumed_tokens": resumed})


def watch(span: Any, call: Any) -> None:
    """End the Generate CLIENT `span` when its `call` ends, with the call's gRPC status (an error
    unless OK, or CANCELLED by the router itself: the client left, a stop string, a migration)."""
    def done(ended: Any) -> None:
        try:
            asyncio.get_running_loop().create_task(_ended(span, ended))
        except RuntimeError:  # no event loop (the process is stopping): end it as it stands
            span.end()
    call.add_done_callback(done)


async def _ended(span: Any, call: Any) -> None:
    try:
        code, details = await call.code(), await call.details()
    except Exception as exc:  # (a call that ended cannot fail to say how; be safe anyway)
        code, details = None, repr(exc)
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is None or code.name not in ("OK", "CANCELLED"):
        tracing.set_error(span, f"{code.name if code is not None else 'UNKNOWN'}: {details}")
    span.end()


def _prefill_route(generation: Any, decode: Any, prefill: Any, considered: Any) -> tuple[str, str]:
    """Where the dispatch has the prompt prefilled ("remote" or "local") and why (router/dispatch.py
    `_dispatch`'s choice; a decode worker may still prefill a short uncached tail itself)."""
    if prefill is not None:
        return "remote", "prefill_worker"
    if decode.worker.role != "decode":
        return "local", "colocated"
    if decode.reason == "sibling":
        return "local", "sibling"  # another choice of the request: its prompt is cached there
    if generation.params.prompt_logprobs is not None:
        return "local", "prompt_logprobs"  # computed where the prompt is prefilled
    if considered is None:
        return "local", "no_prefill_worker"
    return "local", "local_queue"  # conditional disaggregation (router/policies.py prefill_locally)


def _hit_tier(choice: Any) -> str:
    """The deepest tier the chosen worker holds the prompt's prefix in (as router/dispatch.py's)."""
    return "host" if choice.match.host else "device" if choice.match.device else "none"
