"""OpenAI's Responses API (`/v1/responses`, router/responses.py) through the official `openai`
client and raw httpx, against a real uvicorn router and fake workers over real gRPC: served as a
chat request (the prompt the decode worker receives is the chat template's), chained by
previous_response_id, function calls both ways, incomplete at max_output_tokens, the stream's
events in order with their sequence numbers, and the 400 / 404 bodies. One router and its fake
workers serve the module (each test scripts the decode worker), so it runs in a few seconds."""
import json

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from tests.router.conftest import MODEL
from tests.router.harness import (Fail, FakeDecodeWorker, FakePrefillWorker, RouterServer, reply_script,
                                  token_chunks)

REPLY = "Hello world, hello there!"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.fixture(scope="module")
def decode(loop):
    """(Module-wide, in place of conftest's: the workers and router below are the module's.)"""
    worker = FakeDecodeWorker(loop).start()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def prefill(loop):
    worker = FakePrefillWorker(loop).start()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def router(loop, tokenizer, decode, prefill):
    """A router over one fake prefill and one fake decode worker (so requests go through P/D)."""
    server = RouterServer(loop, RouterConfig(model=MODEL, decode=[decode.address], prefill=[prefill.address],
                                             stats_interval_s=0.2), tokenizer)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def prompt_of(decode, tokenizer) -> str:
    return tokenizer.decode(list(decode.requests[-1].prompt_token_ids), False)


def events_of(url: str, body: dict) -> list[tuple[str, dict]]:
    """(the `event:` line, the data) of each event of a streamed response."""
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        blocks = response.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == event_line[len("event: "):]
        events.append((data["type"], data))
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return events


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_text_input_is_a_user_message_and_the_output_a_message(client, decode, prefill, tokenizer):
    decode.script = reply_script(tokenizer, REPLY, num_cached_tokens=16)
    out = client.responses.create(model="tiny", input="Say hello", max_output_tokens=64, temperature=0)
    assert out.id.startswith("resp_") and out.object == "response" and out.status == "completed"
    assert out.output_text == REPLY
    [message] = out.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    sent = decode.requests[-1]
    assert list(sent.prompt_token_ids) == tokenizer.apply_chat_template([{"role": "user", "content": "Say hello"}])
    assert sent.request_id == out.id and sent.sampling.max_tokens == 64 and sent.sampling.temperature == 0
    assert sent.prefill_address == prefill.address  # disaggregated, as a chat completion is
    usage = out.usage
    assert usage.input_tokens == len(sent.prompt_token_ids) and usage.input_tokens_details.cached_tokens == 16
    assert usage.output_tokens == len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1  # + EOS
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert out.incomplete_details is None and out.error is None and out.model == "tiny"


def test_messages_with_instructions_render_as_the_chat_template(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, REPLY)
    out = client.responses.create(model="tiny", instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "Say hello"}])
    assert out.output_text == REPLY and out.instructions == "Be brief."
    assert list(decode.requests[-1].prompt_token_ids) == tokenizer.apply_chat_template([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Say hello"}])


def test_previous_response_id_prepends_the_earlier_turn(client, decode, tokenizer, router):
    decode.script = reply_script(tokenizer, REPLY)
    first = client.responses.create(model="tiny", instructions="Be brief.", input="Say hello",
                                    metadata={"session": "a"})
    second = client.responses.create(model="tiny", input="Again", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the earlier turn's input and output; its instructions are not carried over (as OpenAI does)
    assert list(decode.requests[-1].prompt_token_ids) == tokenizer.apply_chat_template([
        {"role": "user", "content": "Say hello"}, {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "Again"}])
    third = client.responses.create(model="tiny", input="Once more", previous_response_id=second.id)
    prompt = prompt_of(decode, tokenizer)
    assert prompt.count(REPLY) == 2 and prompt.index("Say hello") < prompt.index("Again") < prompt.index("Once more")
    stored = client.responses.retrieve(first.id)
    assert stored.output_text == REPLY and stored.metadata == {"session": "a"} and stored.store is True
    assert client.responses.retrieve(third.id).previous_response_id == second.id
    deleted = httpx.delete(f"{router.url}/v1/responses/{first.id}").json()
    assert deleted == {"id": first.id, "object": "response.deleted", "deleted": True}
    gone = error_of(httpx.get(f"{router.url}/v1/responses/{first.id}"), 404)
    assert gone["code"] == "response_not_found"
    client.responses.create(model="tiny", input="Still", previous_response_id=second.id)  # its chain stays whole
    assert prompt_of(decode, tokenizer).index("Say hello") < prompt_of(decode, tokenizer).index("Still")


def test_unknown_previous_response_is_a_404_and_store_false_keeps_nothing(client, decode, tokenizer, router):
    decode.script = reply_script(tokenizer, REPLY)
    error = error_of(httpx.post(router.url + "/v1/responses", json={
        "model": "tiny", "input": "hi", "previous_response_id": "resp_nope"}), 404)
    assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
    assert error["type"] == "invalid_request_error" and "resp_nope" in error["message"]
    unstored = client.responses.create(model="tiny", input="hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_is_bounded_least_recently_used_first(make_router, decode, tokenizer):
    router = make_router(colocated=[decode.address], max_stored_responses=2)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    decode.script = reply_script(tokenizer, "ok")
    a, b = (client.responses.create(model="tiny", input=text) for text in ("a", "b"))
    client.responses.retrieve(a.id)  # a is now the more recently used
    c = client.responses.create(model="tiny", input="c")
    assert {r.id for r in (a, c)} == {client.responses.retrieve(r.id).id for r in (a, c)}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(b.id)
    assert len(router.state.responses) == 2


def test_a_function_call_round_trip(client, decode, tokenizer):
    eos = min(tokenizer.eos_token_ids)
    decode.script = lambda request: token_chunks(tokenizer.encode(CALL_TEXT, add_special_tokens=False) + [eos],
                                                 "stop")
    out = client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER])
    assert out.status == "completed" and out.output_text == ""
    [call] = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Oslo"} and call.call_id.startswith("call_")
    sampling = decode.requests[-1].sampling
    assert sampling.HasField("structured_output") and sampling.structured_output.kind == "grammar"
    assert "get_weather" in prompt_of(decode, tokenizer)  # the tools are described in the system message

    decode.script = reply_script(tokenizer, "Rainy.")
    answer = client.responses.create(model="tiny", previous_response_id=out.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "Rain"}])
    assert answer.output_text == "Rainy." and answer.status == "completed"
    prompt = prompt_of(decode, tokenizer)
    assert CALL_TEXT in prompt and "<tool_response>Rain</tool_response>" in prompt
    assert prompt.index("Weather in Oslo?") < prompt.index(CALL_TEXT) < prompt.index("<tool_response>")

    # the same turn sent by hand: the output items given back as input
    client.responses.create(model="tiny", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Oslo?"}, *[item.model_dump() for item in out.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "Rain"}])
    assert prompt_of(decode, tokenizer) == prompt


def test_a_named_tool_choice_and_a_json_schema_format_constrain_the_output(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, '{"city": "Oslo"}')
    out = client.responses.create(model="tiny", input="Oslo?", tools=[WEATHER],
                                  tool_choice={"type": "function", "name": "get_weather"})
    assert [(item.type, item.name, item.arguments) for item in out.output] == [
        ("function_call", "get_weather", '{"city": "Oslo"}')]
    assert decode.requests[-1].sampling.structured_output.kind == "json_schema"
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    out = client.responses.create(model="tiny", input="Oslo?", text={"format": {
        "type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    assert json.loads(out.output_text) == {"city": "Oslo"}
    constraint = decode.requests[-1].sampling.structured_output
    assert constraint.kind == "json_schema" and json.loads(constraint.spec) == schema


def test_max_output_tokens_makes_it_incomplete(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, REPLY)
    out = client.responses.create(model="tiny", input="hi", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete" and out.usage.output_tokens == 3
    assert out.output_text == tokenizer.decode(tokenizer.encode(REPLY, add_special_tokens=False)[:3])


@pytest.mark.parametrize("field, value, says", [
    ("background", True, "background responses are not supported"),
    ("reasoning", {"effort": "high"}, "do not reason"),
    ("include", ["message.output_text.logprobs"], "include is not supported"),
    ("truncation", "auto", 'truncation must be "disabled"'),
    ("tools", [{"type": "web_search"}], "only function tools are supported"),
    ("tool_choice", {"type": "web_search_preview"}, "built-in tools"),
    ("input", [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "only text parts (input_text, output_text)"),
    ("input", [{"type": "reasoning", "summary": []}], "items of type 'reasoning' are not supported"),
    ("input", [{"role": "tool", "content": "x"}], "function_call_output"),
    ("text", {"format": {"type": "xml"}}, "text.format type must be"),
    ("max_output_tokens", 100000, "max_output_tokens"),  # chat's context check, in this API's field names
])
def test_what_is_not_served_is_a_400_naming_the_field(router, field, value, says):
    error = error_of(httpx.post(router.url + "/v1/responses", json={"model": "tiny", "input": "hi", field: value}),
                     400)
    assert error["param"] == ("text.format" if field == "text" else field) and says in error["message"]
    assert error["type"] == "invalid_request_error"
    assert "max_completion_tokens" not in error["message"]


def test_the_openai_client_sees_a_400_as_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model="tiny", input="hi", background=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="hi")


def test_stream_events_come_in_order_with_sequence_numbers(router, decode, tokenizer):
    decode.script = reply_script(tokenizer, REPLY)
    events = events_of(router.url, {"model": "tiny", "input": "hi"})
    types = [kind for kind, _ in events]
    deltas = types.count("response.output_text.delta")
    assert deltas > 3
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    data = dict(events)
    assert data["response.created"]["response"]["status"] == "in_progress"
    item_id = data["response.output_item.added"]["item"]["id"]
    texts = [event["delta"] for kind, event in events if kind == "response.output_text.delta"]
    assert "".join(texts) == REPLY == data["response.output_text.done"]["text"]
    assert all(event.get("item_id", item_id) == item_id for _, event in events[3:-2])
    final = data["response.completed"]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == REPLY
    assert final["usage"]["output_tokens"] == len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1
    assert data["response.output_item.done"]["item"] == final["output"][0]


def test_the_openai_client_streams(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, REPLY)
    with client.responses.stream(model="tiny", input="hi") as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == REPLY == final.output_text
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == REPLY
    decode.script = reply_script(tokenizer, REPLY)
    kinds = [event.type for event in client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                                             stream=True)]
    assert kinds[-1] == "response.incomplete"


def test_a_streamed_function_call(router, decode, tokenizer):
    eos = min(tokenizer.eos_token_ids)
    decode.script = lambda request: token_chunks(tokenizer.encode(CALL_TEXT, add_special_tokens=False) + [eos],
                                                 "stop")
    events = events_of(router.url, {"model": "tiny", "input": "Weather in Oslo?", "tools": [WEATHER]})
    assert [kind for kind, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    data = dict(events)
    assert data["response.output_item.added"]["item"]["arguments"] == ""
    done = data["response.output_item.done"]["item"]
    assert done["type"] == "function_call" and json.loads(done["arguments"]) == {"city": "Oslo"}
    assert data["response.function_call_arguments.delta"]["delta"] == done["arguments"]
    assert data["response.completed"]["response"]["output"] == [done]


def test_a_failure_after_the_stream_began_is_response_failed(make_router, decode, tokenizer):
    router = make_router(colocated=[decode.address], max_migrations=0)
    tokens = tokenizer.encode(REPLY, add_special_tokens=False)
    decode.script = lambda request: [*token_chunks(tokens[:3], ""), Fail(grpc.StatusCode.INTERNAL, "boom")]
    events = events_of(router.url, {"model": "tiny", "input": "hi"})
    kind, failed = events[-1]
    assert kind == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert len(router.state.responses) == 0  # a failed response is not stored


def test_responses_are_counted_in_metrics(client, decode, tokenizer, router):
    def counts() -> dict[str, float]:
        text = httpx.get(router.url + "/metrics").text
        return {s.labels["status"]: s.value for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "pdserve:http_responses_total" and s.labels["endpoint"] == "/v1/responses"}

    before = counts()
    decode.script = reply_script(tokenizer, "ok")
    client.responses.create(model="tiny", input="hi")
    httpx.get(router.url + "/v1/responses/resp_unknown")
    after = counts()
    new = {status: after[status] - before.get(status, 0) for status in after}
    assert {status: count for status, count in new.items() if count} == {"200": 1, "404": 1}
