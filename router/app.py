"""The router's HTTP app: `create_app(RouterConfig)` -> FastAPI.

Routes: `GET /v1/models[/{model}]`, `POST /v1/completions`, `POST /v1/chat/completions`,
`POST /v1/responses` with `GET` / `DELETE /v1/responses/{id}` (router/responses.py: served as a chat request)
(Bearer `api_key` required on /v1 when configured), `GET /health` (200 only when one prefill
and one decode worker answer, or one colocated worker does), `GET /metrics` (Prometheus),
`GET /status` (each worker's health and load, freshly polled; concurrent callers share one poll),
`POST /tokenize`, `POST /detokenize`; the API document `GET /openapi.json` and Swagger UI `GET /docs`
(router/openapi.py; open without the API key: they describe, they do not serve).

A generation request: read the body (size-capped) -> validate (400/404) -> tokenize -> admit
(429/503; each sequence: `n`, `best_of`, each prompt of a batch, router/choices.py) -> `Generation.start()` picks
workers and waits for the first token (so worker-side refusals still become proper HTTP
statuses) -> stream SSE or collect one body. A client that
disconnects at any point cancels its Generate stream, and the decode worker frees the blocks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import secrets
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.models import HTTPBearer as HTTPBearerModel
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security.base import SecurityBase
from prometheus_client import CONTENT_TYPE_LATEST

from router import openapi, protocol, responses, tools, traces
from router.choices import Choices, candidate_params
from router.config import RouterConfig
from router.dispatch import ClientGone, Dispatcher, LiveGenerations
from router.errors import (context_length_exceeded, install_error_handlers, invalid_request,
                           model_not_found, payload_too_large, unauthorized, unavailable)
from router.kv_index import KVIndex
from router.logprobs import TokenText
from router.cache_salt import request_cache_salt
from router.engagement import EngagementMonitor
from router.metrics import RequestTimer, RouterMetrics
from router.policies import make_decode_policy, make_prefill_policy
from router.pool import WorkerPool
from router.streaming import ChoiceStream, OutputAssembler, ResponseContext, collect, sse_events
from wire import tracing

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first" (metrics only)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff); strict UTF-8 bytes cannot carry one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
COUNTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize",
                 "/detokenize", "/health", "/status", "/metrics")
# Routes with a path parameter, counted under their collection's path.
COUNTED_PREFIXES = ("/v1/models/", "/v1/responses/")


@dataclass
class RouterState:
    config: RouterConfig
    tokenizer: Any
    max_model_len: int
    pool: WorkerPool
    metrics: RouterMetrics
    dispatcher: Dispatcher
    token_text: TokenText
    created: int
    responses: responses.ResponseStore  # /v1/responses kept for previous_response_id and GET


def create_app(config: RouterConfig, tokenizer: Any = None, collectors: Sequence[Any] = ()) -> FastAPI:
    """Build the app. `tokenizer` defaults to `Tokenizer.from_pretrained(config.model)`. Its
    `WorkerPool` (`app.state.router.pool`) starts with the config's static worker lists; the Ray
    deployment then adds and removes workers. `collectors`: more Prometheus collectors for /metrics."""
    if tokenizer is None:
        from engine.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_pretrained(config.model)
    max_model_len = config.max_model_len or tokenizer.max_model_len
    if not max_model_len:
        raise ValueError(f"the tokenizer at {config.model!r} does not say the model's context length; "
                         "set max_model_len (--max-model-len)")
    # One index for the pool and both policies: with --no-kv-events no events fill it, and it
    # holds only what this router sent where (the estimate).
    index = KVIndex.for_router(config)
    prefill_policy, decode_policy = make_prefill_policy(config, index), make_decode_policy(config, index)
    live = LiveGenerations()

    def forget(address: str) -> None:
        prefill_policy.forget(address)
        decode_policy.forget(address)
    pool = WorkerPool(config, kv_index=index, on_removed=forget, on_unreachable=live.worker_unreachable)
    engagement = EngagementMonitor(config.engagement_window_s, config.engagement_min_requests,
                                   has_prefill_workers=lambda: pool.has_role("prefill"))
    metrics = RouterMetrics(pool, engagement)
    for collector in collectors:
        metrics.registry.register(collector)
    dispatcher = Dispatcher(config, pool, prefill_policy, decode_policy, metrics, live)
    state = RouterState(config, tokenizer, max_model_len, pool, metrics, dispatcher, TokenText(tokenizer),
                        protocol.now(), responses.ResponseStore(config.max_stored_responses))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await _warm_up(tokenizer)
        await pool.start()
        try:
            yield
        finally:
            await pool.stop()

    app = FastAPI(title="pdserve router", description=openapi.DESCRIPTION, lifespan=lifespan, redoc_url=None,
                  **traces.FASTAPI_OPTIONS)
    openapi.install(app)
    app.state.router = state
    install_error_handlers(app)
    app.add_middleware(_ResponseCounter, metrics=metrics)
    if tracing.enabled:  # (router/traces.py: one span per generation request, its response included)
        app.add_middleware(traces.RequestTracing)
    app.include_router(_api_routes(state))
    app.include_router(_token_routes(state))
    app.include_router(_ops_routes(state))
    return app


async def _warm_up(tokenizer: Any) -> None:
    """Pay at start what the first request would otherwise wait for (~200 ms on a CPU VM): anyio
    imports its asyncio backend at the first task group, i.e. the first streamed response, and
    jinja compiles the chat template at its first use."""
    async with anyio.create_task_group():
        pass
    if tokenizer.has_chat_template:
        await asyncio.to_thread(tokenizer.render_chat_template, [{"role": "user", "content": "hi"}])


# ---- /v1 ----------------------------------------------------------------------------------------

def bearer_auth(api_key: str | None) -> Callable[..., Any]:
    """The FastAPI dependency of every protected route (here, and /admin in deploy/admin.py): with
    `api_key` set, a request must carry `Authorization: Bearer <api_key>` (compared in constant
    time), else 401; the API document then names it as the routes' security scheme."""
    if api_key is None:
        async def no_api_key() -> None:
            return None
        return no_api_key
    return _BearerAuth(api_key)


class _BearerAuth(SecurityBase):
    """`bearer_auth`'s check; a `SecurityBase`, so that FastAPI declares it in /openapi.json
    (`bearerAuth`, HTTP Bearer) on every route that depends on it."""

    def __init__(self, api_key: str) -> None:
        self.model = HTTPBearerModel(description="the router's API key (--api-key, $PDSERVE_API_KEY)")
        self.scheme_name = "bearerAuth"
        self._key = api_key.encode()

    async def __call__(self, request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self._key):
            raise unauthorized()


def _auth_errors(state: RouterState) -> tuple[int, ...]:
    """The 401 of the routes behind the API key, where one is set."""
    return (401,) if state.config.api_key is not None else ()


def _generation_responses(model: type, stream_object: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": f"the whole response; with `stream: true`, Server-Sent Events "
                                                 f"(`data: <{stream_object} JSON>` each, then `data: [DONE]`)",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def _api_routes(state: RouterState) -> APIRouter:
    api = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(state.config.api_key))])
    auth = _auth_errors(state)
    generation_errors = openapi.errors(400, *auth, 404, 413, 429, 502, 503)

    @api.get("/models", response_model=None, responses={200: {"model": protocol.ModelList}, **openapi.errors(*auth)})
    async def list_models() -> dict[str, Any]:
        """The served model."""
        card = protocol.model_card(state.config.served_model_name, state.max_model_len, state.created)
        return {"object": "list", "data": [card]}

    @api.get("/models/{model:path}", response_model=None,
             responses={200: {"model": protocol.ModelCard}, **openapi.errors(*auth, 404)})
    async def get_model(model: str) -> dict[str, Any]:
        """The served model, by its name (any other is a 404)."""
        if model != state.config.served_model_name:
            raise model_not_found(model, state.config.served_model_name)
        return protocol.model_card(model, state.max_model_len, state.created)

    @api.post("/completions", openapi_extra=openapi.json_body(protocol.CompletionRequest),
              responses={**_generation_responses(protocol.Completion, "text_completion"), **generation_errors})
    async def completions(request: Request) -> Response:
        """A completion of a prompt (text or token ids), or of each prompt of a batch."""
        return await _generate(state, request, "completions")

    @api.post("/chat/completions", openapi_extra=openapi.json_body(protocol.ChatCompletionRequest),
              responses={**_generation_responses(protocol.ChatCompletion, "chat.completion.chunk"),
                         **generation_errors})
    async def chat_completions(request: Request) -> Response:
        """The assistant's reply to the messages (rendered with the model's chat template); tool calling
        and structured output."""
        return await _generate(state, request, "chat")

    @api.post("/responses", openapi_extra=openapi.json_body(responses.ResponsesRequest), responses={
        200: {"model": responses.ResponseObject,
              "description": "the response; with `stream: true`, Server-Sent Events (`event: <type>` and `data: "
                             "<event JSON>` with its sequence_number), ending with response.completed, "
                             "response.incomplete or response.failed",
              "content": {"text/event-stream": {"schema": {"type": "string"}}}},
        **generation_errors})
    async def create_response(http_request: Request) -> Response:
        """OpenAI's Responses API, served as a chat completion: text or input items, instructions, function
        tools, structured output, previous_response_id (stored responses of this router process)."""
        timer = state.metrics.start_request()
        request = await _parse_body(state, http_request, responses.ResponsesRequest)
        turn = state.responses.begin(request)
        with responses.in_responses_terms():
            started = await _start(state, http_request, turn.chat_request(), "chat", timer, turn.id)
        if isinstance(started, Response):
            return started
        if request.stream:
            return started.event_stream(turn.events(started.context, started.streams))
        return await started.body(turn.body(started.context, started.streams))

    @api.get("/responses/{response_id}", response_model=None,
             responses={200: {"model": responses.ResponseObject}, **openapi.errors(*auth, 404)})
    async def get_response(response_id: str) -> dict[str, Any]:
        """A stored response (made with `store`, by this router process; a bounded store)."""
        return state.responses.get(response_id)

    @api.delete("/responses/{response_id}", response_model=None,
                responses={200: {"model": responses.ResponseDeleted}, **openapi.errors(*auth, 404)})
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a stored response."""
        return state.responses.delete(response_id)

    return api


def _token_routes(state: RouterState) -> APIRouter:
    """`/tokenize` and `/detokenize` (vLLM's endpoints, at the root): the router's own tokenizer
    and chat template, the same ones a generation request goes through."""
    tokens = APIRouter(dependencies=[Depends(bearer_auth(state.config.api_key))])
    token_errors = openapi.errors(400, *_auth_errors(state), 404, 413)

    @tokens.post("/tokenize", response_model=None, openapi_extra=openapi.json_body(protocol.TokenizeRequest),
                 responses={200: {"model": protocol.TokenizeResponse}, **token_errors})
    async def tokenize(http_request: Request) -> dict[str, Any]:
        """The token ids of a prompt, or of chat messages as a chat completion would prefill them."""
        request = await _parse_body(state, http_request, protocol.TokenizeRequest)
        tokenizer = state.tokenizer
        if request.messages is not None:
            try:
                messages = tools.render_messages(request.messages, None)
                ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages, request.add_generation_prompt)
            except ValueError as exc:
                raise invalid_request(str(exc), "messages") from None
        else:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = await asyncio.to_thread(tokenizer.encode, request.prompt, add_special)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @tokens.post("/detokenize", response_model=None, openapi_extra=openapi.json_body(protocol.DetokenizeRequest),
                 responses={200: {"model": protocol.DetokenizeResponse}, **token_errors})
    async def detokenize(http_request: Request) -> dict[str, Any]:
        """The text of token ids (special tokens kept)."""
        request = await _parse_body(state, http_request, protocol.DetokenizeRequest)
        bad = next((t for t in request.tokens if t >= state.tokenizer.vocab_size), None)
        if bad is not None:
            raise invalid_request(f"token id {bad} is outside the vocabulary (size {state.tokenizer.vocab_size})",
                                  "tokens")
        text = await asyncio.to_thread(state.tokenizer.decode, request.tokens, False)
        return {"prompt": text}

    return tokens


async def _generate(state: RouterState, http_request: Request, endpoint: protocol.Endpoint) -> Response:
    timer = state.metrics.start_request()
    model_cls = protocol.CompletionRequest if endpoint == "completions" else protocol.ChatCompletionRequest
    request = await _parse_body(state, http_request, model_cls)
    started = await _start(state, http_request, request, endpoint, timer)
    if isinstance(started, Response):
        return started
    if request.stream:
        return started.event_stream(sse_events(started.context, started.streams))
    return await started.body(collect(started.context, started.streams, started.keep))


@dataclass
class _Started:
    """A generation request whose choices have started: what rendering them needs, and `end`,
    which a streamed response runs however it ends."""
    context: ResponseContext
    streams: list[ChoiceStream]
    keep: int | None  # best_of: the choices to keep per prompt (`collect`'s)
    end: Callable[[str], None]
    watcher: "_DisconnectWatcher"

    def event_stream(self, events: AsyncIterator[str]) -> Response:
        """The SSE response of `events`, which close the choices as they end."""
        return _EventStream(events, self.end)

    async def body(self, render: Awaitable[dict[str, Any]]) -> Response:
        """The whole body `render` makes (it closes the choices); 499 when the client left."""
        try:
            return JSONResponse(await render)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            self.watcher.stop()


async def _start(state: RouterState, http_request: Request, request: Any, endpoint: protocol.Endpoint,
                 timer: RequestTimer, request_id: str | None = None) -> _Started | Response:
    """Tokenize, admit and start a validated completions or chat request (400 / 429 / 503 ...)
    up to its choices' first tokens; the 499 response when the client left before them."""
    trace = traces.request_trace(http_request)  # None unless tracing is on
    prompts = await _prompt_token_ids(state, request)
    salt = await request_cache_salt(state.tokenizer, request, prompts[0])
    outside = [t for t in request.logit_bias_ids if t >= state.tokenizer.vocab_size]
    if outside:
        raise invalid_request(f"logit_bias token id {outside[0]} is outside the vocabulary "
                              f"(size {state.tokenizer.vocab_size})", "logit_bias")
    keep, count = request.num_choices, request.num_candidates
    sequences = len(prompts) * count
    # A priority > 0 request is admitted within its class's share: more than that could never run.
    limit, flag = ((state.dispatcher.batch_limit, "--batch-share of --max-inflight-requests") if request.priority > 0
                   else (state.config.max_inflight_requests, "--max-inflight-requests"))
    if sequences > limit:
        raise invalid_request(f"this request needs {sequences} sequences ({len(prompts)} prompt(s) x {count}) and the "
                              f"router runs at most {limit} of its priority at once ({flag}): send fewer prompts "
                              f"per request", "prompt")
    max_tokens, logprobs = [_max_tokens(state, request, len(ids)) for ids in prompts], _logprobs(request)
    # echo with max_tokens 0 (the prompt's logprobs only): one token is generated and not returned
    echo = isinstance(request, protocol.CompletionRequest) and request.echo
    tool_plan = request.tool_plan if isinstance(request, protocol.ChatCompletionRequest) else None
    no_output = echo and max_tokens[0] == 0
    generated = [1 if no_output else m for m in max_tokens]
    if request.has_constraint():
        params = await asyncio.to_thread(request.sampling_params, generated[0], logprobs)
    else:
        params = request.sampling_params(generated[0], logprobs)
    # Prompts of a batch differ in max_tokens only where it was left to the room in the context.
    try:
        per_prompt = [candidate_params(dataclasses.replace(params, max_tokens=g) if g != params.max_tokens else params,
                                       count, keep) for g in generated]
    except ValueError as exc:  # e.g. min_tokens beyond the room a long prompt of the batch leaves
        raise request.sampling_error(exc) from exc

    request_id = request_id or f"{'cmpl' if endpoint == 'completions' else 'chatcmpl'}-{uuid.uuid4().hex}"
    if trace is not None:
        trace.describe(request, params, prompts, request_id, state.config.served_model_name, no_output)
    choices = Choices(state.dispatcher, request_id, list(zip(prompts, per_prompt)), timer,
                      salt, request.priority)
    if trace is not None:
        trace.admitted(choices.generations, state.dispatcher.inflight)
    watcher = _DisconnectWatcher(http_request, choices.cancel)
    try:
        first_chunks = await choices.start()
    except BaseException as exc:
        watcher.stop()
        choices.close("abort" if isinstance(exc, (ClientGone, asyncio.CancelledError)) else "error")
        if isinstance(exc, ClientGone):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise

    def end(finish_reason: str) -> None:  # however the response ends; a closed choice stays as it ended
        watcher.stop()
        choices.close(finish_reason)

    try:
        echoed = _echoed_prompts(state, request, prompts) if echo else [""] * len(prompts)
        streams = [ChoiceStream(p * count + j, generation,
                                OutputAssembler(state.tokenizer, prompts[p], sequence_params),
                                chunk, prompt_index=p, echoed=echoed[p])
                   for p, (group, group_params, chunks) in enumerate(zip(choices.groups, per_prompt, first_chunks))
                   for j, (generation, sequence_params, chunk) in enumerate(zip(group, group_params, chunks))]
        context = ResponseContext(endpoint, request_id, request.model, protocol.now(), state.token_text,
                                  want_logprobs=params.logprobs is not None,
                                  include_usage=request.include_usage_in_stream,
                                  tool_plan=tool_plan, echo=echo, no_output=no_output,
                                  want_prompt_logprobs=request.prompt_logprobs is not None)
        if trace is not None:
            trace.streams = streams
    except BaseException:
        end("error")
        raise
    return _Started(context, streams, keep if keep < count else None, end, watcher)


async def _parse_body(state: RouterState, http_request: Request, model_cls: type) -> Any:
    """The request body validated as `model_cls` (400s naming the field), for the served model (404)."""
    data = await _read_json_body(http_request, state.config.max_request_body_bytes)
    request = protocol.parse_request(model_cls, data)
    if request.model != state.config.served_model_name:
        raise model_not_found(request.model, state.config.served_model_name)
    return request


async def _read_json_body(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise payload_too_large(limit)
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise payload_too_large(limit)
    if not body:
        raise invalid_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise invalid_request("the request body nests JSON arrays or objects too deeply", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(body):  # the only way a lone surrogate gets in: skip the walk otherwise
        protocol.check_text(data)
    return data


async def _prompt_token_ids(state: RouterState, request: Any) -> list[list[int]]:
    """Each prompt's token ids (a chat request has one; a completions request one or a batch); a
    400 for an empty prompt, an id outside the vocabulary, or a prompt that fills the context."""
    tokenizer = state.tokenizer
    if isinstance(request, protocol.ChatCompletionRequest):
        param = "messages"
        try:
            messages = tools.render_messages(request.messages, request.tool_plan)
            prompts = [await asyncio.to_thread(tokenizer.apply_chat_template, messages,
                                               request.add_generation_prompt)]
        except ValueError as exc:
            raise invalid_request(str(exc), param) from None
    else:
        param = "prompt"
        given = request.prompts()  # all text or all token ids (the request's schema)
        if isinstance(given[0], str):  # one trip to a thread for the whole batch
            prompts = await asyncio.to_thread(lambda: [tokenizer.encode(text) if text else [] for text in given])
        else:
            prompts = given
            vocab_size = tokenizer.vocab_size
            bad = next((t for ids in prompts for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise invalid_request(f"prompt token id {bad} is outside the vocabulary (size {vocab_size})", param)
    for index, token_ids in enumerate(prompts):
        which = f"prompt {index} of the batch" if len(prompts) > 1 else "the prompt"
        if not token_ids:
            raise invalid_request(f"{which} is empty", param)
        if len(token_ids) >= state.max_model_len:
            raise context_length_exceeded(
                f"This model's maximum context length is {state.max_model_len} tokens; {which} has "
                f"{len(token_ids)} tokens, leaving no room to generate. Shorten the {param}.", param)
    return prompts


def _echoed_prompts(state: RouterState, request: Any, prompts: list[list[int]]) -> list[str]:
    """What echo returns for each prompt: a text prompt as sent, token ids decoded."""
    return [prompt if isinstance(prompt, str) else state.tokenizer.decode(token_ids, False)
            for prompt, token_ids in zip(request.prompts(), prompts)]


def _max_tokens(state: RouterState, request: Any, num_prompt_tokens: int) -> int:
    if isinstance(request, protocol.ChatCompletionRequest):
        requested, param = request.requested_max_tokens, (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens")
    else:
        requested, param = request.max_tokens, "max_tokens"
    room = state.max_model_len - num_prompt_tokens
    if requested is None:
        return room
    if requested >= 1 and requested > room:
        raise context_length_exceeded(
            f"This model's maximum context length is {state.max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
            f"completion). Reduce the prompt or {param}.", param)
    return requested


def _logprobs(request: Any) -> int | None:
    if isinstance(request, protocol.ChatCompletionRequest):
        return request.requested_logprobs
    return request.logprobs


class _EventStream(StreamingResponse):
    """The SSE response of a request's choices. `end("abort")` runs however the response ends:
    after the last event (when every choice is closed already), and also when its body never ran
    (the client gone before the first byte, or the server stopping), which a `finally` in the body
    would miss: the generations would stay open and hold their admission slots."""

    def __init__(self, events: Any, end: Callable[[str], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._end = end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end("abort")


class _DisconnectWatcher:
    """Calls `on_disconnect` when the HTTP client goes away (after the body has been read)."""

    def __init__(self, request: Request, on_disconnect: Callable[[], None]) -> None:
        self._receive = request.receive
        self._on_disconnect = on_disconnect
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._on_disconnect()
                return

    def stop(self) -> None:
        self._task.cancel()


# ---- operations ---------------------------------------------------------------------------------

def _ops_routes(state: RouterState) -> APIRouter:
    ops = APIRouter()

    @ops.get("/health", responses={200: {"model": protocol.HealthResponse}, **openapi.errors(503)})
    async def health() -> Response:
        """200 when one prefill and one decode worker answer, or one colocated worker does; with
        `degraded` when P/D is not engaged (router/engagement.py): serving, without its prefill pool."""
        if not state.pool.ready:
            raise unavailable("not ready: no healthy prefill + decode pair and no healthy colocated worker",
                              state.config.retry_after_s)
        degraded = state.metrics.engagement.degraded()
        return JSONResponse({"status": "ok", "degraded": degraded} if degraded else {"status": "ok"})

    # /status names every worker's gRPC and KV addresses: behind the key, like the API
    @ops.get("/status", dependencies=[Depends(bearer_auth(state.config.api_key))],
             responses=openapi.errors(*_auth_errors(state)))
    async def status() -> dict[str, Any]:
        """Each worker's health and load, freshly polled, and this router's in-flight requests."""
        await state.pool.poll_all_shared()
        return {"model": state.config.served_model_name, "ready": state.pool.ready,
                "max_model_len": state.max_model_len, "inflight_requests": state.dispatcher.inflight,
                "prefill_policy": state.dispatcher.prefill_policy.name,
                "decode_policy": state.dispatcher.decode_policy.name,
                "workers": [worker.status() for worker in state.pool.workers()]}

    @ops.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus' text format (`pdserve:*`)"}})
    async def metrics() -> Response:
        """Prometheus metrics."""
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return ops


class _ResponseCounter:
    """ASGI middleware: counts responses by endpoint and status code (streams at their start)."""

    def __init__(self, app, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in COUNTED_PATHS else next(
            (prefix[:-1] for prefix in COUNTED_PREFIXES if path.startswith(prefix)), "other")
        counted = False

        async def counting_send(message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.responses.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            # Starlette's outermost middleware answers it (500, errors.py's handler), outside this one
            if not counted:
                counted = True
                self.metrics.responses.labels(endpoint, "500").inc()
            raise
        finally:
            if not counted:
                self.metrics.responses.labels(endpoint, str(CLIENT_CLOSED_REQUEST)).inc()
