"""The routers are no single point of failure (`pdserve serve --prefill 1 --decode 1 --routers 2`,
local Ray, default model, CPU), tried as an operator would:

- SIGKILL of a router process while 8 streams run: its streams end with a clean connection error,
  the other router's streams complete with the text of an undisturbed run, requests sent while it
  is away are served, it is restarted on the same port, the restarted router serves requests, and
  no KV block stays held on any worker;
- SIGINT then stops every process of the cluster, the restarted router included.
"""
import os
import signal

import httpx
import openai
import pytest

from tests.deploy.harness import (Stream, cluster_fixtures, offline_text, processes_inheriting,
                                  stop_and_check_nothing_is_left, wait_until)

pytestmark = pytest.mark.slow

NUM_BLOCKS = 256
PLAIN = "The quick brown fox"
STREAM_TOKENS = 160

serve, offline, client = cluster_fixtures(NUM_BLOCKS, "--prefill", "1", "--decode", "1", "--routers", "2")


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


def test_a_killed_router_is_restarted_and_the_cluster_keeps_serving(serve, client, offline):
    pids = router_pids(serve)
    assert len(pids) == 2
    wait_until(lambda: set(live_routers(serve)) == set(pids), 60, "both routers to sync with the controller",
               interval=0.5)
    prompts = [f"Story number {index}: once upon a time, in a village by the sea," for index in range(8)]
    expected = {prompt: offline_text(offline, prompt, STREAM_TOKENS, ignore_eos=True) for prompt in prompts}
    streams = [Stream(client, prompt, STREAM_TOKENS) for prompt in prompts]
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
                           "a new router process")
    [new_pid] = restarted
    wait_until(lambda: new_pid in live_routers(serve), 60, "the restarted router to sync", interval=0.5)
    assert "router 0 is back" in serve.tail(200) or "router 1 is back" in serve.tail(200)
    [survivor] = [pid for pid in pids if pid != victim]
    os.kill(survivor, signal.SIGSTOP)  # only the restarted router accepts now
    try:
        for prompt in failed[:2]:
            assert fresh_completion(serve, prompt, STREAM_TOKENS) == offline_text(offline, prompt, STREAM_TOKENS)
    finally:
        os.kill(survivor, signal.SIGCONT)

    def blocks_released():
        workers = serve.status()["workers"]
        return all(w["kv_blocks_free"] == w["kv_blocks_total"] and not w["running"] for w in workers)
    # a prompt whose router died between prefill and decode holds its blocks until the send lease ends
    wait_until(blocks_released, 120, "every KV block to be free on every worker")


def test_sigint_after_a_router_restart_stops_every_process(serve):
    assert len(router_pids(serve)) == 2
    stop_and_check_nothing_is_left(serve)
