"""/metrics exposes the router's pdserve:* series, fed by real requests through fake workers."""
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.router.harness import reply_script


def scrape(router) -> dict:
    """{(sample name, frozenset(labels)): value}"""
    text = httpx.get(router.url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_request_metrics(router, decode, tokenizer):
    reply = tokenizer.encode("Hello world, hello there!", add_special_tokens=False)
    decode.script = reply_script(tokenizer, "Hello world, hello there!", num_cached_tokens=16, kv_bytes=4096)
    prompt = "Once upon a time"
    for stream in (False, True):
        r = httpx.post(router.url + "/v1/completions",
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 100, "stream": stream})
        assert r.status_code == 200
    assert httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                            "max_tokens": 2}).status_code == 200
    httpx.post(router.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    httpx.post(router.url + "/v1/chat/completions", json={"model": "tiny"})

    samples = scrape(router)
    assert value(samples, "pdserve:request_finished_total", finish_reason="stop") == 2
    assert value(samples, "pdserve:request_finished_total", finish_reason="length") == 1
    assert value(samples, "pdserve:http_responses_total", endpoint="/v1/completions", status="200") == 3
    assert value(samples, "pdserve:http_responses_total", endpoint="/v1/completions", status="404") == 1
    assert value(samples, "pdserve:http_responses_total", endpoint="/v1/chat/completions", status="400") == 1
    prompt_tokens = len(tokenizer.encode(prompt))
    assert value(samples, "pdserve:prompt_tokens_total") == 2 * prompt_tokens + len(tokenizer.encode("x"))
    assert value(samples, "pdserve:generation_tokens_total") == 2 * (len(reply) + 1) + 2
    assert value(samples, "pdserve:cached_prompt_tokens_total") == 3 * 16
    assert value(samples, "pdserve:kv_transfer_bytes_total") == 3 * 4096
    assert value(samples, "pdserve:kv_transfer_seconds_count") == 3
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "time_per_output_token_seconds"):
        assert value(samples, f"pdserve:{histogram}_count") == 3, histogram
    # one gap per token after the first: (len(reply) + 1 - 1) per long request, 1 for the short one
    assert value(samples, "pdserve:inter_token_latency_seconds_count") == 2 * len(reply) + 1
    assert value(samples, "pdserve:routing_decisions_total", role="decode", reason="power_of_two") == 3


def test_kv_transfer_failures_by_reason(router, decode):
    decode.kv_transfer_failures = {"checksum": 2, "timeout": 1}
    labels = {"worker": decode.address, "role": "decode"}
    deadline = time.monotonic() + 30
    while value(scrape(router), "pdserve:kv_transfer_failures_total", reason="checksum", **labels) != 2:
        assert time.monotonic() < deadline, "the router never read the worker's new stats"
        time.sleep(0.05)
    samples = scrape(router)
    assert value(samples, "pdserve:kv_transfer_failures_total", reason="timeout", **labels) == 1
    assert ("pdserve:kv_transfer_failures_total", frozenset(dict(labels, reason="epoch").items())) in samples
    decode.kv_transfer_failures = {}


def test_worker_gauges(router, decode, prefills):
    samples = scrape(router)
    labels = {"worker": decode.address, "role": "decode"}
    assert value(samples, "pdserve:worker_healthy", **labels) == 1
    assert value(samples, "pdserve:worker_kv_blocks_total", **labels) == 64
    assert value(samples, "pdserve:worker_kv_blocks_free", **labels) == 64
    assert value(samples, "pdserve:worker_kv_blocks_cached", **labels) == 3
    assert value(samples, "pdserve:worker_prefix_cache_hit_rate", **labels) == 0.25
    assert value(samples, "pdserve:worker_resident_bytes", **labels) == 3 << 30
    assert value(samples, "pdserve:worker_weight_bytes", **labels) == 1 << 30
    assert value(samples, "pdserve:spec_decode_num_drafts_total", **labels) == 10
    assert value(samples, "pdserve:spec_decode_num_draft_tokens_total", **labels) == 40
    assert value(samples, "pdserve:spec_decode_num_accepted_tokens_total", **labels) == 30
    assert value(samples, "pdserve:worker_spec_decode_acceptance_rate", **labels) == 0.75
    steps = dict(labels, kind="decode")
    assert value(samples, "pdserve:worker_step_seconds_bucket", le="0.03", **steps) == 0
    assert value(samples, "pdserve:worker_step_seconds_bucket", le="0.04", **steps) == 2
    assert value(samples, "pdserve:worker_step_seconds_bucket", le="5", **steps) == 2
    assert value(samples, "pdserve:worker_step_seconds_bucket", le="+Inf", **steps) == 3
    assert value(samples, "pdserve:worker_step_seconds_count", **steps) == 3
    assert value(samples, "pdserve:worker_step_seconds_sum", **steps) == 6.07
    for prefill in prefills:
        assert value(samples, "pdserve:worker_healthy", worker=prefill.address, role="prefill") == 1


def test_an_internal_error_is_counted_as_a_500_not_as_a_client_gone():
    """Starlette's outermost middleware renders an unhandled exception's 500, outside the counter:
    the counter books it as a 500 (it booked a 499, "the client left")."""
    import asyncio

    import pytest

    from router.app import _ResponseCounter
    from router.config import RouterConfig
    from router.engagement import EngagementMonitor
    from router.metrics import RouterMetrics
    from router.pool import WorkerPool

    async def failing_app(scope, receive, send):
        raise RuntimeError("a bug")

    pool = WorkerPool(RouterConfig(decode=["127.0.0.1:5001"], prefill=["127.0.0.1:5002"]))
    metrics = RouterMetrics(pool, EngagementMonitor(60.0, 1, lambda: True))
    counter = _ResponseCounter(failing_app, metrics)

    async def send(message):
        pass

    with pytest.raises(RuntimeError):
        asyncio.run(counter({"type": "http", "path": "/v1/completions"}, None, send))
    text = metrics.exposition().decode()
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert value(samples, "pdserve:http_responses_total", endpoint="/v1/completions", status="500") == 1
    assert value(samples, "pdserve:http_responses_total", endpoint="/v1/completions", status="499") == 0
