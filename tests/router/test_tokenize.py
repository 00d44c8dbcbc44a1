"""`/tokenize` and `/detokenize` (vLLM's endpoints): the router's tokenizer and chat template, the
ones a generation request goes through, round-trip text and chat messages; bad bodies are 400s
that name the field, a wrong model a 404, a missing key a 401."""
import httpx
import pytest

from tests.router.test_errors import error_of

MODEL = "tiny"
TEXT = "Hello world, the river ecology report. Ünïcödé too."
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]


def test_a_prompt_round_trips(router, tokenizer):
    out = httpx.post(router.url + "/tokenize", json={"model": MODEL, "prompt": TEXT}).json()
    assert out["tokens"] == tokenizer.encode(TEXT) and out["count"] == len(out["tokens"]) > 5
    assert out["max_model_len"] == router.state.max_model_len
    back = httpx.post(router.url + "/detokenize", json={"model": MODEL, "tokens": out["tokens"]}).json()
    assert back == {"prompt": TEXT}


def test_chat_messages_tokenize_as_a_chat_completion_prompt(router, tokenizer):
    out = httpx.post(router.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert out["tokens"] == tokenizer.apply_chat_template(MESSAGES, True)  # what /v1/chat/completions prefills
    back = httpx.post(router.url + "/detokenize", json={"model": MODEL, "tokens": out["tokens"]}).json()
    assert back["prompt"] == tokenizer.render_chat_template(MESSAGES, True)
    without = httpx.post(router.url + "/tokenize",
                         json={"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["tokens"] == tokenizer.apply_chat_template(MESSAGES, False) != out["tokens"]


@pytest.mark.parametrize("path, body, status, param, fragment", [
    ("/tokenize", {"model": MODEL}, 400, "prompt", "exactly one of prompt and messages"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": MESSAGES}, 400, "prompt", "exactly one"),
    ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt", "prompt"),
    ("/tokenize", {"model": MODEL, "messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens",
     "chat template"),
    ("/tokenize", {"prompt": "a"}, 400, "model", "missing required field 'model'"),
    # messages a chat completion refuses are refused here too (the same ids, or the same 400)
    ("/tokenize", {"model": MODEL, "messages": [{"role": "bot", "content": "hi"}]}, 400, "messages",
     "role must be one of"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "tool", "content": "4"}]}, 400, "messages",
     "tool_call_id"),
    ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages", "must not be empty"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model", "other"),
    ("/detokenize", {"model": MODEL, "tokens": [1, 10**6]}, 400, "tokens", "outside the vocabulary"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens", "tokens"),
    ("/detokenize", {"model": MODEL}, 400, "tokens", "missing required field 'tokens'"),
])
def test_bad_requests_name_the_field(router, path, body, status, param, fragment):
    error = error_of(httpx.post(router.url + path, json=body), status)
    assert error["param"] == param and fragment in error["message"]


def test_the_api_key_guards_them(make_router, decode, prefills):
    server = make_router(decode=[decode.address], prefill=[p.address for p in prefills], api_key="secret")
    assert httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "a"}).status_code == 401
    ok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "a"},
                    headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200 and ok.json()["count"] >= 1
