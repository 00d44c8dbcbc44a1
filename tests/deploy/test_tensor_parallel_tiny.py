"""TP 2 through the cluster, on a tiny random Llama with GQA (4 query / 2 KV heads; the default
model's 9 heads cannot split in 2): `pdserve serve --model <tiny folder> --prefill 1 --decode 1
--tensor-parallel-size 2`, CPU, one thread per rank. Greedy completions (token-id prompts, EOS
ignored) through the TP 2 prefill worker and the TP 2 decode worker equal the offline engine at
TP 1, and every request's KV crossed from one to the other.
"""
import tempfile
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.cluster_check import parse_metrics
from tests.deploy.harness import Serve, ready_workers
from tests.engine.tiny_models import save_tiny_model, tiny_config
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 99, 3, 42, 8], list(range(10, 40)), [100, 3, 56, 77, 12, 9, 31] * 3]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-gqa"), tiny_config())


@pytest.fixture(scope="module")
def serve(folder):
    with tempfile.TemporaryDirectory(prefix="pdsv-", dir="/tmp") as ray_temp_dir, \
            tempfile.TemporaryDirectory(prefix="pdserve-state-") as state_dir:
        server = Serve(Path(state_dir) / "serve.json", ray_temp_dir, "--model", folder, "--served-model-name",
                       "tiny", "--device", "cpu", "--kv-cache-blocks", "64", "--block-size", "4",
                       "--max-model-len", "256", "--local-prefill-threshold", "0",
                       "--prefill", "1", "--decode", "1", "--tensor-parallel-size", "2")
        try:
            server.url = server.wait_ready()
            yield server
        finally:
            server.stop()


def test_tp2_prefill_and_decode_match_one_process(serve, folder):
    from engine import LLM, SamplingParams
    status = serve.status()
    assert [w["tensor_parallel_size"] for w in ready_workers(status, "prefill") + ready_workers(status, "decode")] \
        == [2, 2]
    with LLM(folder, num_blocks=64, block_size=4) as offline:
        expected = [offline.tokenizer.decode(out.token_ids) for out in offline.generate(
            PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)]
    assert len(set(expected)) == len(PROMPTS)  # the model does not just repeat itself
    client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    before = parse_metrics(httpx.get(serve.url + "/metrics").text)
    served = [client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text for prompt in PROMPTS]
    # word-level tokens: the served text follows the prompt, so it starts with the joining space
    assert [text.split() for text in served] == [text.split() for text in expected]
    moved = wait_until(lambda: (lambda now: now if now["kv_transfers"] - before["kv_transfers"] >= len(PROMPTS)
                                else None)(parse_metrics(httpx.get(serve.url + "/metrics").text)),
                       60, "the KV transfers to be counted", interval=0.5)
    assert moved["kv_transfers"] - before["kv_transfers"] == len(PROMPTS) and moved["kv_failures"] == 0
