"""A decode worker failing mid-stream: the router resumes the generation on another worker from
the tokens already delivered (`num_resumed_tokens`), and the client's stream goes on as if
nothing happened. Fake workers over real gRPC; tests/workers/test_migration_e2e.py kills a real
worker process."""
import json

import grpc
import httpx
import pytest

from tests.router.harness import Fail, FakeDecodeWorker, Hang, token_chunks

REPLY = "the quick brown fox jumps over the lazy dog"


@pytest.fixture
def pair(loop):
    workers = [FakeDecodeWorker(loop, role="both").start(), FakeDecodeWorker(loop, role="both").start()]
    yield workers
    for worker in workers:
        worker.stop()


def continuing_script(tokenizer, fail_after: int | None, code=grpc.StatusCode.UNAVAILABLE):
    """Each worker streams the rest of REPLY (+ EOS) after the tokens it was told are delivered;
    a fresh request fails after `fail_after` tokens, as a worker that dies does."""
    reply = tokenizer.encode(REPLY, add_special_tokens=False) + [min(tokenizer.eos_token_ids)]

    def script(request):
        done = request.num_resumed_tokens
        prompt = list(request.prompt_token_ids)
        assert prompt[len(prompt) - done:] == reply[:done]  # resumed from exactly what was delivered
        chunks = token_chunks(reply[done:], "stop")
        if fail_after is not None and done == 0:
            if fail_after == len(chunks):  # dies after the last token, before its finish reason
                chunks[-1].finish_reason = ""
                return chunks
            return [*chunks[:fail_after], Fail(code, "Socket closed")]
        return chunks

    return script


def stream_completion(router, **body) -> tuple[str, dict, list[str]]:
    payload = {"model": "tiny", "prompt": "tell me", "max_tokens": 40, "stream": True,
               "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", router.url + "/v1/completions", json=payload, timeout=30) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    bodies = [json.loads(e) for e in events[:-1]]
    text = "".join(b["choices"][0]["text"] for b in bodies if b.get("choices"))
    finish = [b["choices"][0]["finish_reason"] for b in bodies if b.get("choices") and b["choices"][0]["finish_reason"]]
    usage = bodies[-1].get("usage") or {}
    return text, usage, finish


def migrations(router) -> float:
    text = httpx.get(router.url + "/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("pdserve:request_migrations_total"))
    return float(line.split()[-1])


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL])
def test_stream_goes_on_on_another_worker(make_router, pair, tokenizer, code):
    for worker in pair:
        worker.script = continuing_script(tokenizer, fail_after=3, code=code)
    router = make_router(colocated=[w.address for w in pair])
    text, usage, finish = stream_completion(router)
    assert text == REPLY and finish == ["stop"]
    reply_tokens = len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1
    assert usage["completion_tokens"] == reply_tokens
    first, second = sorted((r for w in pair for r in w.requests), key=lambda r: r.num_resumed_tokens)
    assert (first.num_resumed_tokens, second.num_resumed_tokens) == (0, 3)
    reply = tokenizer.encode(REPLY, add_special_tokens=False)
    assert list(second.prompt_token_ids) == list(first.prompt_token_ids) + reply[:3]
    assert usage["prompt_tokens"] == len(first.prompt_token_ids)  # the client's prompt, not the resumed one
    assert second.sampling == first.sampling  # max_tokens counts the resumed tokens on the worker
    assert migrations(router) == 1
    failed = next(w for w in pair if any(r.num_resumed_tokens == 0 for r in w.requests))
    assert failed.aborts == [first.request_id]  # told to free the request, should it still run
    assert router.state.dispatcher.inflight == 0


def test_non_streaming_response_is_whole(make_router, pair, tokenizer):
    for worker in pair:
        worker.script = continuing_script(tokenizer, fail_after=5)
    router = make_router(colocated=[w.address for w in pair])
    response = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "tell me", "max_tokens": 40})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == REPLY
    assert migrations(router) == 1


def test_a_stream_that_ends_without_its_finish_reason_is_resumed(make_router, pair, tokenizer):
    reply_tokens = len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1
    for worker in pair:
        worker.script = continuing_script(tokenizer, fail_after=4)
    router = make_router(colocated=[w.address for w in pair])
    text, _, finish = stream_completion(router)
    assert text == REPLY and finish == ["stop"] and migrations(router) == 1
    # Dying after the very last token allowed by max_tokens: nothing is left to generate.
    for worker in pair:
        worker.script = continuing_script(tokenizer, fail_after=reply_tokens)
    router2 = make_router(colocated=[w.address for w in pair])
    text, usage, finish = stream_completion(router2, max_tokens=reply_tokens, stream_options=None)
    assert finish == ["length"] and usage == {}


@pytest.mark.parametrize("taken_out_first", [False, True])
def test_a_hung_worker_is_detected_by_its_health_polls_and_left(make_router, pair, tokenizer, taken_out_first):
    """A worker that stops answering (polls time out) while its stream is silent: the stream is
    cut and the generation goes on elsewhere, instead of waiting forever. Also when the router
    had taken the worker out of routing before (`mark_unhealthy`: another of its streams broke),
    so that no poll flips it from healthy to unhealthy."""
    reply = tokenizer.encode(REPLY, add_special_tokens=False) + [min(tokenizer.eos_token_ids)]
    routers = []

    def script(request):
        done = request.num_resumed_tokens
        chunks = token_chunks(reply[done:], "stop")
        if done:
            return chunks
        for worker in pair:  # whichever got the request hangs after 3 tokens
            if request in worker.requests:
                worker.silent = True
                if taken_out_first:
                    routers[0].state.pool.mark_unhealthy(worker.address, "another stream broke")
        return [*chunks[:3], Hang()]

    for worker in pair:
        worker.script = script
    router = make_router(colocated=[w.address for w in pair], rpc_timeout_s=0.2, unhealthy_after_failures=2)
    routers.append(router)
    text, _, finish = stream_completion(router)
    assert text == REPLY and finish == ["stop"] and migrations(router) == 1
    hung = next(w for w in pair if w.silent)
    assert [r.num_resumed_tokens for r in hung.requests] == [0]
    hung.silent = False


def test_without_migrations_the_client_gets_an_error_event(make_router, pair, tokenizer):
    for worker in pair:
        worker.script = continuing_script(tokenizer, fail_after=3)
    router = make_router(colocated=[w.address for w in pair], max_migrations=0)
    with httpx.stream("POST", router.url + "/v1/completions",
                      json={"model": "tiny", "prompt": "tell me", "max_tokens": 40, "stream": True}) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert sum(len(w.requests) for w in pair) == 1


def test_when_every_worker_fails_the_error_reaches_the_client(make_router, pair, tokenizer):
    reply = tokenizer.encode(REPLY, add_special_tokens=False)
    for worker in pair:  # every attempt dies after one more token
        worker.script = lambda request: [*token_chunks(reply[request.num_resumed_tokens:][:1], ""),
                                         Fail(grpc.StatusCode.UNAVAILABLE, "Socket closed")]
    router = make_router(colocated=[w.address for w in pair])
    with httpx.stream("POST", router.url + "/v1/completions",
                      json={"model": "tiny", "prompt": "tell me", "max_tokens": 40, "stream": True}) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] in ("service_unavailable", "upstream_error")
    assert router.state.dispatcher.inflight == 0
