"""`pdserve serve` as a user runs it, and as an operator breaks it: one cluster (a subprocess:
local Ray, default model, CPU, 1 prefill + 2 decode workers, 2 routers) shared by the tests in
order, driven by the official `openai` client and the `pdserve scale/status` commands:

- greedy completions equal the offline engine's (`engine.LLM`), plain and streamed;
- SIGKILL of the controller while 12 streams run: every stream completes with the text of an
  undisturbed run, requests are served while it is away, and it is back (`pdserve status`
  answers) within 60 s with the same targets and workers (adopted, not relaunched); afterwards a
  killed decode worker is still replaced and scaling still works;
- 16 live streams on two decode workers, one drained: `pdserve scale` returns within 10 s and
  every stream ends with the undisturbed text;
- the decode pool goes 1 -> 2 -> 1 while a stream runs on the worker that is drained: the drain
  hands the stream over at once (`--drain-grace 0`), the router resumes it on the other worker,
  and it completes with the offline engine's tokens;
- a killed decode worker (the only one): its stream ends with a clear error, the pool is back at
  size with a new worker (`pdserve status`), and requests are served again;
- SIGKILL of a router process while 8 streams run: its streams end with a clean connection error,
  the other router's complete with the undisturbed text, requests sent while it is away are
  served, it is restarted on the same port and serves, and no KV block stays held on any worker;
- SIGINT stops everything, the restarted controller and router included: no process is left.
"""
import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.deploy.harness import (Stream, cluster_fixtures, offline_text, offline_texts, processes_inheriting,
                                  ready_workers, stop_and_check_nothing_is_left)
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

NUM_BLOCKS = 256
PLAIN = "The quick brown fox"
STORY = "Once upon a time, in a small village at the edge of a forest, there lived"
LONG_STREAM_TOKENS = 600
STREAM_TOKENS = 48
ROUTER_STREAM_TOKENS = 160

# --drain-grace 0: a drained worker hands its streams over at once, so the drain test sees it
# whatever the machine's speed (--drain-timeout: nor does the drain time out first).
serve, offline, client = cluster_fixtures(NUM_BLOCKS, "--prefill", "1", "--decode", "2", "--routers", "2",
                                          "--drain-timeout", "900", "--drain-grace", "0")


def router_workers(serve) -> list[dict]:
    """One router's view of the workers (whichever router takes the new connection)."""
    return httpx.get(serve.url + "/status", timeout=30).json()["workers"]


def controller_pids(serve) -> list[int]:
    return [int(line.split(":", 1)[0]) for line in processes_inheriting("PDSERVE_STATE_FILE", str(serve.state_file))
            if "ray::ControllerActor" in line]


def status_if_answering(serve):
    result = serve.cli("status", "--json", check=False)
    if result.returncode != 0:
        return None
    return json.loads(result.stdout)


def router_pids(serve) -> list[int]:
    return sorted(int(line.split(":", 1)[0]) for line in
                  processes_inheriting("PDSERVE_STATE_FILE", str(serve.state_file)) if "deploy.router_process" in line)


def live_routers(serve) -> dict[int, dict]:
    """pid -> the controller's view of that router (ids are `router-<index>-pid<pid>`), through
    /admin/status (quicker than `pdserve status`, which joins Ray first)."""
    status = httpx.get(serve.url + "/admin/status", timeout=30).raise_for_status().json()
    return {int(r["router_id"].rpartition("pid")[2]): r for r in status["live_routers"]}


def fresh_completion(serve, prompt: str, max_tokens: int) -> str:
    """On a new connection (the kernel hands it to whichever router accepts first)."""
    with openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=600) as fresh:
        out = fresh.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def wait_for_replacement(serve, victim: dict, decode_workers: int) -> dict:
    """The status once the pools settled with `decode_workers` ready decode workers, none of them
    the killed `victim`."""
    def replaced():
        status = serve.status()
        decode = ready_workers(status, "decode")
        if status["settled"] and len(decode) == decode_workers and victim["pid"] not in {w["pid"] for w in decode}:
            return status
        return None
    return wait_until(replaced, 600, "a replacement decode worker", interval=1.0)


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
    assert [len(ready_workers(status, r)) for r in ("prefill", "decode")] == [1, 2]
    assert status["routers"] == 2 and status["settled"]


def test_killing_the_controller_loses_no_stream_and_it_comes_back(serve, client, offline):
    before = serve.status()
    workers_before = sorted((w["worker_id"], w["address"], w["pid"]) for w in before["workers"])
    prompts = [f"Story number {index}: once upon a time, in a village by the sea," for index in range(12)]
    expected = dict(zip(prompts, offline_texts(offline, prompts, STREAM_TOKENS, ignore_eos=True)))
    streams = [Stream(client, prompt, STREAM_TOKENS) for prompt in prompts]
    for stream in streams:
        assert stream.first.wait(600) and stream.error is None
    [pid] = controller_pids(serve)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # served while the controller is away or restarting: the router keeps its last membership
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=8, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 8)
    status = wait_until(lambda: status_if_answering(serve), 60, "the controller to answer again", interval=0.5)
    print(f"controller answering again {time.monotonic() - killed_at:.1f} s after SIGKILL")  # shown with -s
    assert controller_pids(serve) and controller_pids(serve) != [pid]
    assert status["targets"] == before["targets"]
    assert sorted((w["worker_id"], w["address"], w["pid"]) for w in status["workers"]) == workers_before
    assert any("controller restarted: 3 worker(s) adopted" in e["message"] for e in status["events"])
    for prompt, stream in zip(prompts, streams):
        assert stream.done.wait(600), "a stream never ended"
        assert stream.error is None, f"a stream failed: {stream.error!r}"
        assert stream.text == expected[prompt]
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=8, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 8)


def test_after_the_restart_a_killed_worker_is_replaced_and_scaling_works(serve, client, offline):
    victim = ready_workers(serve.status(), "decode")[0]
    os.kill(victim["pid"], signal.SIGKILL)
    status = wait_for_replacement(serve, victim, decode_workers=2)
    assert any(f"{victim['worker_id']} at {victim['address']} died" in e["message"] for e in status["events"])
    serve.cli("scale", "--decode", "1")  # waits for the drain
    status = serve.status()
    assert status["settled"] and len(ready_workers(status, "decode")) == 1
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=8, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 8)


DRAIN_STREAMS = 16
DRAIN_STREAM_TOKENS = 160
DRAIN_BOUND_S = 10.0  # issue 27: a scale-down under 16 live streams completes within 10 s


def test_scale_down_under_16_live_streams_hands_them_over_in_seconds(serve, client, offline):
    """Two decode workers share 16 live streams; draining one hands its streams to the other
    and `pdserve scale` returns within DRAIN_BOUND_S; every stream ends with the text of an
    undisturbed run (the offline engine's)."""
    serve.cli("scale", "--decode", "2")
    decode = ready_workers(serve.status(), "decode")
    assert len(decode) == 2
    wait_until(lambda: sum(w["role"] == "decode" and w["healthy"] for w in router_workers(serve)) == 2,
               60, "the router to route to both decode workers", interval=1.0)
    prompts = [f"{STORY} {word}" for word in ("a baker", "a smith", "a weaver", "a miller", "a potter", "a tailor",
                                              "a farmer", "a fisher", "a hunter", "a healer", "a scribe", "a cooper",
                                              "a mason", "a carter", "a brewer", "a tanner")][:DRAIN_STREAMS]
    expected = dict(zip(prompts, offline_texts(offline, prompts, DRAIN_STREAM_TOKENS, ignore_eos=True)))
    streams = [Stream(client, p, DRAIN_STREAM_TOKENS) for p in prompts]
    assert all(s.first.wait(300) for s in streams) and all(s.error is None for s in streams)
    victim = max(decode, key=lambda w: next(r["running"] for r in router_workers(serve) if r["address"] == w["address"]))
    assert not any(s.done.is_set() for s in streams), "streams ended before the drain; make them longer"
    started = time.monotonic()
    serve.cli("scale", "--decode", "1", "--drain", victim["address"])  # returns once the drain is done
    took = time.monotonic() - started
    for prompt, stream in zip(prompts, streams):
        assert stream.done.wait(600) and stream.error is None, f"a stream failed: {stream.error!r}"
        assert stream.text == expected[prompt]
    status = serve.status()
    remaining = [w["address"] for w in ready_workers(status, "decode")]
    assert len(remaining) == 1 and victim["address"] not in remaining
    handed = [e["message"] for e in status["events"] if "stream(s) over" in e["message"]
              and victim["address"] in e["message"]]
    print(f"scale-down under {DRAIN_STREAMS} streams: {took:.1f} s; {handed}")
    assert handed, "the drained worker handed no stream over"
    assert not any("drain timed out" in e["message"] for e in status["events"])  # it ended by hand-over
    assert took <= DRAIN_BOUND_S  # the issue states this bound in seconds


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
               60, "the router to route to the new decode worker", interval=1.0)

    assert not stream.done.is_set(), "the stream ended before the drain began; make LONG_STREAM_TOKENS larger"
    serve.cli("scale", "--decode", "1", "--drain", first["address"])  # waits for the drain
    assert stream.done.wait(600), "the handed-over stream never finished"
    assert stream.error is None, f"the stream failed: {stream.error!r}"
    assert stream.text == offline_text(offline, STORY, LONG_STREAM_TOKENS, ignore_eos=True)

    status = serve.status()
    assert [w["address"] for w in ready_workers(status, "decode")] == [second["address"]]
    events = [e["message"] for e in status["events"]]
    assert any(f"{first['worker_id']} at {first['address']} handed 1 stream(s) over" in e for e in events), events
    assert any(f"{first['worker_id']} at {first['address']} stopping: drained" in e for e in events), events
    wait_until(lambda: first["address"] not in {w["address"] for w in router_workers(serve)}, 60,
               "the router to drop the drained worker", interval=1.0)
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=24, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 24)


def test_a_killed_worker_ends_its_stream_with_an_error_and_is_replaced(serve, client, offline):
    [victim] = ready_workers(serve.status(), "decode")
    stream = Stream(client, STORY, LONG_STREAM_TOKENS)
    assert stream.first.wait(300) and stream.error is None
    os.kill(victim["pid"], signal.SIGKILL)
    assert stream.done.wait(120), "the stream on the killed worker never ended"
    assert isinstance(stream.error, openai.APIError)
    status = wait_for_replacement(serve, victim, decode_workers=1)
    [replacement] = ready_workers(status, "decode")
    assert replacement["address"] != victim["address"] and replacement["worker_id"] != victim["worker_id"]
    assert any(f"{victim['worker_id']} at {victim['address']} died" in e["message"] for e in status["events"])
    table = serve.cli("status").stdout
    assert replacement["worker_id"] in table and victim["worker_id"] not in table.split("targets:")[0]
    wait_until(lambda: httpx.get(serve.url + "/health", timeout=30).status_code == 200, 120, "/health", interval=1.0)
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=24, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 24)


def test_a_killed_router_is_restarted_and_the_cluster_keeps_serving(serve, client, offline):
    pids = router_pids(serve)
    assert len(pids) == 2
    wait_until(lambda: set(live_routers(serve)) == set(pids), 60, "both routers to sync with the controller",
               interval=0.5)
    prompts = [f"Story number {index}: once upon a time, in a village by the sea," for index in range(8)]
    expected = dict(zip(prompts, offline_texts(offline, prompts, ROUTER_STREAM_TOKENS, ignore_eos=True)))
    streams = [Stream(client, prompt, ROUTER_STREAM_TOKENS) for prompt in prompts]
    for stream in streams:
        assert stream.first.wait(600) and stream.error is None
    def busiest():
        routers = live_routers(serve)
        inflight, pid = max((r["inflight"], pid) for pid, r in routers.items())
        return pid if inflight else None
    victim = wait_until(busiest, 30, "a router to report streams in flight", interval=0.2)
    assert not any(stream.done.is_set() for stream in streams)
    os.kill(victim, signal.SIGKILL)

    # served while the router is away: by the other router, or from the socket's backlog
    assert fresh_completion(serve, PLAIN, 8) == offline_text(offline, PLAIN, 8)
    failed = []
    for prompt, stream in zip(prompts, streams):
        assert stream.done.wait(600), "a stream never ended"
        if stream.error is None:
            assert stream.text == expected[prompt]
        else:
            assert isinstance(stream.error, (openai.APIConnectionError, httpx.TransportError)), repr(stream.error)
            failed.append(prompt)
    assert failed, "no stream ran on the killed router"

    restarted = wait_until(lambda: [pid for pid in router_pids(serve) if pid not in pids], 120,
                           "a new router process", interval=1.0)
    [new_pid] = restarted
    wait_until(lambda: new_pid in live_routers(serve), 60, "the restarted router to sync", interval=0.5)
    assert "router 0 is back" in serve.tail(200) or "router 1 is back" in serve.tail(200)
    [survivor] = [pid for pid in pids if pid != victim]
    expected_texts = offline_texts(offline, failed[:2], ROUTER_STREAM_TOKENS)
    os.kill(survivor, signal.SIGSTOP)  # only the restarted router accepts now
    try:
        for prompt, expected_text in zip(failed[:2], expected_texts):
            assert fresh_completion(serve, prompt, ROUTER_STREAM_TOKENS) == expected_text
    finally:
        os.kill(survivor, signal.SIGCONT)

    def blocks_released():
        workers = serve.status()["workers"]
        return all(w["kv_blocks_free"] == w["kv_blocks_total"] and not w["running"] for w in workers)
    # a prompt whose router died between prefill and decode holds its blocks until the send lease ends
    wait_until(blocks_released, 120, "every KV block to be free on every worker", interval=1.0)


def test_sigint_stops_every_process_of_the_cluster(serve):
    assert len(router_pids(serve)) == 2
    stop_and_check_nothing_is_left(serve)
