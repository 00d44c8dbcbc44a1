"""Prefill and decode workers as separate processes with an 8-bit KV cache (`--kv-cache-dtype
int8`), over every kvtransfer transport: token-exact against the offline engine with the same
cache, the blocks moving as they are (their bytes, as the decode worker counts them, are the
8-bit blocks': half of bf16's plus the scales and K references), and a worker pair whose
KV dtypes differ refused with both layouts named, the request served by local prefill."""
import pytest

import kvtransfer
from engine import LLM, SamplingParams
from tests.helpers import wait_until
from tests.transports import transport_params
from tests.workers.harness import all_blocks_free, generate, start_workers, stop_workers

pytestmark = pytest.mark.slow

TRANSPORTS = kvtransfer.available_transports()  # the cluster's decode workers, one per transport
BLOCK = 16
ENGINE = ["--num-blocks", "128", "--kv-cache-dtype", "int8"]


@pytest.fixture(scope="module")
def cluster():
    specs = [("prefill", ENGINE)]
    specs += [("decode", ENGINE + ["--transport", t, "--local-prefill-threshold", "0"]) for t in TRANSPORTS]
    specs.append(("decode", ["--num-blocks", "128", "--transport", "tcp", "--local-prefill-threshold", "0"]))
    workers = start_workers(specs)
    prefill, *decodes, full_precision = workers
    yield {"prefill": prefill, "decode": dict(zip(TRANSPORTS, decodes)), "full_precision": full_precision}
    stop_workers(workers)


@pytest.fixture(scope="module")
def llm():
    return LLM("default", num_blocks=128, kv_cache_dtype="int8")


@pytest.fixture(autouse=True)
def no_blocks_held_after(cluster):
    yield
    for worker in [cluster["prefill"], *cluster["decode"].values(), cluster["full_precision"]]:
        wait_until(lambda: all_blocks_free(worker), what=f"{worker.grpc_address} to free every block")


@pytest.mark.parametrize("transport", transport_params())
def test_8bit_blocks_move_as_they_are_and_decode_token_exact(cluster, llm, transport):
    runner = llm.engine.runner
    block_bytes = runner.kv_format.block_bytes * runner.arch.num_hidden_layers  # one block id, every layer
    values = 2 * BLOCK * runner.arch.num_key_value_heads * runner.arch.head_dim * runner.arch.num_hidden_layers
    # per head: two float32 scales and a bf16 K reference row
    per_head = 2 * 4 + 2 * runner.arch.head_dim
    assert block_bytes == values + runner.arch.num_key_value_heads * per_head * runner.arch.num_hidden_layers
    tok = llm.tokenizer
    prompt = tok.encode("Quantized caches keep a scale per block and head, so a block read back elsewhere "
                        "means exactly what it meant where it was written, on any worker and any transport.")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
    result = generate(cluster["decode"][transport], f"int8-{transport}", prompt, cluster["prefill"])
    assert result.token_ids == expected and result.finish_reason == "length"
    assert result.kv_outcome.prefilled_remotely
    assert result.kv_outcome.kv_bytes_received == -(-len(prompt) // BLOCK) * block_bytes
    # against the same blocks in bf16 (2 bytes a value): half, plus the scales and references
    assert result.kv_outcome.kv_bytes_received < 0.54 * 2 * values * -(-len(prompt) // BLOCK)


def test_a_decode_worker_with_another_kv_dtype_is_refused_naming_both_layouts(cluster, llm):
    """The prefill worker refuses the pair at the handshake; the decode worker says why, naming
    both layouts, and serves the request itself (prefilled locally: nothing is lost)."""
    decode = cluster["full_precision"]
    prompt = llm.tokenizer.encode("A decode worker with a float32 cache cannot take int8 blocks.")
    result = generate(decode, "mismatch", prompt, cluster["prefill"])
    assert result.finish_reason == "length" and not result.error and len(result.token_ids) == 12
    assert not result.kv_outcome.prefilled_remotely
    wait_until(lambda: "KV layout mismatch" in "".join(decode.log), what="the decode worker to log the refusal")
    line = next(line for line in decode.log if "KV layout mismatch" in line)
    assert "dtype=float32" in line and "dtype=int8 with float32 scales and bf16 K references" in line, line
