"""The decode-graph path (engine/cuda_graphs.py) without a GPU: the same padded, static-buffer
forward that CUDA graphs capture, run eagerly (`capture=False`) with the Triton kernels under the
interpreter. Outputs must be token-identical to the eager engine, padding rows must never write
into the KV cache, and every block must come back. Capture and replay themselves run in
tests/gpu/test_engine_gpu.py.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, SamplingParams  # noqa: E402
from engine.cuda_graphs import DecodeGraphs, capture_sizes, context_buckets  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from random_model import write_random_model  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(str(tmp_path_factory.mktemp("tiny")), num_layers=2, dtype=torch.float32, **TINY)


def _llm(model_dir, graphs: bool) -> LLM:
    llm = LLM(model_dir, device="cpu", dtype="float32", attention_backend="triton", num_blocks=64,
              max_num_seqs=20)
    runner = llm.engine.runner
    if graphs:
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_layers, runner.backend, runner.block_size,
                                            runner.max_model_len, 20, runner.arch.vocab_size, runner.device,
                                            capture=False)
    return llm


def test_capture_sizes_and_context_buckets():
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    assert context_buckets(8192) == [2048, 4096, 8192]
    assert context_buckets(3000) == [2048, 3000]
    assert context_buckets(256) == [256]


# Buckets 1, 4, 8 and 20: padded but for 1. The 20-row bucket takes ~15 s in the Triton
# interpreter, so it runs in `make test` only.
@pytest.mark.parametrize("num_prompts", [1, 3, 5, pytest.param(17, marks=pytest.mark.slow)])
def test_static_buffer_decode_is_token_exact(model_dir, num_prompts):
    rng = random.Random(num_prompts)
    prompts = [[rng.randint(3, 511) for _ in range(rng.randint(2, 24))] for _ in range(num_prompts)]  # some cross a block
    expected = [o.token_ids for o in _llm(model_dir, graphs=False).generate(prompts, GREEDY, use_tqdm=False)]
    llm = _llm(model_dir, graphs=True)
    runner = llm.engine.runner
    before = [layer.clone() for layer in runner.kv_layers]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    # One prefill step (every prompt fits the budget), run eagerly; then every decode step by graph.
    assert runner.decode_graphs.num_replays == GREEDY.max_tokens - 1
    # Padding rows have slot -1: no more blocks were written than the requests own.
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    stats = scheduler.stats()
    assert stats.running == stats.waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    written = {b for b in range(64) for layer, old in zip(runner.kv_layers, before) if not torch.equal(layer[b], old[b])}
    needed = sum(-(-(len(p) + GREEDY.max_tokens) // runner.block_size) for p in prompts)
    assert len(written) <= needed


def test_contexts_past_the_graph_limit_and_prefill_steps_run_eagerly(model_dir):
    llm = _llm(model_dir, graphs=True)
    graphs = llm.engine.runner.decode_graphs
    assert not graphs.fits([1, 2], [5, 9])  # a prefill chunk in the batch
    assert not graphs.fits([1] * 21, [5] * 21)  # more sequences than the largest graph
    assert not graphs.fits([1], [graphs.max_model_len + 1])
    assert graphs.fits([1, 1], [5, graphs.max_model_len])
