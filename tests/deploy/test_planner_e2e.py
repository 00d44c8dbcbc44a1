"""The goodput planner on a real `pdserve serve` (local Ray, default model, CPU): 1 prefill + 1
decode worker, `--planner` with a TPOT target no CPU meets and room for 3 workers. While 12
streams run, the planner adds a decode worker; once they are done, it removes one again. Every
request of the run succeeds, and the streams end with the offline engine's text."""
import json

import httpx
import pytest

from tests.deploy.harness import Stream, cluster_fixtures, offline_texts
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

NUM_BLOCKS = 256
STORY = "Once upon a time, in a small village at the edge of a forest, there lived"
STREAM_TOKENS = 120

# --slo-tpot-ms 1: any running stream wants more decode workers than --max-workers allows, so the
# scale-up does not depend on this machine's speed; idle, the pool wants 1 again.
serve, offline, client = cluster_fixtures(NUM_BLOCKS, "--prefill", "1", "--decode", "1", "--planner",
                                          "--slo-tpot-ms", "1", "--max-workers", "3", "--planner-interval", "2",
                                          "--planner-cooldown", "5")


def targets(serve) -> dict:
    """The pool targets, polled through the router's /admin/status (`pdserve status` joins Ray
    first: seconds of CPU per call, which the streams on this machine's 2 cores would pay)."""
    return serve.status()["targets"]


def test_the_planner_scales_decode_up_under_load_and_down_when_idle(serve, client, offline):
    prompts = [f"{STORY} (story {i})" for i in range(12)]
    streams = [Stream(client, prompt, STREAM_TOKENS) for prompt in prompts]
    wait_until(lambda: targets(serve)["decode"] == 2, timeout=300,
               what="the planner to add a decode worker", interval=1.0)
    wait_until(lambda: all(s.done.is_set() for s in streams), timeout=900, what="the streams to finish",
               interval=1.0)
    # requests keep succeeding while the pool changes back
    answers = []
    wait_until(lambda: answers.append(client.completions.create(model="default", prompt=STORY, max_tokens=4,
                                                                temperature=0)) or
               targets(serve)["decode"] == 1, timeout=300,
               what="the planner to remove the decode worker again", interval=1.0)
    assert all(s.error is None for s in streams), [repr(s.error) for s in streams if s.error]
    # the streams ask for ignore_eos
    assert [s.text for s in streams] == offline_texts(offline, prompts, STREAM_TOKENS, ignore_eos=True)
    assert answers and all(a.choices[0].text for a in answers)
    final = json.loads(serve.cli("status", "--json").stdout)  # the command shows the planner's decisions
    assert final["planner"]["changes_total"] == 2 and not final["planner"]["dry_run"]
    scales = [e["message"] for e in final["events"] if e["message"].startswith("scale to ")]
    assert scales == ["scale to 1 prefill, 2 decode, 0 colocated", "scale to 1 prefill, 1 decode, 0 colocated"]
    # the routers' /metrics show them (read from the controller every 2 s)
    def planner_metrics():
        lines = httpx.get(serve.url + "/metrics", timeout=30).text.splitlines()
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines if line.startswith("pdserve:planner_")}
    metrics = wait_until(lambda: (m := planner_metrics()).get('pdserve:planner_decisions_total{outcome="change"}', 0)
                         >= 2 and m, timeout=30, what="the planner's decisions on /metrics", interval=1.0)
    assert metrics['pdserve:planner_target_workers{role="decode"}'] == 1
