"""The serving benchmark (benchmarks/serve.py) and its workloads.

Fast tests: workload shapes and determinism, config validation, percentiles, and the stream
parser against canned SSE bodies (httpx.MockTransport). The `slow` test runs every workload
against a live pdserve (a prefill worker, a decode worker and the router as subprocesses on the
default model) and checks that every metric is present and consistent with the server's usage.
"""
import asyncio
import json
import math
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.serve import (SLO, BenchConfig, RequestResult, RunOutcome, arrival_offsets, build_report, distribution,
                              format_report, percentile, run_benchmark, send_request, summarize)
from benchmarks.workloads import (COMMON_WORDS, Conversation, Turn, Workload, WorkloadConfig, build_workload,
                                  estimated_prompt_tokens, max_prompt_words)
from tests.helpers import free_port
from tests.router.processes import Process, grpc_address, start_router

REPO = Path(__file__).resolve().parents[2]


# ---- workloads ----------------------------------------------------------------------------------

def test_random_workload_has_fixed_sizes_and_is_seeded():
    config = WorkloadConfig(input_len=40, output_len=7)
    first = build_workload("random", 5, config, seed=3)
    again = build_workload("random", 5, config, seed=3)
    other = build_workload("random", 5, config, seed=4)
    assert first.num_requests == 5
    texts = [c.turns[0].content for c in first.conversations]
    assert texts == [c.turns[0].content for c in again.conversations]
    assert texts != [c.turns[0].content for c in other.conversations]
    for conversation in first.conversations:
        (turn,) = conversation.turns
        words = turn.content.split()
        assert len(words) == 40 and turn.max_tokens == 7
        assert all(w.rstrip(".").lower() in COMMON_WORDS for w in words)


def test_chat_lengths_are_clipped_to_the_context():
    config = WorkloadConfig(max_model_len=256, chat_input_median=200, chat_input_sigma=2.0, chat_input_max=1024,
                            chat_output_median=64, chat_output_sigma=2.0, chat_output_max=100)
    workload = build_workload("chat", 200, config, seed=0)
    inputs = [c.turns[0].approx_new_tokens for c in workload.conversations]
    outputs = [c.turns[0].max_tokens for c in workload.conversations]
    assert all(4 <= o <= 100 for o in outputs) and len(set(outputs)) > 10
    assert all(8 <= i and estimated_prompt_tokens(i) + o <= 256 for i, o in zip(inputs, outputs))
    assert all(len(c.turns[0].content.split()) == i for c, i in zip(workload.conversations, inputs))


def test_interference_mixes_one_long_prompt_per_period():
    config = WorkloadConfig(short_input_len=10, short_output_len=5, long_input_len=300, long_output_len=2,
                            long_every=4)
    workload = build_workload("interference", 12, config)
    tags = [c.turns[0].tag for c in workload.conversations]
    assert tags == ["short", "short", "long", "short"] * 3
    for conversation in workload.conversations:
        turn = conversation.turns[0]
        assert (len(turn.content.split()), turn.max_tokens) == ((300, 2) if turn.tag == "long" else (10, 5))


def test_agent_conversations_share_the_system_prompt_and_think_between_turns():
    config = WorkloadConfig(agent_turns=4, agent_system_tokens=300, agent_tool_result_tokens=20,
                            agent_reply_tokens=6, agent_think_time_s=2.0)
    workload = build_workload("agent", 9, config, seed=1)
    assert len(workload.conversations) == 2 and workload.num_requests == 8  # whole conversations only
    systems = {c.system_prompt for c in workload.conversations}
    assert len(systems) == 1 and '"name": "read_file"' in systems.pop()
    for conversation in workload.conversations:
        assert [t.tag for t in conversation.turns] == ["turn0", "turn1", "turn2", "turn3"]
        assert conversation.turns[0].think_time_s == 0 and all(t.think_time_s > 0 for t in conversation.turns[1:])
        assert all(t.max_tokens == 6 and "Tool result of call" in t.content for t in conversation.turns)
    private = build_workload("agent", 8, WorkloadConfig(agent_turns=4, agent_shared_system_prompt=False))
    assert private.conversations[0].system_prompt != private.conversations[1].system_prompt


def test_copying_workloads_hold_what_the_answer_repeats():
    """code_edit: a Python function (it compiles) and a variable of it to rename; json_echo: a JSON
    record (it parses) with the field to change. Seeded like the others."""
    import ast
    import json
    import re
    code_edit = build_workload("code_edit", 4, WorkloadConfig(edit_output_len=100), seed=2)
    assert code_edit.num_requests == 4 and code_edit.conversations == build_workload(
        "code_edit", 4, WorkloadConfig(edit_output_len=100), seed=2).conversations
    for conversation in code_edit.conversations:
        turn = conversation.turns[0]
        old = re.match(r"Rename the variable `(\w+)` to `(\w+)`", turn.content).group(1)
        code = turn.content.split("```python\n", 1)[1].rsplit("```", 1)[0]
        tree = ast.parse(code)
        assert old in {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | {
            arg.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for arg in node.args.args}
        assert turn.max_tokens == 100 and turn.tag == "code_edit"
    for conversation in build_workload("json_echo", 3, seed=5).conversations:
        record = json.loads(conversation.turns[0].content.split("\n\n", 1)[1])
        assert record["status"] == "active" and conversation.turns[0].max_tokens == WorkloadConfig().json_output_len


@pytest.mark.parametrize("kwargs, message", [
    ({"input_len": 0}, "input_len must be a positive integer"),
    ({"long_every": 1}, "long_every must be >= 2"),
    ({"agent_think_time_s": -1.0}, "agent_think_time_s must be >= 0"),
])
def test_workload_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(**kwargs)


def test_workload_that_does_not_fit_the_context():
    config = WorkloadConfig(max_model_len=512, long_input_len=1000)
    with pytest.raises(ValueError, match=r"long_input_len \+ long_output_len is up to about 1202 tokens \(1000 words "
                                         r"of prompt at 1.15 tokens each plus 48 for the chat template, 4 out\), "
                                         r"more than the context allows \(max_model_len 512\)"):
        build_workload("interference", 4, config)
    assert build_workload("random", 1, config).num_requests == 1  # only the built workload must fit
    with pytest.raises(ValueError, match="the agent's last turn"):
        build_workload("agent", 6, WorkloadConfig(max_model_len=1024))


def test_prompt_token_estimate_is_an_upper_bound():
    """Measured with SmolLM2's tokenizer and chat template: 1536 words of TextMaker text are 1708-1710
    tokens, 64 words 100-101, 8 words 39-40. The estimate is above all of them, and pure."""
    for words, measured in ((1536, 1710), (64, 101), (8, 40), (0, 30)):
        assert estimated_prompt_tokens(words) >= measured
    assert estimated_prompt_tokens(1536) == estimated_prompt_tokens(1536) == 1815
    for tokens in (0, 47, 48, 49, 100, 1000, 2048):
        words = max_prompt_words(tokens)
        assert estimated_prompt_tokens(words) <= tokens or words == 0
        assert estimated_prompt_tokens(words + 1) > tokens


def test_a_workload_a_little_too_long_is_refused_before_sending():
    """The default interference workload's long prompt (1536 words, 1708 tokens with the template,
    plus 4 out) does not fit a 1700-token context: refused when the workload is built. The old
    check (1540 <= 1700 - 32) let it through, and the server refused every long request."""
    with pytest.raises(ValueError, match="long_input_len"):
        build_workload("interference", 8, WorkloadConfig(max_model_len=1700))
    assert build_workload("interference", 8, WorkloadConfig(max_model_len=1819)).num_requests == 8
    with pytest.raises(ValueError, match="input_len"):
        build_workload("random", 1, WorkloadConfig(max_model_len=160, input_len=100, output_len=8))


def test_unknown_workload_and_bad_count():
    with pytest.raises(ValueError, match="unknown workload 'sharegpt'; choose one of random, chat"):
        build_workload("sharegpt", 3)
    with pytest.raises(ValueError, match="num_requests must be a positive integer"):
        build_workload("chat", 0)


# ---- configuration, statistics ------------------------------------------------------------------

def test_slo_parsing():
    assert SLO.parse(["ttft:500", "tpot:50"]) == SLO(ttft_ms=500.0, tpot_ms=50.0)
    assert not SLO.parse(None).is_set
    with pytest.raises(ValueError, match="--slo takes ttft:MS and/or tpot:MS, got 'e2e:5'"):
        SLO.parse(["e2e:5"])
    with pytest.raises(ValueError, match="'fast' is not a number"):
        SLO.parse(["ttft:fast"])
    with pytest.raises(ValueError, match="SLO tpot_ms must be a positive number"):
        SLO(tpot_ms=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"base_url": "localhost:8000"}, "--base-url must start with http"),
    ({"request_rate": 0.0}, "--request-rate must be > 0"),
    ({"max_concurrency": 0}, "--max-concurrency must be >= 1"),
    ({"endpoint": "embeddings"}, "--endpoint must be one of chat, completions"),
    ({"timeout_s": 0}, "--timeout must be > 0"),
])
def test_bench_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**{"base_url": "http://127.0.0.1:1", **kwargs})


def test_api_root_adds_v1_once():
    assert BenchConfig(base_url="http://h:1").api_root == "http://h:1/v1"
    assert BenchConfig(base_url="http://h:1/v1/").api_root == "http://h:1/v1"


def test_percentiles_and_distribution():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 99.9) == pytest.approx(99.901)
    d = distribution([0.001, 0.003, 0.002])  # seconds in, milliseconds out
    assert d == {"mean": pytest.approx(2.0), "median": pytest.approx(2.0), "p90": pytest.approx(2.8),
                 "p99": pytest.approx(2.98), "p99.9": pytest.approx(2.998), "max": pytest.approx(3.0),
                 "count": 3}
    assert distribution([])["median"] is None


def test_poisson_arrivals():
    assert arrival_offsets(4, math.inf, random.Random(0)) == [0.0] * 4
    offsets = arrival_offsets(4000, 8.0, random.Random(0))
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] / 3999 == pytest.approx(1 / 8.0, rel=0.05)
    assert offsets == arrival_offsets(4000, 8.0, random.Random(0))


def test_summary_counts_goodput_against_the_slo():
    def done(ttft, e2e, tokens):
        return RequestResult(0, 0, "x", 0.0, success=True, ttft_s=ttft, e2e_s=e2e, completion_tokens=tokens,
                             prompt_tokens=10, cached_tokens=4, itl_s=[(e2e - ttft) / (tokens - 1)] * (tokens - 1))
    results = [done(0.1, 1.1, 11), done(0.5, 0.9, 5), done(0.1, 2.1, 5),
               RequestResult(0, 0, "x", 0.0, error="HTTP 500: boom")]
    s = summarize(results, 10.0, SLO(ttft_ms=200, tpot_ms=200))
    # tpot: 100 ms, 100 ms, 500 ms; only the first meets both bounds
    assert s["completed"] == 3 and s["errors"] == 1 and s["error_messages"] == ["HTTP 500: boom"]
    assert s["goodput"] == pytest.approx(0.1) and s["request_throughput"] == pytest.approx(0.3)
    assert s["output_tokens"] == 21 and s["input_tokens"] == 30 and s["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert s["tpot_ms"]["median"] == pytest.approx(100.0) and s["itl_ms"]["count"] == 10 + 4 + 4


def test_cached_tokens_not_reported_are_unknown_not_zero():
    """A server that reports no cached tokens has an unknown prefix-cache hit rate: None in the
    summary and '-' in the table, not 0%; the hit rate counts only the requests that report them."""
    def done(prompt, cached):
        return RequestResult(0, 0, "x", 0.0, success=True, ttft_s=0.1, e2e_s=0.2, completion_tokens=2,
                             prompt_tokens=prompt, cached_tokens=cached, itl_s=[0.1])
    silent = summarize([done(10, None), done(30, None)], 1.0, SLO())
    assert silent["cached_tokens"] is None and silent["prefix_cache_hit_rate"] is None
    assert silent["input_tokens"] == 40
    mixed = summarize([done(10, None), done(30, 15), done(10, 0)], 1.0, SLO())
    assert mixed["cached_tokens"] == 15 and mixed["prefix_cache_hit_rate"] == pytest.approx(15 / 40)
    workload = Workload("random", [Conversation(0, [Turn("hi", 2, 1)])], "one request")
    report = build_report(BenchConfig(base_url="http://h:1"), workload,
                          RunOutcome([done(10, None)], 1.0, "m", None))
    table = format_report(report)
    assert "Input tokens (cached):" in table and "10 (-)" in table
    assert re.search(r"Prefix cache hit rate:\s+-\n", table)
    reported = format_report(build_report(BenchConfig(base_url="http://h:1"), workload,
                                          RunOutcome([done(10, 4)], 1.0, "m", None)))
    assert "10 (4)" in reported and re.search(r"Prefix cache hit rate:\s+40.0%", reported)


# ---- the stream parser --------------------------------------------------------------------------

def _sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _chat_chunk(text, tokens, finish=None):
    logprobs = {"content": [{"token": "t", "logprob": -0.1}] * tokens} if tokens else None
    return {"choices": [{"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18,
                                  "prompt_tokens_details": {"cached_tokens": 8}}}


def _send(body: bytes, status: int = 200, endpoint: str = "chat") -> RequestResult:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["payload"] = json.loads(request.content)
        seen["url"] = str(request.url)
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        config = BenchConfig(base_url="http://bench.test", api_key="k", endpoint=endpoint)
        result = RequestResult(0, 0, "t", 0.0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            from benchmarks.serve import build_payload
            payload = build_payload(config, "m", [{"role": "user", "content": "hi"}], 6)
            await send_request(client, config, payload, result, time.perf_counter())
        return result
    result = asyncio.run(go())
    result.seen = seen
    return result


def test_multi_token_chunks_give_one_itl_per_token_after_the_first():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    body = _sse(role, _chat_chunk("ab", 2), _chat_chunk("", 1), _chat_chunk("cde", 3, "length"), USAGE, "[DONE]")
    result = _send(body)
    assert result.success and result.error == ""
    assert result.streamed_tokens == 6 == result.completion_tokens
    assert len(result.itl_s) == 5 and result.itl_s[0] == 0.0  # the 2nd token came with the first
    assert (result.prompt_tokens, result.cached_tokens, result.finish_reason) == (12, 8, "length")
    assert result.text == "abcde" and 0 <= result.ttft_s <= result.e2e_s
    seen = result.seen
    assert seen["url"] == "http://bench.test/v1/chat/completions" and seen["auth"] == "Bearer k"
    assert seen["payload"]["stream_options"] == {"include_usage": True} and seen["payload"]["ignore_eos"] is True
    assert seen["payload"]["logprobs"] is True and seen["payload"]["max_tokens"] == 6


def test_completions_endpoint_counts_logprob_tokens():
    chunk = {"choices": [{"index": 0, "text": " x y", "logprobs": {"tokens": [" x", " y"]}, "finish_reason": None}]}
    result = _send(_sse(chunk, chunk, chunk, USAGE, "[DONE]"), endpoint="completions")
    assert result.success and result.streamed_tokens == 6 and len(result.itl_s) == 5
    assert result.seen["url"].endswith("/v1/completions") and result.seen["payload"]["logprobs"] == 0
    assert result.seen["payload"]["prompt"] == "User: hi\n\nAssistant:"


@pytest.mark.parametrize("body, status, message", [
    (json.dumps({"error": {"message": "prompt too long", "type": "invalid_request_error"}}).encode(), 400,
     "HTTP 400: prompt too long"),
    (_sse(_chat_chunk("a", 1), {"error": {"message": "worker died"}}, "[DONE]"), 200,
     "stream error: worker died"),
    (_sse(_chat_chunk("a", 1)), 200, "the stream ended without [DONE]"),
    (_sse(USAGE, "[DONE]"), 200, "the stream carried no token"),
])
def test_failed_requests_carry_a_clear_error(body, status, message):
    result = _send(body, status)
    assert not result.success and result.error == message


def test_usage_without_cached_tokens_leaves_them_unknown():
    usage = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}
    result = _send(_sse(_chat_chunk("a", 1, "length"), usage, "[DONE]"))
    assert result.success and result.prompt_tokens == 12 and result.cached_tokens is None
    zero = {"choices": [], "usage": {**usage["usage"], "prompt_tokens_details": {"cached_tokens": 0}}}
    assert _send(_sse(_chat_chunk("a", 1, "length"), zero, "[DONE]")).cached_tokens == 0


@pytest.mark.parametrize("python_3_10", [False, True], ids=["asyncio.timeout", "no asyncio.timeout"])
def test_request_timeout_without_asyncio_timeout(monkeypatch, python_3_10):
    """--request-timeout ends a stream that stalls, also on Python 3.10 (no asyncio.timeout there;
    pyproject allows 3.10)."""
    if python_3_10:
        monkeypatch.delattr(asyncio, "timeout", raising=False)

    async def stalled_body():
        yield _sse(_chat_chunk("a", 1))
        await asyncio.sleep(30)
        yield _sse("[DONE]")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=stalled_body(), headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        config = BenchConfig(base_url="http://bench.test", request_timeout_s=0.2)
        result = RequestResult(0, 0, "t", 0.0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            from benchmarks.serve import build_payload
            payload = build_payload(config, "m", [{"role": "user", "content": "hi"}], 6)
            await send_request(client, config, payload, result, time.perf_counter())
        return result
    started = time.perf_counter()
    result = asyncio.run(go())
    assert time.perf_counter() - started < 10
    assert not result.success and result.error == "no complete response within --request-timeout 0.2 s"
    assert result.ttft_s is not None and result.streamed_tokens == 1  # what came before the stall is kept


# ---- whole runs against a mock server ------------------------------------------------------------

class MockSSEServer:
    """A tiny OpenAI-compatible server in a thread: /v1/models lists `mock`; /v1/chat/completions
    streams max_tokens one-token chunks (with logprobs), `token_delay_s` apart, then usage and
    [DONE]; `fail(payload)` true answers HTTP 500 instead."""

    def __init__(self, token_delay_s: float = 0.0, fail=lambda payload: False) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(200, json.dumps({"data": [{"id": "mock", "max_model_len": 4096}]}).encode())

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.payloads.append(payload)
                if server.fail(payload):
                    self._send(500, json.dumps({"error": {"message": "mock failure"}}).encode())
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for index in range(payload["max_tokens"]):
                        time.sleep(server.token_delay_s)
                        finish = "length" if index == payload["max_tokens"] - 1 else None
                        self.wfile.write(_sse(_chat_chunk("w ", 1, finish)))
                        self.wfile.flush()
                    usage = {"prompt_tokens": 20, "completion_tokens": payload["max_tokens"]}
                    self.wfile.write(_sse({"choices": [], "usage": usage}, "[DONE]"))
                except OSError:  # the client gave up (--timeout)
                    pass

        self.token_delay_s = token_delay_s
        self.fail = fail
        self.payloads: list[dict] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        import threading
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def mock_server():
    servers: list[MockSSEServer] = []

    def start(**kwargs) -> MockSSEServer:
        servers.append(MockSSEServer(**kwargs))
        return servers[-1]
    yield start
    for server in servers:
        server.close()


def test_timeout_run_reports_every_planned_request(mock_server, tmp_path, capsys):
    """`--timeout` before later arrivals: the requests never sent are in the report (not sent, with
    the reason), the counts add up to --num-requests, and the exit status is 1."""
    from benchmarks.serve import NOT_SENT_BEFORE_TIMEOUT, main
    server = mock_server()
    offsets = arrival_offsets(4, 0.5, random.Random(0))  # the run's arrivals (seed 0)
    assert offsets[0] == 0 and min(offsets[1:]) > 0.6
    out = tmp_path / "bench.json"
    status = main(["--base-url", server.url, "--workload", "random", "--num-requests", "4", "--request-rate", "0.5",
                   "--timeout", f"{min(offsets[1:]) / 2:.3f}", "--input-len", "8", "--output-len", "3",
                   "--no-progress", "--json", str(out)])
    assert status == 1
    report = json.loads(out.read_text())
    s = report["summary"]
    assert report["num_requests"] == s["requests"] == len(report["requests"]) == 4
    assert (s["completed"], s["errors"], s["incomplete"], s["not_sent"]) == (1, 0, 3, 3)
    assert s["incomplete_reasons"] == {NOT_SENT_BEFORE_TIMEOUT: 3}
    assert sorted((r["conversation_id"], r["turn"]) for r in report["requests"]) == [(i, 0) for i in range(4)]
    first, *rest = report["requests"]
    assert first["success"] and first["sent"] and first["sent_at_s"] is not None
    assert all(not r["sent"] and r["sent_at_s"] is None and r["incomplete"] and r["error"] == NOT_SENT_BEFORE_TIMEOUT
               for r in rest)
    assert len(server.payloads) == 1
    table = capsys.readouterr().out
    assert re.search(r"Requests planned:\s+4\n", table) and re.search(r"Unfinished or not sent:\s+3\n", table)
    assert re.search(r"  not sent before --timeout ended the run:\s+3\n", table)


def test_timeout_tells_unfinished_from_not_sent(mock_server):
    """With --max-concurrency 1 and slow streams, --timeout finds one request streaming (unfinished)
    and the rest waiting for a slot (not sent)."""
    from benchmarks.serve import NOT_SENT_BEFORE_TIMEOUT, UNFINISHED_AT_TIMEOUT
    server = mock_server(token_delay_s=0.5)
    config = BenchConfig(base_url=server.url, max_concurrency=1, timeout_s=0.5, show_progress=False)
    report = run_benchmark(config, "random", 3, {"input_len": 8, "output_len": 4})
    s = report["summary"]
    assert (s["requests"], s["completed"], s["errors"], s["incomplete"], s["not_sent"]) == (3, 0, 0, 3, 2)
    assert s["incomplete_reasons"] == {NOT_SENT_BEFORE_TIMEOUT: 2, UNFINISHED_AT_TIMEOUT: 1}
    assert [r["sent"] for r in report["requests"]].count(True) == 1


def test_failed_agent_turn_reports_the_turns_not_sent(mock_server):
    """A failed turn ends its conversation; its later turns are in the report as not sent."""
    from benchmarks.serve import EARLIER_TURN_FAILED

    def fail(payload):  # conversation 0's second turn (system, user, assistant, user)
        messages = payload["messages"]
        return len(messages) == 4 and messages[1]["content"].startswith("Task 0:")
    server = mock_server(fail=fail)
    config = BenchConfig(base_url=server.url, show_progress=False)
    options = {"agent_turns": 3, "agent_system_tokens": 64, "agent_tool_result_tokens": 8, "agent_reply_tokens": 2,
               "agent_think_time_s": 0.0}
    report = run_benchmark(config, "agent", 6, options)
    assert len(report["requests"]) == 6
    s = report["summary"]
    assert (s["requests"], s["completed"], s["errors"], s["incomplete"], s["not_sent"]) == (6, 4, 1, 1, 1)
    assert s["incomplete_reasons"] == {EARLIER_TURN_FAILED: 1} and s["error_messages"] == ["HTTP 500: mock failure"]
    rows = {(r["conversation_id"], r["turn"]): r for r in report["requests"]}
    assert len(rows) == 6 and len(server.payloads) == 5
    assert rows[0, 1]["error"] == "HTTP 500: mock failure" and rows[0, 1]["sent"]
    assert not rows[0, 2]["sent"] and rows[0, 2]["incomplete"] and rows[0, 2]["error"] == EARLIER_TURN_FAILED
    assert all(rows[1, turn]["success"] for turn in range(3))
    assert report["by_tag"]["turn2"]["incomplete"] == 1


# ---- against a live pdserve ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def live_pdserve():
    processes: list[Process] = []
    try:
        worker_args = ["--model", "default", "--port", "0", "--num-blocks", "512"]
        processes += [Process(["-m", "prefill_worker", *worker_args]),
                      Process(["-m", "decode_worker", *worker_args, "--local-prefill-threshold", "32"])]
        prefill, decode = (grpc_address(p) for p in processes)
        router, url = start_router("--model", "default", "--prefill", prefill, "--decode", decode)
        processes.append(router)
        yield url
    finally:
        for process in reversed(processes):
            process.stop()
        assert all(p.popen.poll() is not None for p in processes)


TINY = {"input_len": 24, "output_len": 6, "chat_input_median": 24, "chat_output_median": 6, "chat_output_max": 10,
        "short_input_len": 16, "short_output_len": 6, "long_input_len": 200, "long_output_len": 3, "long_every": 3,
        "agent_turns": 3, "agent_system_tokens": 160, "agent_tool_result_tokens": 40, "agent_reply_tokens": 4,
        "agent_think_time_s": 0.05}


def _check_report(report: dict, expected_requests: int) -> None:
    s = report["summary"]
    assert (s["completed"], s["errors"], s["incomplete"]) == (expected_requests, 0, 0), s["error_messages"]
    assert report["model"] == "default" and len(report["requests"]) == expected_requests
    for r in report["requests"]:
        assert r["success"] and r["error"] == ""
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert r["streamed_tokens"] == r["completion_tokens"] > 0  # the stream's tokens are usage's
        assert len(r["itl_ms"]) == r["completion_tokens"] - 1 and all(g >= 0 for g in r["itl_ms"])
        assert r["ttft_ms"] + sum(r["itl_ms"]) <= r["e2e_ms"] + 1e-3
        assert r["finish_reason"] == "length"  # ignore_eos: every request runs to max_tokens
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"]
        if r["completion_tokens"] > 1:
            assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / (r["completion_tokens"] - 1), abs=0.01)
    assert s["output_tokens"] == sum(r["completion_tokens"] for r in report["requests"])
    assert s["input_tokens"] == sum(r["prompt_tokens"] for r in report["requests"])
    assert 0 <= s["goodput"] <= s["request_throughput"] > 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[metric]
        assert 0 <= d["median"] <= d["p90"] <= d["p99"] <= d["p99.9"] <= d["max"], metric
    assert s["ttft_ms"]["max"] <= s["e2e_ms"]["max"]


@pytest.mark.slow
@pytest.mark.parametrize("workload, num_requests, rate, concurrency, expected", [
    ("random", 3, math.inf, 2, 3),
    ("chat", 3, 4.0, None, 3),
    ("interference", 4, math.inf, 2, 4),
    ("agent", 6, 2.0, None, 6),
])
def test_every_workload_against_live_pdserve(live_pdserve, workload, num_requests, rate, concurrency, expected):
    config = BenchConfig(base_url=live_pdserve, request_rate=rate, max_concurrency=concurrency,
                         slo=SLO(ttft_ms=60_000, tpot_ms=60_000), show_progress=False, request_timeout_s=300)
    report = run_benchmark(config, workload, num_requests, TINY)
    _check_report(report, expected)
    rows = report["requests"]
    if workload == "random":
        assert all(r["completion_tokens"] == 6 for r in rows)
        assert report["summary"]["goodput"] == report["summary"]["request_throughput"]  # generous SLO: all good
    if workload == "interference":
        long_rows = [r for r in rows if r["tag"] == "long"]
        assert len(long_rows) == 1 and long_rows[0]["completion_tokens"] == 3
        assert long_rows[0]["prompt_tokens"] > 200 > max(r["prompt_tokens"] for r in rows if r["tag"] == "short")
        assert set(report["by_tag"]) == {"long", "short"}
    if workload == "agent":
        for conversation in (0, 1):
            turns = sorted((r for r in rows if r["conversation_id"] == conversation), key=lambda r: r["turn"])
            assert [r["turn"] for r in turns] == [0, 1, 2]
            # every turn resends the history plus a tool result, and finds the earlier turns cached
            assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]
            assert all(r["cached_tokens"] >= 160 for r in turns[1:])
            assert all(later["sent_at_s"] >= earlier["sent_at_s"] + earlier["e2e_ms"] / 1000
                       for earlier, later in zip(turns, turns[1:]))


@pytest.mark.slow
def test_pdserve_bench_command_prints_the_table_and_writes_json(live_pdserve, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "deploy", "bench", "--base-url", live_pdserve + "/v1",
                           "--workload", "random", "--num-requests", "2", "--input-len", "16", "--output-len", "4",
                           "--endpoint", "completions", "--slo", "ttft:60000", "tpot:60000", "--json", str(out),
                           "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Successful requests:" in proc.stdout and "Goodput (req/s, ttft <= 60000 ms, tpot <= 60000 ms)" \
        in proc.stdout
    report = json.loads(out.read_text())
    assert report["endpoint"] == "completions"
    _check_report(report, 2)
    assert all(r["completion_tokens"] == 4 for r in report["requests"])


@pytest.mark.slow
def test_bench_command_reports_an_unreachable_server():
    port = free_port()
    proc = subprocess.run([sys.executable, "benchmarks/serve.py", "--base-url", f"http://127.0.0.1:{port}",
                           "--num-requests", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"pdserve bench: error: cannot reach http://127.0.0.1:{port}/v1/models: ConnectError" in proc.stderr
