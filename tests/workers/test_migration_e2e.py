"""A worker killed mid-stream loses no request: real processes (two colocated workers and the
router, `python -m router`) on the default model, driven by the official `openai` client.

While a streamed greedy completion is being generated, the worker serving it is killed
(SIGKILL). The router resumes the generation on the other worker from the tokens already
delivered; the client's stream must go on to the same text as an uninterrupted run.
"""
import os
import threading

import httpx
import openai
import pytest

from tests.helpers import free_port, start_python, stop_process, wait_until
from tests.workers.harness import start_workers, stop_workers

pytestmark = pytest.mark.slow

ENGINE = ["--num-blocks", "256", "--role", "both"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def cluster():
    workers = start_workers([("decode", ENGINE), ("decode", ENGINE)])
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    router = start_python(["-m", "router", "--model", "default", "--colocated",
                           ",".join(w.grpc_address for w in workers), "--port", str(port), "--stats-interval", "0.5",
                           "--log-level", "warning"], env)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(router.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if router.poll() is not None:
            raise AssertionError("the router exited:\n" + "".join(log[-40:]))
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, timeout=120, what="the router to report healthy")
        yield {"url": url, "workers": workers, "router_log": log}
    finally:
        stop_process(router, 20)
        stop_workers([w for w in workers if w.process.poll() is None])


def migrations(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(next(line for line in text.splitlines()
                      if line.startswith("pdserve:request_migrations_total")).split()[-1])


def test_killing_the_serving_worker_mid_stream_loses_nothing(cluster):
    client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="unused", max_retries=0, timeout=600)
    params = dict(model="default", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    expected = client.completions.create(**params)
    assert expected.usage.completion_tokens == MAX_TOKENS

    pieces, killed = [], None
    stream = client.completions.create(**params, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        pieces.append(chunk.choices[0].text)
        if killed is None and len(pieces) == 4:
            killed = wait_until(lambda: next((w for w in cluster["workers"] if w.stats().running > 0), None),
                                timeout=10, interval=0.01, what="the serving worker to show the request")
            killed.kill()  # SIGKILL: no goodbye to the router
    assert killed is not None and killed.process.returncode is not None
    assert "".join(pieces) == expected.choices[0].text
    assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens == expected.usage.prompt_tokens
    assert migrations(cluster["url"]) == 1
    survivor = next(w for w in cluster["workers"] if w is not killed)
    wait_until(lambda: survivor.stats().running == 0, what="the survivor to finish")
