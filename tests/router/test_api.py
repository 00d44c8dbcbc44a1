"""The OpenAI API through the official `openai` client, against a real uvicorn router and fake
decode/prefill workers over real gRPC."""
import json

import httpx
import openai
import pytest

from tests.helpers import wait_until
from tests.router.harness import Hang, reply_script, token_chunks

REPLY = "Hello world, hello there!"
NON_ASCII = "Grüße aus Zürich: 世界 🎉 ok"


@pytest.fixture
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client, router):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_non_streaming(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, REPLY, num_cached_tokens=16)
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40)
    assert out.choices[0].text == REPLY
    assert out.choices[0].finish_reason == "stop"
    prompt_ids = tokenizer.encode("Once upon a time")
    assert out.usage.prompt_tokens == len(prompt_ids)
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert out.usage.completion_tokens == len(reply_ids) + 1  # + EOS
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens == 16
    sent = decode.requests[-1]
    assert list(sent.prompt_token_ids) == prompt_ids
    assert sent.sampling.max_tokens == 40
    assert sent.request_id == out.id


def test_completion_streaming_with_usage(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, REPLY)
    stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=40, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == REPLY
    assert len([t for t in texts if t]) > 3  # streamed piece by piece, not in one block
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1


def test_chat_non_streaming_applies_the_chat_template(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, REPLY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=64)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == REPLY
    assert out.choices[0].finish_reason == "stop"
    assert list(decode.requests[-1].prompt_token_ids) == tokenizer.apply_chat_template(messages)
    assert out.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages))


def test_chat_streaming(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, REPLY)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == REPLY
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage.prompt_tokens == len(decode.requests[-1].prompt_token_ids)


def test_chat_without_max_tokens_gets_the_rest_of_the_context(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    sent = decode.requests[-1]
    assert sent.sampling.max_tokens == 512 - len(sent.prompt_token_ids)


def test_max_tokens_finishes_with_length(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, REPLY)
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=3)
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3
    assert out.choices[0].text == tokenizer.decode(reply_ids[:3])


def test_non_ascii_output_never_splits_a_character(client, decode, tokenizer):
    reply_ids = tokenizer.encode(NON_ASCII, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in reply_ids]
    assert any("\ufffd" in p for p in pieces)  # the tokenizer does split characters across tokens
    decode.script = reply_script(tokenizer, NON_ASCII)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "grüß"}],
                                            stream=True)
    texts = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == NON_ASCII
    assert all("\ufffd" not in t for t in texts)
    out = client.completions.create(model="tiny", prompt="Zürich", max_tokens=100)
    assert out.choices[0].text == NON_ASCII


def test_stop_string_truncates_and_aborts_the_worker(client, decode, tokenizer, router):
    text = "Hello world. And then more text that should never be sent"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    decode.script = lambda request: [*token_chunks(tokens, ""), Hang()]  # only an abort ends this stream
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=100, stop=[". And"])
    assert out.choices[0].text == "Hello world"
    assert out.choices[0].finish_reason == "stop"
    request_id = decode.requests[-1].request_id
    wait_until(lambda: request_id in decode.finished and request_id in decode.aborts,
               timeout=30, what="the router to abort the worker's request")
    assert decode.free_blocks == decode.num_blocks
    stop_ids = tokenizer.encode("Hello world. And", add_special_tokens=False)
    assert out.usage.completion_tokens <= len(stop_ids) + 1
    assert decode.requests[-1].sampling.stop_token_ids == []  # stop strings stay in the router


def test_stop_string_streaming_holds_back_a_possible_stop(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, "one, two, three STOP four")
    stream = client.completions.create(model="tiny", prompt="count", max_tokens=100, stop="STOP",
                                       stream=True)
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == "one, two, three "
    assert all("S" not in t for t in texts)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_included_when_asked(router, decode, tokenizer):
    decode.script = reply_script(tokenizer, "alpha beta gamma")
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 50,
                                                        "stop": ["beta"], "include_stop_str_in_output": True})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "alpha beta"


@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_token_that_ended_the_output_is_not_in_its_text(router, decode, tokenizer, stream):
    """A stop token id (here ",") or an EOS kept by skip_special_tokens=false ends the output: as in
    vLLM its text is left out, unless include_stop_str_in_output; it is still a completion token."""
    comma = tokenizer.encode(",", add_special_tokens=False)
    reply = tokenizer.encode("alpha beta", add_special_tokens=False) + comma
    decode.script = lambda request: token_chunks(reply, "stop")
    for include, expected in ((False, "alpha beta"), (True, "alpha beta,")):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "stop_token_ids": comma, "stream": stream,
                "include_stop_str_in_output": include, "stream_options": {"include_usage": True} if stream else None}
        r = httpx.post(router.url + "/v1/completions", json=body)
        assert r.status_code == 200
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            usage = events[-1]["usage"]
        else:
            text, usage = r.json()["choices"][0]["text"], r.json()["usage"]
        assert text == expected and usage["completion_tokens"] == len(reply)


def test_sampling_parameters_reach_the_worker(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    client.completions.create(model="tiny", prompt="Hi", max_tokens=7, temperature=0.7, top_p=0.9, seed=1234,
                              presence_penalty=0.5, frequency_penalty=-0.5, user="someone",
                              extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                                          "ignore_eos": True, "stop_token_ids": [5, 6]})
    sampling = decode.requests[-1].sampling
    assert sampling.max_tokens == 7
    assert sampling.temperature == pytest.approx(0.7)
    assert sampling.top_p == pytest.approx(0.9)
    assert sampling.top_k == 20
    assert sampling.min_p == pytest.approx(0.05)
    assert sampling.seed == 1234
    assert sampling.presence_penalty == pytest.approx(0.5)
    assert sampling.frequency_penalty == pytest.approx(-0.5)
    assert sampling.repetition_penalty == pytest.approx(1.1)
    assert sampling.ignore_eos is True
    assert list(sampling.stop_token_ids) == [5, 6]
    assert not sampling.HasField("logprobs")
    client.completions.create(model="tiny", prompt="Hi", max_tokens=7)
    defaults = decode.requests[-1].sampling
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (1.0, 1.0, -1, 1.0)
    assert not defaults.HasField("seed")


def test_token_id_prompt(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4)
    assert list(decode.requests[-1].prompt_token_ids) == [5, 6, 7, 8]
    client.completions.create(model="tiny", prompt=["just one"], max_tokens=4)
    assert list(decode.requests[-1].prompt_token_ids) == tokenizer.encode("just one")


def test_completion_logprobs(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, "Hello world", eos=False)
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=50, logprobs=2)
    assert decode.requests[-1].sampling.logprobs == 2
    reply_ids = tokenizer.encode("Hello world", add_special_tokens=False)
    logprobs = out.choices[0].logprobs
    assert "".join(logprobs.tokens) == "Hello world"
    assert logprobs.token_logprobs == [pytest.approx(-0.5)] * len(reply_ids)
    assert len(logprobs.top_logprobs) == len(reply_ids) and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_chat_logprobs_stream_and_bytes(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, "世界", eos=False)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            logprobs=True, top_logprobs=2, stream=True)
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert decode.requests[-1].sampling.logprobs == 2
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8") == "世界"
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_seed_is_forwarded_identically(client, decode, tokenizer):
    decode.script = reply_script(tokenizer, "ok")
    for _ in range(2):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], seed=7,
                                       temperature=1.0, max_tokens=5)
    first, second = decode.requests[-2:]
    assert first.sampling == second.sampling and first.sampling.seed == 7
    assert first.prompt_token_ids == second.prompt_token_ids


def test_worker_error_mid_stream_becomes_an_error_event(router, decode, tokenizer):
    pb_chunks = token_chunks(tokenizer.encode("partial", add_special_tokens=False), "")
    def script(request):
        failure = token_chunks([], "error")[0]
        failure.error = "the KV transfer failed"
        return [*pb_chunks, failure]
    decode.script = script
    with httpx.stream("POST", router.url + "/v1/completions",
                      json={"model": "tiny", "prompt": "x", "max_tokens": 20, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "the KV transfer failed" in error["message"] and error["type"] == "upstream_error"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert text == "partial"


def test_worker_error_before_any_token_is_an_http_error(router, decode, tokenizer):
    def script(request):
        failure = token_chunks([], "error")[0]
        failure.error = "model step failed"
        return [failure]
    decode.script = script
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5})
    assert r.status_code == 502
    assert "model step failed" in r.json()["error"]["message"]
    assert router.state.dispatcher.inflight == 0


def test_n_choices_are_sequences_of_their_own_started_beside_the_first(client, decode, tokenizer):
    """n=3: three Generate requests, ids `<id>-i`, seeds seed + i; the first is prefilled on a
    prefill worker, the other two on the first one's decode worker (no prefill address), after
    the first one's first token. Streamed chunks carry their choice's index; usage counts the
    prompt once and every choice's tokens."""
    replies = {5: "one fish", 6: "two fish red", 7: "blue fish ok go"}
    scripts = {seed: reply_script(tokenizer, text) for seed, text in replies.items()}
    decode.script = lambda request: scripts[request.sampling.seed](request)
    before = len(decode.requests)
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=1.0,
                                    seed=5, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == list(replies.values())
    sent = decode.requests[before:]
    assert sorted(r.request_id for r in sent) == [f"{out.id}-{i}" for i in range(3)]
    assert sent[0].request_id == f"{out.id}-0" and sent[0].prefill_address
    assert [r.prefill_address for r in sent[1:]] == ["", ""]
    assert sorted(r.sampling.seed for r in sent) == [5, 6, 7]
    prompt_len = len(tokenizer.encode("Once upon a time"))
    completion = sum(len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in replies.values())
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_len, completion)

    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=1.0,
                                       seed=5, n=3, stream=True, stream_options={"include_usage": True})
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        usage = chunk.usage or usage
    assert texts == list(replies.values()) and finishes == ["stop"] * 3
    assert usage.completion_tokens == completion


def test_best_of_keeps_the_candidate_with_the_highest_cumulative_logprob(client, decode, tokenizer):
    """The fake worker's logprobs fall with each token (-0.5, -1.5, ...), so the shortest reply is
    the most likely. The workers are asked for the sampled token's logprob (logprobs=0) although
    the client did not ask, and the response carries none."""
    replies = {1: "a much longer reply here", 2: "ok", 3: "medium reply"}
    scripts = {seed: reply_script(tokenizer, text, per_chunk=64) for seed, text in replies.items()}
    decode.script = lambda request: scripts[request.sampling.seed](request)
    before = len(decode.requests)
    out = client.completions.create(model="tiny", prompt="Pick one", max_tokens=40, temperature=1.0, seed=1,
                                    n=1, best_of=3)
    assert [(c.index, c.text, c.logprobs) for c in out.choices] == [(0, "ok", None)]
    assert all(r.sampling.HasField("logprobs") and r.sampling.logprobs == 0 for r in decode.requests[before:])
    assert out.usage.completion_tokens == sum(len(tokenizer.encode(t, add_special_tokens=False)) + 1
                                              for t in replies.values())


def test_a_batch_of_prompts_returns_each_prompts_choices_in_order(client, decode, tokenizer):
    """OpenAI's list of prompts: prompt i's choice j is choice i * n + j, each prompt is sent to
    the workers as its own sequences (with n: one per choice), echo returns each choice's own
    prompt, and usage counts each prompt once and every choice's tokens."""
    replies = {"Once upon a time": "there was a fox", "Hello": "world", "1 2 3": "4 5 6"}
    by_prompt = {tuple(tokenizer.encode(prompt)): reply_script(tokenizer, reply) for prompt, reply in replies.items()}
    decode.script = lambda request: by_prompt[tuple(request.prompt_token_ids)](request)
    before = len(decode.requests)
    prompts = list(replies)
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=20, n=2, echo=True)
    sent = decode.requests[before:]
    assert sorted(tuple(r.prompt_token_ids) for r in sent) == sorted(list(by_prompt) * 2)
    assert len({r.request_id for r in sent}) == 6
    expected = [prompt + reply for prompt, reply in replies.items() for _ in range(2)]
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(i, text, "stop") for i, text in
                                                                          enumerate(expected)]
    assert out.usage.prompt_tokens == sum(len(ids) for ids in by_prompt)
    assert out.usage.completion_tokens == 2 * sum(len(tokenizer.encode(r, add_special_tokens=False)) + 1
                                                  for r in replies.values())
    pieces = [""] * 6
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=20, n=2, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert pieces == [reply for reply in replies.values() for _ in range(2)]
    as_ids = client.completions.create(model="tiny", prompt=[tokenizer.encode(p) for p in prompts], max_tokens=20)
    assert [c.text for c in as_ids.choices] == list(replies.values())


def test_best_of_ranks_the_candidates_of_each_prompt_of_a_batch_apart(client, decode, tokenizer):
    """best_of over a batch: each prompt keeps its own most likely candidate (the shortest reply
    here: the fake worker's logprobs fall with each token), at choice index = prompt index."""
    replies = {("A", 1): "a b c d", ("A", 2): "a", ("B", 1): "b", ("B", 2): "b c d e f"}
    scripts = {(tuple(tokenizer.encode(p)), seed): reply_script(tokenizer, text, per_chunk=64)
               for (p, seed), text in replies.items()}
    decode.script = lambda request: scripts[tuple(request.prompt_token_ids), request.sampling.seed](request)
    out = client.completions.create(model="tiny", prompt=["A", "B"], max_tokens=20, temperature=1.0, seed=1,
                                    n=1, best_of=2)
    assert [(c.index, c.text) for c in out.choices] == [(0, "a"), (1, "b")]


def test_echoed_prompt_offsets_index_the_text_as_sent_when_the_tokenizer_adds_a_bos(tokenizer):
    """The first prompt token is a BOS the tokenizer added (Llama-style tokenizers do; SmolLM2 does
    not): it is not in the echoed text, so the offsets of the tokens after it start at 0."""
    from types import SimpleNamespace

    from router.logprobs import TokenText
    from router.streaming import echo_logprobs
    token_text = TokenText(tokenizer)
    text = "Hello world"
    ids = tokenizer.encode(text)
    bos = tokenizer.all_special_ids[0]
    entries = [SimpleNamespace(token_id=token_id, logprob=-1.0, top=[]) for token_id in ids]
    logprobs = echo_logprobs(token_text, text, [bos] + ids, entries, [])
    offsets = logprobs["text_offset"][1:]
    assert [text[start:start + len(token)] for start, token in zip(offsets, logprobs["tokens"][1:])] == \
        logprobs["tokens"][1:]
    assert offsets[0] == 0
    # without a BOS the first token is the text's own: the offsets run on after it
    plain = echo_logprobs(token_text, text, ids, entries[1:], [])
    assert plain["text_offset"] == offsets


def test_openais_nullable_fields_sent_as_null_mean_their_default(client, decode, tokenizer):
    """Clients that send every field (or proxies passing nulls through) send null for OpenAI's
    "boolean or null" fields: chat `logprobs`, completions `echo`, `stream_options.include_usage`."""
    decode.script = reply_script(tokenizer, REPLY)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"logprobs": None})
    assert chat.choices[0].message.content == REPLY and chat.choices[0].logprobs is None
    completion = client.completions.create(model="tiny", prompt="Hi", extra_body={"echo": None})
    assert completion.choices[0].text == REPLY
    chunks = list(client.completions.create(model="tiny", prompt="Hi", stream=True,
                                            stream_options={"include_usage": None}))
    assert all(chunk.usage is None for chunk in chunks)


def test_top_p_0_is_greedy(client, decode, tokenizer):
    """OpenAI's top_p range is [0, 1]; 0 (sent for determinism) keeps the most likely token only."""
    decode.script = reply_script(tokenizer, REPLY)
    out = client.completions.create(model="tiny", prompt="Hi", top_p=0, temperature=1.0)
    assert out.choices[0].text == REPLY
    sampling = decode.requests[-1].sampling
    assert sampling.top_k == 1 and sampling.top_p == 1.0


def test_echo_with_max_tokens_0_counts_no_completion_tokens_streamed_or_not(client, decode, tokenizer):
    """echo + max_tokens 0 asks for the prompt's logprobs only: the one token generated for it is
    not returned, and the streamed usage does not count it either (it did, once per choice)."""
    decode.script = reply_script(tokenizer, REPLY)
    whole = client.completions.create(model="tiny", prompt="Once upon", echo=True, max_tokens=0)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon", echo=True, max_tokens=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 0
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text == "Once upon"


def test_streamed_completion_offsets_equal_the_whole_bodys_when_text_is_held(tokenizer):
    """Text held back (a possible stop string's start, half a UTF-8 character) sends its tokens'
    logprobs before their text: their offsets still run on, as in the whole body."""
    import asyncio
    from types import SimpleNamespace

    import wire
    from engine.sampling_params import SamplingParams
    from router.logprobs import TokenText
    from router.streaming import ChoiceStream, OutputAssembler, ResponseContext, collect, sse_events
    messages = wire.messages()
    ids = tokenizer.encode("a\nb c\U0001f389d e", add_special_tokens=False)
    prompt = tokenizer.encode("Hi")

    async def run(stream):
        chunks = [messages.TokenChunk(token_ids=[t], logprobs=[messages.TokenLogprob(token_id=t, logprob=-0.5)],
                                      finish_reason="length" if i == len(ids) - 1 else "")
                  for i, t in enumerate(ids)]
        generation = SimpleNamespace(next_chunk=None, abort=lambda: None, close=lambda *a: None)
        rest = iter(chunks[1:])

        async def next_chunk():
            return next(rest, None)
        generation.next_chunk = next_chunk
        params = SamplingParams(max_tokens=len(ids), stop=["\n\n"], logprobs=0)
        choice = ChoiceStream(0, generation, OutputAssembler(tokenizer, prompt, params), chunks[0])
        ctx = ResponseContext("completions", "id", "m", 0, TokenText(tokenizer), want_logprobs=True)
        if not stream:
            body = (await collect(ctx, [choice]))["choices"][0]
            return body["logprobs"]["text_offset"], body["logprobs"]["tokens"], body["text"]
        offsets = []
        async for line in sse_events(ctx, [choice]):
            if line.startswith("data: {"):
                logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                offsets += logprobs["text_offset"] if logprobs else []
        return offsets

    whole, tokens, text = asyncio.run(run(False))
    assert len(whole) == len(ids) and whole == sorted(whole)  # one per token, never backwards
    # each offset indexes the returned text: a whole token's text is there; the tokens of a
    # character split across them all start at that character
    for offset, token in zip(whole, tokens):
        assert text[offset:].startswith(token) or ("\ufffd" in token and text[offset] == "\U0001f389")
    assert asyncio.run(run(True)) == whole


def test_sentencepiece_token_text_keeps_the_space_its_metaspace_stands_for():
    """Llama-2-style tokenizers: the piece "▁World" is " World" in logprobs (decoding it alone
    would strip the space), so offsets index the text and `bytes` are the token's own."""
    from types import SimpleNamespace

    from transformers import PreTrainedTokenizerFast

    from engine.tokenizer import Tokenizer
    from router.logprobs import TokenText, chat_logprobs, completion_logprobs
    from tests.engine.test_detokenizer import ByteFallbackTokenizer
    tokenizer = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=ByteFallbackTokenizer().raw), source="test")
    text = "Hello World é"
    ids = tokenizer.encode(text, add_special_tokens=False)
    entries = [SimpleNamespace(token_id=token_id, logprob=-1.0, top=[]) for token_id in ids]
    token_text = TokenText(tokenizer)
    logprobs = completion_logprobs(token_text, entries, 0)
    assert "".join(logprobs["tokens"]) == " " + text  # the first word's metaspace too
    assert "" not in logprobs["tokens"]
    assert b"".join(bytes(item["bytes"]) for item in chat_logprobs(token_text, entries)["content"]) == \
        (" " + text).encode()
