"""The KV hand-off between engines of different tensor-parallel degrees, on CPU (gloo), over real
kvtransfer transports: a prefill engine at TP a fills a decode engine at TP b.

Rank 0 of a TP worker is its KV endpoint (engine/model_runner.py): its transfer cache holds every
KV head in the model's layout, gathered from the ranks before a push and scattered to them after a
verified load, so any a feeds any b. What must hold: greedy tokens equal to one colocated TP 1
engine, the KV really came over the wire (no fallback to local prefill, no failure counted), and
no block stays held on either side.
"""
from __future__ import annotations

import pytest

import kvtransfer
from engine.kv_cache import window_skip_blocks
from tests.engine.kv_pair import PARAMS, Pair, make_engine, prompt
from tests.engine.tiny_models import save_family_model, save_tiny_model, tiny_config

PROMPTS = [prompt(1, 13), prompt(2, 30), prompt(3, 7)]
# name: (prefill TP, decode TP, model overrides, transport). The tiny model: 4 query heads, 2 KV heads.
CASES = {
    "p2-to-d1": (2, 1, {}, "tcp"),
    "p1-to-d2": (1, 2, {}, "tcp"),
    "p2-to-d2-shm": (2, 2, {}, "shm"),
    "p4-kv-replicated-to-d2": (4, 2, {}, "tcp"),  # prefill ranks 0,1 hold KV head 0; 2,3 head 1
    "p1-to-d2-one-kv-head": (1, 2, {"num_key_value_heads": 1}, "tcp"),  # both decode ranks hold it
    # 8-bit blocks (engine/kv_quant.py): a rank's share is its heads' values and scales
    "int8-p2-to-d1": (2, 1, {}, "tcp", "int8"),
    "int8-p1-to-d2": (1, 2, {}, "tcp", "int8"),
    "fp8-p4-kv-replicated-to-d2-shm": (4, 2, {}, "shm", "fp8_e4m3"),
    # latent attention (tests/engine/tiny_models.py): every rank holds every token's latent, and
    # one copy of it crosses, not one per rank; in the model's dtype and in 8-bit blocks
    "mla-p2-to-d1": (2, 1, {"family": "deepseek-v3"}, "tcp"),
    "int8-mla-p1-to-d2": (1, 2, {"family": "deepseek-v2-lite"}, "tcp", "int8"),
    # sliding-window and global layers (Gemma 3): a sliding layer's blocks behind the window stay
    # behind, for 8-bit blocks and rank shares too
    "int8-sliding-p2-to-d2": (2, 2, {"family": "gemma3"}, "tcp", "int8"),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def folder(overrides: dict) -> str:
        key = tuple(sorted(overrides.items()))
        if key not in made:
            made[key] = (save_family_model(tmp_path_factory.mktemp("family"), overrides["family"]) if "family" in overrides
                         else save_tiny_model(tmp_path_factory.mktemp("tiny"), tiny_config(**overrides)))
        return made[key]
    return folder


def _colocated(folder: str, kv_cache_dtype: str = "auto") -> dict[str, list[int]]:
    engine = make_engine(folder, "both", kv_cache_dtype=kv_cache_dtype)
    for i, tokens in enumerate(PROMPTS):
        engine.add(engine.make_request(tokens, PARAMS, f"r{i}"))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_at_one_degree_fills_decode_at_another_token_exact(name, folders):
    prefill_tp, decode_tp, overrides, transport, *kv_dtype = CASES[name]
    kv_cache_dtype = kv_dtype[0] if kv_dtype else "auto"
    if transport not in kvtransfer.available_transports():
        pytest.skip(f"{transport} is not available here")
    folder = folders(overrides)
    expected = _colocated(folder, kv_cache_dtype)
    pair = Pair(folder, transport, tensor_parallel_size=prefill_tp, kv_cache_dtype=kv_cache_dtype,
                decode_options={"tensor_parallel_size": decode_tp, "kv_cache_dtype": kv_cache_dtype})
    try:
        for engine, tp in ((pair.prefill, prefill_tp), (pair.decode, decode_tp)):
            heads = engine.runner.arch.num_key_value_heads
            rank_heads = heads if tp == 1 else max(1, heads // tp)
            transfer, own = engine.runner.transfer_cache, engine.runner.kv_cache
            if kv_cache_dtype == "auto":
                assert transfer.data.shape[4] == heads  # the endpoint holds every head
                assert own.data.shape[4] == rank_heads
            else:  # 8-bit blocks: [layers, blocks, block_bytes], the scales per head inside
                assert transfer.kv_format.num_kv_heads == heads and own.kv_format.num_kv_heads == rank_heads
                assert transfer.data.shape[2] == transfer.kv_format.block_bytes
        for i, tokens in enumerate(PROMPTS):
            pair.start(f"r{i}", tokens)
        deltas = pair.run_prefill(until=lambda ds: sum(d.finished for d in ds) == len(PROMPTS))
        for i in range(len(PROMPTS)):
            assert pair.report(f"r{i}", [d for d in deltas if d.request_id == f"r{i}"])
        tokens, finals = pair.run_decode()
        assert tokens == expected
        for i in range(len(PROMPTS)):
            outcome = finals[f"r{i}:import"]
            assert outcome.prefilled_remotely and outcome.bytes_received > 0, outcome
            arch = pair.decode.runner.arch
            if arch.is_mla:  # every block of the prompt, each token's latent once per layer
                cache = pair.decode.runner.kv_cache
                blocks = -(-len(PROMPTS[i]) // pair.decode.runner.block_size)
                if cache.kv_format is None:
                    latent_bytes = (arch.kv_lora_rank + arch.qk_rope_head_dim) * cache.data.element_size()
                    block_bytes = pair.decode.runner.block_size * latent_bytes
                else:  # one byte per latent value, plus the block's scales and K reference
                    assert cache.kv_format.num_kv_heads == 1
                    assert cache.kv_format.values_bytes == 2 * cache.block_size * cache.kv_format.head_dim
                    block_bytes = cache.kv_format.block_bytes
                assert outcome.bytes_received == blocks * arch.num_hidden_layers * block_bytes
            windows = pair.decode.runner.transfer_cache.layer_windows
            if windows:  # the (layer, block) chunks the windows need, no more
                cache = pair.decode.runner.transfer_cache
                blocks = -(-len(PROMPTS[i]) // cache.block_size)
                skips = window_skip_blocks(windows, len(PROMPTS[i]), cache.block_size)
                assert max(skips) > 0 or len(PROMPTS[i]) <= max(windows)
                chunk = cache.kv_format.block_bytes if cache.kv_format is not None else cache.data[0, 0].nbytes
                assert outcome.bytes_received == sum(blocks - skip for skip in skips) * chunk
        assert not pair.decode.kv_connector.failures and not pair.prefill.kv_connector.failures
        pair.assert_nothing_held()
    finally:
        pair.close()
