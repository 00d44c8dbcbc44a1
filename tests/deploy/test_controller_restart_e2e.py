"""The controller is no single point of failure (`pdserve serve --prefill 1 --decode 2`, local Ray,
default model, CPU), tried as an operator would:

- SIGKILL of the controller's process while 12 streams run: every stream completes with the text
  of an undisturbed run, new requests are served while it is away, and it is back (`pdserve
  status` answers) within 60 s with the same targets and the same workers (adopted, not
  relaunched);
- afterwards a decode worker killed with SIGKILL is still replaced, and scaling still works;
- SIGINT then stops every process of the cluster, the restarted controller's workers included.
"""
import os
import signal
import time

import pytest

from tests.deploy.harness import (Stream, cluster_fixtures, offline_text, processes_inheriting, ready_workers,
                                  stop_and_check_nothing_is_left, wait_until)

pytestmark = pytest.mark.slow

NUM_BLOCKS = 256
PLAIN = "The quick brown fox"
STREAM_TOKENS = 48


serve, offline, client = cluster_fixtures(NUM_BLOCKS, "--prefill", "1", "--decode", "2")


def controller_pids(serve) -> list[int]:
    return [int(line.split(":", 1)[0]) for line in processes_inheriting("PDSERVE_STATE_FILE", str(serve.state_file))
            if "ray::ControllerActor" in line]


def status_if_answering(serve):
    result = serve.cli("status", "--json", check=False)
    if result.returncode != 0:
        return None
    import json
    return json.loads(result.stdout)


def test_killing_the_controller_loses_no_stream_and_it_comes_back(serve, client, offline):
    before = serve.status()
    workers_before = sorted((w["worker_id"], w["address"], w["pid"]) for w in before["workers"])
    prompts = [f"Story number {index}: once upon a time, in a village by the sea," for index in range(12)]
    expected = {prompt: offline_text(offline, prompt, STREAM_TOKENS, ignore_eos=True) for prompt in prompts}
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
    back_after = time.monotonic() - killed_at
    print(f"controller answering again {back_after:.1f} s after SIGKILL")  # shown with -s
    assert back_after < 60
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

    def replaced():
        status = serve.status()
        decode = ready_workers(status, "decode")
        return status if status["settled"] and len(decode) == 2 and victim["pid"] not in {w["pid"] for w in decode} \
            else None
    status = wait_until(replaced, 600, "a replacement decode worker")
    assert any(f"{victim['worker_id']} at {victim['address']} died" in e["message"] for e in status["events"])
    serve.cli("scale", "--decode", "1")  # waits for the drain
    status = serve.status()
    assert status["settled"] and len(ready_workers(status, "decode")) == 1
    out = client.completions.create(model="default", prompt=PLAIN, max_tokens=8, temperature=0)
    assert out.choices[0].text == offline_text(offline, PLAIN, 8)


def test_sigint_after_a_controller_restart_stops_every_process(serve):
    stop_and_check_nothing_is_left(serve)
