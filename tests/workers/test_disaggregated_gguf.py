"""Prefill and decode workers as separate processes serving the default model with its GGUF's
weights kept as stored (`--quantization gguf`): token-exact through the P/D hand-off against the
offline engine with the same weights, the KV prefilled remotely, and each worker's Stats reporting
the file's tensor bytes as its weights (what `pdserve status` shows)."""
import pytest

from engine import LLM, SamplingParams
from engine.model.packaged_models import packaged_gguf_path
from tests.helpers import wait_until
from tests.workers.harness import all_blocks_free, generate, start_workers, stop_workers

pytestmark = pytest.mark.slow

ENGINE = ["--num-blocks", "128", "--quantization", "gguf"]


@pytest.fixture(scope="module")
def workers():
    from engine import cpu_kernels
    module = cpu_kernels.load()
    if module is None or not module.has_gguf_linear():
        pytest.skip("no native GGUF linear here: the reference path would dequantize every layer at every step")
    started = start_workers([("prefill", ENGINE), ("decode", ENGINE + ["--transport", "tcp",
                                                                       "--local-prefill-threshold", "0"])])
    yield started
    stop_workers(started)


def test_gguf_weights_serve_token_exact_through_the_hand_off(workers):
    from gguf import GGUFReader
    prefill, decode = workers
    with LLM("default", num_blocks=128, dtype="float32", quantization="gguf") as llm:
        prompt = llm.tokenizer.encode("Weights kept in their file's blocks compute the same KV on both sides of "
                                      "the hand-off, so the decode worker continues where the prefill stopped.")
        expected = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                use_tqdm=False)[0].token_ids
    result = generate(decode, "gguf-pd", prompt, prefill)
    assert result.token_ids == expected and result.finish_reason == "length"
    assert result.kv_outcome.prefilled_remotely
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(packaged_gguf_path("default")).tensors)
    for worker in workers:
        assert worker.stats().weight_bytes == file_bytes
        wait_until(lambda: all_blocks_free(worker), what=f"{worker.grpc_address} to free every block")
