"""Each malformed request class gets the right status and an OpenAI-style error body; worker
refusals and missing workers become 400/429/503 with Retry-After; never a 500 for a client's
mistake."""
import time

import httpx
import openai
import pytest

from engine.sampling_params import SamplingParams
from router.errors import APIError
from tests.helpers import wait_until
from tests.router.harness import Fail, Hang, reply_script

import grpc

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("path, body, param, fragment", [
    (COMPLETIONS, {"prompt": "x"}, "model", "missing required field 'model'"),
    (COMPLETIONS, {"model": "tiny"}, "prompt", "missing required field 'prompt'"),
    (CHAT, {"model": "tiny"}, "messages", "missing required field 'messages'"),
    (CHAT, {"model": "tiny", "messages": []}, "messages", "messages"),
    (CHAT, {"model": "tiny", "messages": "hello"}, "messages", "messages"),
    (CHAT, {"model": "tiny", "messages": [{"content": "no role"}]}, "messages", "role"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages", "text"),
    (COMPLETIONS, {"model": "tiny", "prompt": 42}, "prompt", "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "temperature": 101}, "temperature", "temperature must be in"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "temperature": -1}, "temperature", "temperature must be in [0, 2]"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "top_p": -0.1}, "top_p", "top_p must be in"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p", "top_p must be in"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "top_k": -5}, "top_k", "top_k must be"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "min_p": 2}, "min_p", "min_p must be in"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty",
     "frequency_penalty"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty",
     "repetition_penalty"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "max_tokens": True}, "max_tokens", "valid integer"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "max_tokens": 2.5}, "max_tokens", "valid integer"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "logprobs": 50}, "logprobs", "logprobs must be in"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "seed": "abc"}, "seed", "valid integer"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "stop": [""]}, "stop", "stop strings"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "stop": ["s"] * 17}, "stop", "at most 16"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "n": 17}, "n", "n must be in [1, 16], got 17"),
    (CHAT, {"model": "tiny", "messages": USER, "n": 0}, "n", "n must be in [1, 16], got 0"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "n": 3, "best_of": 2}, "best_of",
     "best_of must be in [n, 16] (n=3), got 2"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "n": 1, "best_of": 3, "stream": True}, "best_of",
     "best_of > n cannot be streamed"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens", "0 only with echo"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs",
     "prompt_logprobs must be in [0, 20]"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "suffix": "end"}, "suffix", "suffix"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "logit_bias": {"five": 10}}, "logit_bias", "must be token ids"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "logit_bias": {"\u00b2": -100}}, "logit_bias", "must be token ids"),
    (COMPLETIONS, {"model": "tiny", "prompt": ["Hi", "word " * 200], "max_tokens": None, "min_tokens": 200},
     "min_tokens", "min_tokens must be an integer in [0, max_tokens]"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "logit_bias": {"5": 150}}, "logit_bias", "in [-100, 100]"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias",
     "outside the vocabulary"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens",
     "min_tokens must be an integer in [0, max_tokens]"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "speculative": "no"}, "speculative", "valid boolean"),
    (COMPLETIONS, {"model": "tiny", "prompt": ["a", ""]}, "prompt", "prompt 1 of the batch is empty"),
    (COMPLETIONS, {"model": "tiny", "prompt": [[5], [5, 99999]]}, "prompt", "outside the vocabulary"),
    (COMPLETIONS, {"model": "tiny", "prompt": []}, "prompt", "the prompt is empty"),
    (COMPLETIONS, {"model": "tiny", "prompt": ""}, "prompt", "the prompt is empty"),
    (COMPLETIONS, {"model": "tiny", "prompt": [5, 99999]}, "prompt", "outside the vocabulary"),
    (COMPLETIONS, {"model": "tiny", "prompt": [5, -1]}, "prompt", "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", "only allowed when stream"),
    (CHAT, {"model": "tiny", "messages": USER, "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    (CHAT, {"model": "tiny", "messages": USER, "tools": [{"type": "function"}]}, "tools",
     "tools[0].function: Field required"),
    (CHAT, {"model": "tiny", "messages": USER, "tools": [WEATHER_TOOL, {"type": "function", "function": {}}]},
     "tools", "tools[1].function.name: Field required"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "a text content part needs a string 'text'"),
    (CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages",
     "role must be one of system, developer, user, assistant, tool, got 'wizard'"),
    (CHAT, {"model": "tiny", "messages": USER + [{"role": "tool", "content": "Rain"}]}, "messages",
     "chat message 1: a tool message needs the tool_call_id"),
    (CHAT, {"model": "tiny", "messages": USER + [{"role": "function", "name": "f", "content": "x"}]}, "messages",
     "deprecated form of 'tool'"),
    (CHAT, {"model": "tiny", "messages": USER, "functions": [{"name": "f", "parameters": {}}]}, "functions",
     "deprecated form of tools"),
    (CHAT, {"model": "tiny", "messages": USER, "function_call": "auto"}, "function_call", "deprecated form of tools"),
    (CHAT, {"model": "tiny", "messages": USER, "modalities": ["text", "audio"]}, "modalities",
     "audio output is not supported"),
    (CHAT, {"model": "tiny", "messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, "audio",
     "audio output is not supported"),
    (CHAT, {"model": "tiny", "messages": USER, "web_search_options": {}}, "web_search_options",
     "web search is not supported"),
    (CHAT, {"model": "tiny", "messages": USER, "temperature": 2.5}, "temperature", "must be in [0, 2]"),
    (CHAT, {"model": "tiny", "messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be in [0, 20]"),
    (CHAT, {"model": "tiny", "messages": USER, "max_completion_tokens": -1}, "max_completion_tokens",
     "max_completion_tokens must be"),
    (COMPLETIONS, {"model": "tiny", "prompt": [-1, 5]}, "prompt", "token ids must be integers in [0, 2**32), got -1"),
    (COMPLETIONS, {"model": "tiny", "prompt": [[1, 2], [3, -4]]}, "prompt", "got -4"),
    (CHAT, {"model": "tiny", "messages": USER, "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "unique"),
    (CHAT, {"model": "tiny", "messages": USER, "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of the tools"),
    (CHAT, {"model": "tiny", "messages": USER, "tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice",
     "must be 'none', 'auto', 'required'"),
    (CHAT, {"model": "tiny", "messages": USER, "tool_choice": "required"}, "tool_choice", "needs tools"),
    (CHAT, {"model": "tiny", "messages": USER, "tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}},
     "tools", "cannot be combined"),
    (CHAT, {"model": "tiny", "messages": USER, "tools": [{"type": "function", "function": {
        "name": "bad", "parameters": {"type": "nonsense"}}}]}, "tools", "parameters schema is not usable"),
    (CHAT, {"model": "tiny", "messages": USER, "response_format": {"type": "xml"}}, "response_format",
     "must be 'text', 'json_object' or 'json_schema'"),
    (CHAT, {"model": "tiny", "messages": USER, "response_format": {"type": "json_schema"}}, "response_format",
     "needs a 'json_schema' object"),
    (CHAT, {"model": "tiny", "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", 'Unsupported type "foo"'),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "[a-"}}, "structured_outputs",
     "invalid regular expression"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "structured_outputs": {"grammar": "root ::= "}},
     "structured_outputs", "invalid EBNF grammar"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs",
     "needs 1 to 1024 options"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "structured_outputs": {}}, "structured_outputs",
     "exactly one of"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "structured_outputs": {"choice": ["a", 3]}},
     "structured_outputs", "non-empty strings"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "exactly one of"),
    (CHAT, {"model": "tiny", "messages": USER, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a+"}}, "structured_outputs", "not both"),
])
def test_invalid_request_is_a_400_naming_the_field(router, decode, path, body, param, fragment):
    error = error_of(httpx.post(router.url + path, json=body), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]
    assert decode.requests == []  # refused before reaching any worker


def test_bad_json_and_non_object_bodies(router):
    headers = {"content-type": "application/json"}
    error = error_of(httpx.post(router.url + COMPLETIONS, content=b"{not json", headers=headers), 400)
    assert error["code"] == "invalid_json" and "not valid JSON" in error["message"]
    error = error_of(httpx.post(router.url + COMPLETIONS, content=b"", headers=headers), 400)
    assert "empty" in error["message"]
    error = error_of(httpx.post(router.url + COMPLETIONS, content=b"\xff\xfe", headers=headers), 400)
    assert error["code"] == "invalid_json"
    error = error_of(httpx.post(router.url + CHAT, json=[1, 2, 3]), 400)
    assert "JSON object" in error["message"]


def test_json_nested_too_deeply_is_a_400_and_the_connection_goes_on(router, decode, tokenizer):
    """json.loads raises RecursionError past ~1000 levels: that is the client's JSON, a 400, and
    the same keep-alive connection serves the next request (a 500 there closed it)."""
    decode.script = reply_script(tokenizer, "ok")
    nested = b"[" * 5000 + b"]" * 5000
    with httpx.Client(base_url=router.url) as client:
        for path in (COMPLETIONS, "/tokenize"):
            error = error_of(client.post(path, content=nested, headers={"content-type": "application/json"}), 400)
            assert error["code"] == "invalid_json" and "too deeply" in error["message"]
            ok = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200


def test_unknown_model_is_a_404(router):
    error = error_of(httpx.post(router.url + CHAT, json={"model": "gpt-4o", "messages": USER}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'gpt-4o'" in error["message"] and "'tiny'" in error["message"]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_prompt_longer_than_the_context_is_a_400(router, decode):
    long_prompt = [5] * 512  # the tiny model's context is 512 tokens
    error = error_of(httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": long_prompt}), 400)
    assert error["code"] == "context_length_exceeded" and "512" in error["message"]
    error = error_of(httpx.post(router.url + COMPLETIONS,
                                json={"model": "tiny", "prompt": [5] * 500, "max_tokens": 100}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    error = error_of(httpx.post(router.url + CHAT, json={"model": "tiny", "messages": USER,
                                                         "max_completion_tokens": 1000}), 400)
    assert error["param"] == "max_completion_tokens"
    assert decode.requests == []


def test_body_size_is_capped(make_router, decode):
    router = make_router(decode=[decode.address], max_request_body_bytes=1000)
    error = error_of(httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": "x" * 2000}), 413)
    assert "1000 bytes" in error["message"]

    def chunked():  # no Content-Length: the cap applies while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(50):
            yield b"y" * 100
        yield b'"}'
    error_of(httpx.post(router.url + COMPLETIONS, content=chunked(), headers={"content-type": "application/json"}),
             413)
    assert decode.requests == []


def test_api_key_is_required_on_v1_routes(make_router, decode, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    router = make_router(colocated=[decode.address], api_key="s3cret")
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        error = error_of(httpx.post(router.url + COMPLETIONS, json=body, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    error_of(httpx.get(router.url + "/v1/models"), 401)
    assert decode.requests == []
    assert httpx.post(router.url + COMPLETIONS, json=body, headers={"authorization": "Bearer s3cret"}).status_code == 200
    good = openai.OpenAI(base_url=router.url + "/v1", api_key="s3cret", max_retries=0)
    assert good.completions.create(**body).choices[0].text == "ok"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=router.url + "/v1", api_key="bad", max_retries=0).models.list()
    assert httpx.get(router.url + "/health").status_code == 200  # probes and scrapers need no key
    assert httpx.get(router.url + "/metrics").status_code == 200
    error_of(httpx.get(router.url + "/status"), 401)  # it names every worker's address
    status = httpx.get(router.url + "/status", headers={"authorization": "Bearer s3cret"}).json()
    assert [w["address"] for w in status["workers"]] == [decode.address]


def test_unknown_route_and_method_have_openai_bodies(router):
    error = error_of(httpx.get(router.url + "/v1/nothing"), 404)
    assert error["type"] == "not_found_error"
    error = error_of(httpx.get(router.url + COMPLETIONS), 405)
    assert error["code"] == "method_not_allowed"


def test_no_healthy_decode_worker_is_a_503_with_retry_after(make_router, loop):
    dead = "127.0.0.1:1"  # nothing listens on port 1
    router = make_router(decode=[dead], unhealthy_after_failures=1)
    r = httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": "x"})
    error = error_of(r, 503)
    assert r.headers["retry-after"] == "1"
    assert error["type"] == "service_unavailable"
    health = httpx.get(router.url + "/health")
    error_of(health, 503)
    assert health.headers["retry-after"] == "1"
    status = httpx.get(router.url + "/status").json()
    assert status["ready"] is False
    assert status["workers"][0]["healthy"] is False and status["workers"][0]["last_error"]


def test_health_needs_a_prefill_and_a_decode_worker_or_a_colocated_one(make_router, decode, prefills, loop):
    only_decode = make_router(decode=[decode.address])
    assert httpx.get(only_decode.url + "/health").status_code == 503
    pair = make_router(decode=[decode.address], prefill=[prefills[0].address])
    assert httpx.get(pair.url + "/health").json() == {"status": "ok"}
    colocated = make_router(colocated=[decode.address])
    assert httpx.get(colocated.url + "/health").status_code == 200
    prefills[0].ok = False  # the worker says it is not ok: out of routing at the next poll
    wait_until(lambda: httpx.get(pair.url + "/health").status_code == 503, timeout=30, what="health to turn 503")


def test_worker_invalid_argument_becomes_a_400(router, decode):
    decode.script = lambda request: [Fail(grpc.StatusCode.INVALID_ARGUMENT, "prompt token id 7 is not allowed")]
    error = error_of(httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": "x"}), 400)
    assert error["message"] == "prompt token id 7 is not allowed"
    decode.script = lambda request: [Fail(grpc.StatusCode.INVALID_ARGUMENT, "exceeds the context window")]
    error = error_of(httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": "x"}), 400)
    assert error["code"] == "context_length_exceeded"


def test_worker_out_of_capacity_is_a_429_with_retry_after(router, decode):
    decode.script = lambda request: [Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")]
    r = httpx.post(router.url + CHAT, json={"model": "tiny", "messages": USER})
    error = error_of(r, 429)
    assert r.headers["retry-after"] == "1" and "queue full" in error["message"]
    assert router.state.dispatcher.inflight == 0


def test_router_inflight_limit_is_a_429(make_router, decode, loop, tokenizer):
    router = make_router(decode=[decode.address], max_inflight_requests=1)
    decode.script = lambda request: [*reply_script(tokenizer, "a")(request)[:1], Hang()]
    with httpx.stream("POST", router.url + COMPLETIONS,
                      json={"model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True}) as held:
        assert held.status_code == 200
        r = httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": "y"})
        error = error_of(r, 429)
        assert r.headers["retry-after"] == "1" and "max_inflight_requests=1" in error["message"]
    wait_until(lambda: router.state.dispatcher.inflight == 0, timeout=30, what="the held request to be released")
    decode.script = reply_script(tokenizer, "ok")
    assert httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": "y"}).status_code == 200


def test_a_batch_needing_more_sequences_than_the_inflight_limit_is_a_400_not_a_429(make_router, decode):
    """A 429 would invite a retry that can never be admitted."""
    router = make_router(decode=[decode.address], max_inflight_requests=4)
    r = httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": ["a", "b", "c"], "n": 2})
    error = error_of(r, 400)
    assert error["param"] == "prompt" and "needs 6 sequences (3 prompt(s) x 2)" in error["message"]
    assert "at most 4 of its priority at once (--max-inflight-requests)" in error["message"]
    assert router.state.dispatcher.inflight == 0 and not decode.requests
    # priority > 0: the class's share is the limit (a 429 could never turn into a 200)
    r = httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": ["a", "b", "c", "d"], "priority": 1})
    error = error_of(r, 400)  # 4 <= max_inflight_requests, but more than its share, 3 (batch_share 0.75)
    assert "needs 4 sequences" in error["message"] and "at most 3 of its priority at once (--batch-share" in error["message"]
    assert router.state.dispatcher.inflight == 0 and not decode.requests


def test_a_request_refused_part_way_through_admission_counts_as_nothing_finished(make_router, decode, tokenizer):
    """n=3 with room for 2: the two admitted sequences are withdrawn. They finished nothing, so
    they neither shorten the Retry-After (the drain rate) nor count as aborted requests."""
    router = make_router(decode=[decode.address], max_inflight_requests=4)
    decode.script = lambda request: [*reply_script(tokenizer, "a")(request)[:1], Hang()]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", router.url + COMPLETIONS, json=body) as first, \
            httpx.stream("POST", router.url + COMPLETIONS, json=body) as second:
        assert first.status_code == second.status_code == 200
        finished = len(router.state.dispatcher._finished)
        aborted = router.state.metrics.finished.labels("abort")._value.get()
        r = httpx.post(router.url + COMPLETIONS, json={**body, "stream": False, "n": 3})
        error_of(r, 429)
        assert router.state.dispatcher.inflight == 2
        assert len(router.state.dispatcher._finished) == finished
        assert router.state.metrics.finished.labels("abort")._value.get() == aborted


def test_priority_over_0_requests_hold_at_most_their_share_and_leave_room_for_the_rest(make_router, decode, tokenizer):
    router = make_router(decode=[decode.address], max_inflight_requests=4, batch_share=0.5)
    decode.script = lambda request: [*reply_script(tokenizer, "a")(request)[:1], Hang()]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", router.url + COMPLETIONS, json={**body, "priority": 10}) as first, \
            httpx.stream("POST", router.url + COMPLETIONS, json={**body, "priority": 10}) as second:
        assert first.status_code == second.status_code == 200
        shed = httpx.post(router.url + COMPLETIONS, json={**body, "stream": False, "priority": 10})
        error = error_of(shed, 429)
        assert "2 requests of priority > 0 in flight" in error["message"] and "retry-after" in shed.headers
        with httpx.stream("POST", router.url + COMPLETIONS, json={**body, "priority": 0}) as interactive:
            assert interactive.status_code == 200  # the rest of the limit is theirs
        metrics = httpx.get(router.url + "/metrics").text
        assert 'pdserve:requests_shed_total{priority_class="batch"} 1.0' in metrics
    wait_until(lambda: router.state.dispatcher.inflight == 0, timeout=30, what="the held requests to be released")
    assert router.state.dispatcher.inflight_batch == 0


def test_a_full_routers_retry_after_follows_the_rate_requests_finish(make_router, decode):
    dispatcher = make_router(decode=[decode.address]).state.dispatcher
    now = 1000.0
    assert dispatcher.admission_retry_after(now) == 1  # nothing finished yet: the configured default
    dispatcher._finished.extend([now - 20.0, now - 10.0])  # 2 in 20 s: a slot every 10 s
    assert dispatcher.admission_retry_after(now) == 10
    dispatcher._finished.extend([now - 1.0] * 38)  # 40 in 20 s: a slot every half second
    assert dispatcher.admission_retry_after(now) == 1
    assert dispatcher.admission_retry_after(now + 31.0) == 1  # all older than the window: the default
    dispatcher._finished.append(now - 29.0)
    assert dispatcher.admission_retry_after(now) == 29  # one in 29 s


def test_the_batch_classs_retry_after_follows_the_rate_its_own_requests_finish(make_router, decode):
    """Fast interactive requests finishing say nothing about when a priority > 0 slot frees."""
    dispatcher = make_router(decode=[decode.address], max_inflight_requests=4, batch_share=0.5).state.dispatcher
    now = time.monotonic()
    for seconds_ago in range(20):  # interactive: one a second
        dispatcher.record_finished(now - seconds_ago, batch=False)
    for seconds_ago in (19.5, 9.5):  # batch: about one every 10 s
        dispatcher.record_finished(now - seconds_ago, batch=True)
    dispatcher.inflight_batch = dispatcher.batch_limit  # the batch share is full
    with pytest.raises(APIError) as refused:
        dispatcher.generation("b", [1, 2], SamplingParams(max_tokens=1), None, priority=5)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "10"
    dispatcher.inflight_batch = 0


def test_dead_decode_worker_is_retried_on_another(make_router, decode, loop, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    # Round robin takes the dead worker ("127.0.0.1:1" sorts first) for the first request; no
    # polling in between, so the failed Generate call is what takes it out of routing.
    router = make_router(decode=[decode.address, "127.0.0.1:1"], decode_policy="round_robin",
                         stats_interval_s=3600)
    dead = router.state.pool.get("127.0.0.1:1")
    dead.healthy = True  # pretend its last poll was fine
    for _ in range(4):
        r = httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    assert dead.healthy is False and "Generate failed" in dead.last_error
    assert dead.num_routed == 1 and len(decode.requests) == 4


def test_malformed_bodies_never_cause_a_500(router):
    bodies = [None, 1, "s", [], {}, {"model": None}, {"model": "tiny", "prompt": None},
              {"model": "tiny", "prompt": [[1, 2], "a"]}, {"model": "tiny", "prompt": [[]]},
              {"model": "tiny", "prompt": "x", "stop": 5}, {"model": "tiny", "prompt": "x", "stream": "yes"},
              {"model": "tiny", "prompt": "x", "stream_options": "yes", "stream": True},
              {"model": "tiny", "messages": [None]}, {"model": "tiny", "messages": [{"role": 5, "content": "x"}]},
              {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
              {"model": "tiny", "messages": [{"role": "user"}]},
              {"model": "tiny", "prompt": "x", "temperature": float("nan")},
              {"model": "tiny", "prompt": "x", "seed": 2**70}, {"model": "tiny", "prompt": "x", "max_tokens": -5},
              {"model": "tiny", "prompt": "x", "logprobs": -1}, {"model": "tiny", "prompt": "x", "top_k": 2**40},
              {"model": "tiny", "prompt": "x", "priority": 2**40}, {"model": "tiny", "prompt": "x", "n": 2**40},
              {"model": "tiny", "prompt": "x", "max_tokens": 2**40},
              {"model": "tiny", "prompt": "x", "stop_token_ids": [2**40]}, {"model": "tiny", "prompt": [2**40]},
              {"model": "tiny", "prompt": "x", "temperature": 1e309},
              # lone surrogates: valid JSON, not valid text
              {"model": "tiny", "prompt": "a \ud800 b"}, {"model": "tiny", "prompt": "x", "stop": ["\ud800"]},
              {"model": "tiny", "prompt": "x", "cache_salt": "\udfff"},
              {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog. " * 8, "cache_salt": "\ud800"},
              {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}]
    import json
    for path in (COMPLETIONS, CHAT):
        for body in bodies:
            content = json.dumps(body).encode()  # NaN and Infinity are written as JSON extensions
            r = httpx.post(router.url + path, content=content, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path, body, param, where", [
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi \ud800"}]}, "messages",
     "messages[0].content"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x", "cache_salt": "\udfff"}, "cache_salt", "cache_salt"),
])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(router, decode, path, body, param, where):
    import json
    content = json.dumps(body).encode()  # escaped as \ud800: valid JSON, not valid text
    error = error_of(httpx.post(router.url + path, content=content, headers={"content-type": "application/json"}),
                     400)
    assert error["param"] == param
    assert error["message"].startswith(f"{where} is not valid Unicode text")
    assert decode.requests == []


def test_a_generation_that_fails_to_build_holds_no_admission_slot(make_router, decode, tokenizer, monkeypatch):
    """An internal error while the router builds a request's generation is a 500, and the slot
    it was about to take stays free (else each one would hold a slot until a restart)."""
    router = make_router(decode=[decode.address], max_inflight_requests=1)
    decode.script = reply_script(tokenizer, "ok")

    def broken(*args, **kwargs):
        raise RuntimeError("hashing broke")

    with monkeypatch.context() as patch:
        patch.setattr(router.state.dispatcher, "block_hashes", broken)
        for _ in range(2):
            error_of(httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": "x", "max_tokens": 2}), 500)
    assert router.state.dispatcher.inflight == 0
    response = httpx.post(router.url + COMPLETIONS, json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert response.status_code == 200, response.text
