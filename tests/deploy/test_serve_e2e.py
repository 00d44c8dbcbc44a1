"""`pdserve serve` as a user runs it (a subprocess: local Ray, default model, CPU, 1 prefill + 1
decode), driven by the official `openai` client and the `pdserve scale/status` commands:

- greedy completions equal the offline engine's (`engine.LLM`);
- the decode pool goes 1 -> 2 -> 1 while a stream runs on the worker that is drained: the stream
  completes with the offline engine's tokens, and the drain ends only after it;
- a killed worker process: its stream ends with a clear error, the pool is back at size with a
  new worker (`pdserve status`), and requests are served again;
- SIGINT stops everything: no process of the cluster is left.
"""
import os
import signal
import time

import httpx
import openai
import pytest

from tests.deploy.harness import (Stream, cluster_fixtures, offline_text, ready_workers,
                                  stop_and_check_nothing_is_left, wait_until)

pytestmark = pytest.mark.slow

NUM_BLOCKS = 256
PLAIN = "The quick brown fox"
STORY = "Once upon a time, in a small village at the edge of a forest, there lived"
LONG_STREAM_TOKENS = 600


serve, offline, client = cluster_fixtures(NUM_BLOCKS, "--prefill", "1", "--decode", "1")


def router_workers(serve) -> list[dict]:
    return httpx.get(serve.url + "/status", timeout=30).json()["workers"]


def test_greedy_completions_match_the_offline_engine(serve, client, offline):
    expected = offline_text(offline, PLAIN, 24)
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt=PLAIN, max_tokens=24, temperature=0, stream=True))
    assert streamed == expected
    prefill = [w for w in router_workers(serve) if w["role"] == "prefill"]
    assert len(prefill) == 1 and prefill[0]["kv_bytes_sent"] > 0  # disaggregated: KV came from the prefill worker
    status = serve.status()
    assert [len(ready_workers(status, r)) for r in ("prefill", "decode")] == [1, 1]
    assert status["routers"] == 1 and status["settled"]


def test_decode_pool_scales_up_and_down_while_a_stream_runs(serve, client, offline):
    [first] = ready_workers(serve.status(), "decode")
    stream = Stream(client, STORY, LONG_STREAM_TOKENS)
    assert stream.first.wait(300) and stream.error is None

    serve.cli("scale", "--decode", "2")  # waits until the new worker is ready
    status = serve.status()
    decode = ready_workers(status, "decode")
    assert len(decode) == 2 and first["address"] in {w["address"] for w in decode}
    second = next(w for w in decode if w["address"] != first["address"])
    assert not stream.done.is_set(), "the stream ended before the pool grew; make LONG_STREAM_TOKENS larger"
    # The new worker joins the router's pool (membership comes from the controller only).
    wait_until(lambda: any(w["address"] == second["address"] and w["healthy"] for w in router_workers(serve)),
               60, "the router to route to the new decode worker")

    drain_issued = time.monotonic()
    assert not stream.done.is_set(), "the stream ended before the drain began; make LONG_STREAM_TOKENS larger"
    serve.cli("scale", "--decode", "1", "--drain", first["address"])  # waits for the drain
    scaled_down = time.monotonic()
    assert stream.done.is_set() and stream.finished_at <= scaled_down  # the drain waited for the stream
    assert stream.finished_at > drain_issued
    assert stream.error is None, f"the stream failed: {stream.error!r}"
    assert stream.text == offline_text(offline, STORY, LONG_STREAM_TOKENS, ignore_eos=True)

    status = serve.status()
    assert [w["address"] for w in ready_workers(status, "decode")] == [second["address"]]
    assert any(f"{first['worker_id']} at {first['address']} stopping: drained" in e["message"]
               for e in status["events"])
    wait_until(lambda: first["address"] not in {w["address"] for w in router_workers(serve)}, 60,
               "the router to drop the drained worker")
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=24, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 24)


def test_a_killed_worker_ends_its_stream_with_an_error_and_is_replaced(serve, client, offline):
    [victim] = ready_workers(serve.status(), "decode")
    stream = Stream(client, STORY, LONG_STREAM_TOKENS)
    assert stream.first.wait(300) and stream.error is None
    os.kill(victim["pid"], signal.SIGKILL)
    assert stream.done.wait(120), "the stream on the killed worker never ended"
    assert isinstance(stream.error, openai.APIError)

    def replaced():
        status = serve.status()
        decode = ready_workers(status, "decode")
        return status if status["settled"] and len(decode) == 1 and decode[0]["pid"] != victim["pid"] else None
    status = wait_until(replaced, 600, "a replacement decode worker")
    [replacement] = ready_workers(status, "decode")
    assert replacement["address"] != victim["address"] and replacement["worker_id"] != victim["worker_id"]
    assert any(f"{victim['worker_id']} at {victim['address']} died" in e["message"] for e in status["events"])
    table = serve.cli("status").stdout
    assert replacement["worker_id"] in table and victim["worker_id"] not in table.split("targets:")[0]
    wait_until(lambda: httpx.get(serve.url + "/health", timeout=30).status_code == 200, 120, "/health")
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=24, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 24)


def test_sigint_stops_every_process_of_the_cluster(serve):
    stop_and_check_nothing_is_left(serve)
