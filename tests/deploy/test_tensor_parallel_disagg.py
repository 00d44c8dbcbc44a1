"""Prefill and decode pools at different tensor-parallel degrees in the Ray cluster: `pdserve serve
--prefill 1 --decode 1 --prefill-tp 3` on the default model (SmolLM2-135M: 3 KV heads, so TP 3),
CPU, one thread per rank. One cluster for the module:

- the prefill worker runs 3 ranks (two follower processes below its actor), the decode worker 1,
  and `pdserve status` shows each pool's degree;
- greedy chat completions through the `openai` client equal the offline engine's at TP 1, and
  every request's KV crossed from the TP 3 prefill worker (its rank 0 gathers every rank's heads)
  into the TP 1 decode worker: one transfer per request, none failed, none prefilled locally (a
  fallback to local prefill would give the same tokens, so the router's counters are checked);
- `pdserve serve`'s KV connector flags (`KV_FLAGS`) are in effect on the workers, as each one's
  live connector and transport report them. None changes what the tests above see: the timeouts
  are generous, a failed transfer fails the chat test under either policy (it counts failures and
  local prefills), and a tensor-parallel prefill pushes after the whole prompt anyway.
"""
import httpx
import pytest

from benchmarks.cluster_check import parse_metrics
from tests.deploy.harness import assert_chats_match_offline, cluster_fixtures, ready_workers
from tests.deploy.test_tensor_parallel_serve import followers_of
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
MAX_TOKENS = 12
CHATS = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]]

KV_FLAGS = ["--on-transfer-failure", "fail", "--transfer-timeout-s", "300", "--kv-timeout-s", "20",
            "--export-lease-s", "300", "--no-layerwise-push"]

serve, offline, client = cluster_fixtures(NUM_BLOCKS, "--prefill", "1", "--decode", "1", "--prefill-tp", "3",
                                          *KV_FLAGS)


def test_each_pool_runs_its_own_degree(serve):
    status = serve.status()
    [prefill], [decode] = ready_workers(status, "prefill"), ready_workers(status, "decode")
    assert (prefill["tensor_parallel_size"], decode["tensor_parallel_size"]) == (3, 1)
    assert len(followers_of(prefill["pid"])) == 2 and followers_of(decode["pid"]) == []


def test_chats_match_the_offline_engine_with_kv_from_the_tp3_prefill_worker(serve, client, offline):
    counted = lambda: parse_metrics(httpx.get(serve.url + "/metrics").text)  # noqa: E731
    before = counted()
    assert_chats_match_offline(client, offline, CHATS, MAX_TOKENS)  # len(CHATS) + 1 requests
    # Stats are polled every second: wait for a poll after the requests
    moved = wait_until(lambda: (lambda now: now if now["kv_transfers"] - before["kv_transfers"] >= len(CHATS) + 1
                                else None)(counted()), 60, "the KV transfers to be counted", interval=0.5)
    assert moved["kv_transfers"] - before["kv_transfers"] == len(CHATS) + 1  # every request's KV crossed
    assert moved["kv_bytes"] > before["kv_bytes"]
    assert moved["kv_failures"] == 0 and moved["local_prefills"] == before["local_prefills"]


def test_the_kv_flags_of_pdserve_serve_are_in_effect_on_the_workers(serve):
    status = serve.status()
    [prefill], [decode] = ready_workers(status, "prefill"), ready_workers(status, "decode")
    sender, receiver = prefill["kv_settings"], decode["kv_settings"]
    assert sender["kv_timeout_s"] == receiver["kv_timeout_s"] == 20.0  # --kv-timeout-s: each side's transport
    assert (sender["lease_s"], sender["layerwise"]) == (300.0, False)  # --export-lease-s, --no-layerwise-push
    assert (receiver["on_transfer_failure"], receiver["transfer_timeout_s"]) == ("fail", 300.0)
