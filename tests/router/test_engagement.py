"""Is P/D engaged? (router/engagement.py): how each request's prompt was filled, counted by path,
and the alarm when prefill workers sit unused.

The rules on their own (a fake clock), then through the router over fake workers (scripted KV
outcomes), then with real processes: a decode worker that fails every transfer's verification
(`--inject-kv-fault flip_byte`, what a corrupting link or a mismatched peer looks like) answers
every request correctly and silently stops disaggregating; the alarm says so in /health, in
/metrics and in the router's log. The undisturbed cluster of test_e2e_workers.py checks that it
stays silent in a normal run.
"""
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.engagement import EngagementMonitor, PromptFill, classify
from tests.router.harness import reply_script
from tests.router.processes import grpc_address, start_router, start_worker

BLOCK = 16


def test_classify_names_each_path():
    assert classify(True, "", 100, 0, BLOCK, True, 64) == PromptFill("remote", "", True)
    assert classify(False, "checksum", 100, 0, BLOCK, True, 64) == PromptFill("fallback", "checksum", True)
    assert classify(False, "", 100, 0, BLOCK, True, 64) == PromptFill("local", "", True)
    # all of the prompt's full blocks came from the decode worker's cache: nothing left to disaggregate
    assert classify(False, "", 100, 96, BLOCK, True, 64) == PromptFill("cached", "", False)
    assert classify(False, "", 100, 48, BLOCK, True, 16) == PromptFill("local", "", True)
    # too few computed tokens, or a request that had to stay local: counted, not qualifying
    assert classify(False, "", 100, 48, BLOCK, True, 64) == PromptFill("local", "", False)
    assert classify(False, "", 500, 0, BLOCK, False, 64) == PromptFill("local", "", False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_alarm_needs_enough_qualifying_requests_and_no_remote_one(caplog):
    clock, prefill_workers = Clock(), [True]
    monitor = EngagementMonitor(60.0, 3, lambda: prefill_workers[0], clock)
    caplog.set_level(logging.INFO, logger="router.engagement")
    local, fallback = PromptFill("local", "", True), PromptFill("fallback", "auth", True)
    for fill in (local, PromptFill("local", "", False), fallback, PromptFill("cached", "", False)):
        monitor.record(fill)
    assert monitor.degraded() is None  # two qualifying requests: too few to tell
    monitor.record(fallback)
    detail = monitor.degraded()
    assert detail is not None and "none of the last 3 requests" in detail and "fallback (auth): 2" in detail
    assert "local: 1" in detail
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "P/D is not engaged" in warnings[0].getMessage()  # once, not per request
    monitor.record(fallback)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    prefill_workers[0] = False  # no prefill pool: nothing to be engaged
    assert monitor.degraded() is None
    prefill_workers[0] = True
    monitor.record(PromptFill("remote", "", True))  # one remote fill in the window clears it
    assert monitor.degraded() is None
    assert "engaged again" in caplog.records[-1].getMessage()
    clock.now += 61  # the window forgets everything, the remote fill too
    for _ in range(3):
        monitor.record(local)
    assert monitor.degraded() is not None


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def fill_count(samples: dict, path: str, reason: str = "") -> float:
    return samples.get(("pdserve:prompt_fill_requests_total", frozenset({"path": path, "reason": reason}.items())), 0)


def test_fills_are_counted_by_path_and_a_remote_one_clears_the_alarm(make_router, decode, prefills, tokenizer):
    router = make_router(decode=[decode.address], prefill=[p.address for p in prefills],
                         engagement_min_requests=3, engagement_min_prompt_tokens=4)
    body = {"model": "tiny", "prompt": "Once upon a time, in a small village", "max_tokens": 4}
    decode.script = reply_script(tokenizer, "Hello world", kv_bytes=1000, kv_failure_reason="timeout")
    for _ in range(3):
        assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
    health = httpx.get(router.url + "/health")
    assert health.status_code == 200 and "fallback (timeout): 3" in health.json()["degraded"]
    samples = scrape(router.url)
    assert fill_count(samples, "fallback", "timeout") == 3
    assert samples[("pdserve:prompt_fill_kv_bytes_total", frozenset({"path": "fallback"}.items()))] == 3000
    assert samples[("pdserve:disaggregation_degraded", frozenset())] == 1

    decode.script = reply_script(tokenizer, "Hello world", kv_bytes=4096)
    assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
    assert httpx.get(router.url + "/health").json() == {"status": "ok"}
    samples = scrape(router.url)
    assert fill_count(samples, "remote") == 1 and samples[("pdserve:disaggregation_degraded", frozenset())] == 0
    prompt_tokens = len(tokenizer.encode(body["prompt"]))
    assert samples[("pdserve:prompt_fill_tokens_total", frozenset({"path": "remote"}.items()))] == prompt_tokens


def test_without_prefill_workers_every_fill_is_local_and_no_alarm(make_router, decode, tokenizer):
    router = make_router(decode=[decode.address], engagement_min_requests=1, engagement_min_prompt_tokens=1)
    decode.script = reply_script(tokenizer, "Hello world")
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4}
    assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
    samples = scrape(router.url)
    assert fill_count(samples, "local") == 1 and samples[("pdserve:disaggregation_degraded", frozenset())] == 0


@pytest.mark.slow
def test_real_workers_that_fail_every_transfer_raise_the_alarm():
    """A prefill worker and a decode worker whose every received KV fails its checksum: each
    request falls back to a local prefill and answers; the router says P/D is not engaged."""
    processes = []
    try:
        processes += [start_worker("prefill_worker", "--num-blocks", "128"),
                      start_worker("decode_worker", "--num-blocks", "128", "--local-prefill-threshold", "0",
                                   "--inject-kv-fault", "flip_byte")]
        prefill, decode = (grpc_address(p) for p in processes)
        router, url = start_router("--model", "default", "--prefill", prefill, "--decode", decode,
                                   "--engagement-min-requests", "2", "--engagement-min-prompt-tokens", "16")
        processes.append(router)
        for topic in ("rivers", "mountains"):  # different prompts: no prefix cache hit on the decode worker
            prompt = f"Here is a long document about {topic} that the prefill worker should have prefilled. " * 3
            response = httpx.post(url + "/v1/completions", timeout=300,
                                  json={"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"  # the fallback answers
        samples = scrape(url)
        assert fill_count(samples, "fallback", "checksum") == 2 and fill_count(samples, "remote") == 0
        assert samples[("pdserve:disaggregation_degraded", frozenset())] == 1
        health = httpx.get(url + "/health").json()
        assert "fallback (checksum): 2" in health["degraded"], health
        assert router.next_line(lambda line: "P/D is not engaged" in line, timeout=10) is not None
    finally:
        for process in reversed(processes):
            process.stop()
