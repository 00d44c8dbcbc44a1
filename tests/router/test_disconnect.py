"""A client that goes away cancels its Generate stream at once: the decode worker frees the
request's blocks (seen through /status) and the router's load counts return to zero."""
import socket

import httpx

from tests.helpers import wait_until
from tests.router.harness import Hang, reply_script


def free_blocks_in_status(router, decode):
    status = httpx.get(router.url + "/status").json()
    worker = next(w for w in status["workers"] if w["address"] == decode.address)
    return worker["kv_blocks_free"], worker["kv_blocks_total"], status["inflight_requests"]


def assert_ended(router, decode, request_id, finish_reason):
    """The worker saw the request cancelled, every block is free, nothing is in flight, and the
    router counted it as ended with `finish_reason`."""
    wait_until(lambda: request_id in decode.finished, timeout=30, what="the worker to see the cancellation")
    assert request_id in decode.cancelled
    free, total, inflight = free_blocks_in_status(router, decode)
    assert free == total and inflight == 0
    metrics = httpx.get(router.url + "/metrics").text
    assert f'pdserve:request_finished_total{{finish_reason="{finish_reason}"}} 1.0' in metrics


def hanging_script(tokenizer):
    """One token, then nothing until the request is cancelled or aborted."""
    first = reply_script(tokenizer, "Hello")
    return lambda request: [first(request)[0], Hang()]


def test_streaming_client_disconnect_frees_blocks(router, decode, tokenizer):
    decode.script = hanging_script(tokenizer)
    with httpx.stream("POST", router.url + "/v1/chat/completions",
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                            "max_tokens": 100}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the stream is open and a token came
        request_id = decode.requests[-1].request_id
        free, total, inflight = free_blocks_in_status(router, decode)
        assert free < total and inflight == 1  # the request holds blocks while it streams
    # leaving the `with` closes the connection mid-stream
    wait_until(lambda: request_id in decode.finished, timeout=30, what="the worker to see the cancellation")
    assert request_id in decode.cancelled
    assert free_blocks_in_status(router, decode) == (total, total, 0)
    decode_info = router.state.pool.get(decode.address)
    assert decode_info.inflight_requests == 0
    assert all(p.outstanding_prefill_tokens == 0 for p in router.state.pool.workers())


def test_non_streaming_client_disconnect_frees_blocks(router, decode, tokenizer):
    decode.script = hanging_script(tokenizer)
    try:
        httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 50},
                   timeout=httpx.Timeout(30.0, read=0.5))  # gives up while the worker hangs
    except httpx.ReadTimeout:
        pass
    wait_until(lambda: decode.requests and decode.requests[-1].request_id in decode.finished,
               timeout=30, what="the worker to see the cancellation")
    assert decode.requests[-1].request_id in decode.cancelled
    free, total, inflight = free_blocks_in_status(router, decode)
    assert free == total and inflight == 0


def test_disconnect_before_the_first_token_frees_blocks(router, decode):
    decode.script = lambda request: [Hang()]  # the "prefill" never finishes
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": true}'
    with socket.create_connection(("127.0.0.1", router.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: len(decode.active) == 1, timeout=30, what="the request to reach the worker")
        request_id = decode.requests[-1].request_id
    assert_ended(router, decode, request_id, "abort")


def test_a_failure_between_the_first_token_and_the_response_ends_the_request(router, decode, tokenizer, monkeypatch):
    """Anything that fails after the generations started (here, building the response context)
    gives the client a 500 and ends them: the worker's stream is cancelled and the admission slot
    comes back (else each such failure would hold one for good)."""
    import router.app as app_module

    def broken(*args, **kwargs):
        raise RuntimeError("response context broke")

    decode.script = hanging_script(tokenizer)
    monkeypatch.setattr(app_module, "ResponseContext", broken)
    response = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 50,
                                                                "stream": True}, timeout=30)
    assert response.status_code == 500
    assert_ended(router, decode, decode.requests[-1].request_id, "error")


def test_a_stream_whose_body_never_runs_still_ends_its_request():
    """The SSE response ends its request even when the server never iterates its body (the client
    went away before the first byte: sending the headers fails)."""
    import asyncio

    from router.app import _EventStream

    started, ended = [], []

    async def events():
        started.append(True)
        yield "data: never\n\n"

    async def send(message):
        raise OSError("connection reset")

    async def receive():
        return {"type": "http.disconnect"}

    async def scenario():
        response = _EventStream(events(), ended.append)
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
        try:
            await response(scope, receive, send)
        except Exception:
            pass  # starlette's ClientDisconnect
    asyncio.run(scenario())
    assert started == [] and ended == ["abort"]
