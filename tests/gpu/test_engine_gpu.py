"""The whole engine on a real GPU: Triton attention, the CUDA sampler, KV blocks in device memory.

The default model's GGUF cannot travel to the GPU machine, so this runs a 4-layer model with
SmolLM2-135M's layer shape and vocabulary and seeded random weights (benchmarks/random_model.py).
Greedy outputs in float32 must be token-identical to transformers on the same GPU, whatever the
scheduling (chunked prefill at a small budget, a pool so small that requests are preempted,
prefix-cache hits, prefixes restored from the host cache tier) and with decode steps replayed as
CUDA graphs or run eagerly. bfloat16 must agree with the torch attention backend on the same GPU;
the structured-output mask on CUDA logits equals the CPU kernel's.
Skipped without CUDA.
"""
from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from tests.engine.streams import collect_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from random_model import write_random_model  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPT_LENS = [3, 17, 64, 150, 333]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(str(tmp_path_factory.mktemp("smollm2-random")), num_layers=4, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randint(100, 49000) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()


def generate_reference(hf, prompt: list[int], new: int = NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(hf, prompts):
    return [generate_reference(hf, p) for p in prompts]


def _assert_clean(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    stats = scheduler.stats()
    assert stats.running == stats.waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_runs_on_the_gpu_with_triton_and_decode_graphs(model_dir):
    llm = LLM(model_dir, device="cuda", dtype="float32", num_blocks=64, max_num_seqs=32)
    runner = llm.engine.runner
    assert runner.backend.name == "triton"
    assert runner.kv_layers[0].is_cuda
    assert all(p.is_cuda for p in runner.model.parameters())
    graphs = runner.decode_graphs
    assert graphs is not None and sorted(graphs._graphs) == [(size, 2048) for size in (1, 2, 4, 8, 16, 32)]
    assert all(graph is not None for graph in graphs._graphs.values())
    assert LLM(model_dir, device="cuda", dtype="float32", num_blocks=64, cuda_graphs=False).engine.runner.decode_graphs is None


@pytest.mark.parametrize("options, preempts", [
    ({}, False),
    ({"cuda_graphs": False}, False),
    ({"max_num_batched_tokens": 32}, False),  # every prompt but the first two is chunked
    ({"max_num_batched_tokens": 64, "num_blocks": 30}, True),  # 45 blocks needed, 30 there
    ({"max_num_batched_tokens": 64, "num_blocks": 30, "preemption_mode": "swap", "swap_space_gb": 0.5}, True),
], ids=["default", "eager", "chunked-32", "tiny-pool", "tiny-pool-swap"])
def test_fp32_greedy_is_token_exact_with_transformers(model_dir, prompts, reference, options, preempts):
    llm = LLM(model_dir, device="cuda", dtype="float32", **options)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference
    assert (llm.engine.scheduler.stats().num_preemptions > 0) == preempts
    graphs = llm.engine.runner.decode_graphs
    if options.get("cuda_graphs", True):
        assert graphs.num_replays >= NEW - 1  # the decode steps ran as graphs
    else:
        assert graphs is None
    if options.get("preemption_mode") == "swap":
        stats = llm.engine.scheduler.stats()
        assert stats.swapped_out_blocks > 0 and stats.swap_slots_free == llm.engine.runner.num_swap_slots
    _assert_clean(llm)


def test_a_long_context_decodes_in_a_larger_context_bucket(model_dir, hf):
    """Decode graphs are planned per context bucket: a 2,100-token context runs in the 4,096
    bucket's graph (captured on first use) and stays token-exact."""
    prompt = [100 + (i * 37) % 48000 for i in range(2100)]
    llm = LLM(model_dir, device="cuda", dtype="float32")
    output = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert output.token_ids == generate_reference(hf, prompt, 8)
    assert (1, 4096) in llm.engine.runner.decode_graphs._graphs
    _assert_clean(llm)


def test_prefix_cache_hit_gives_the_same_output(model_dir, hf, prompts):
    llm = LLM(model_dir, device="cuda", dtype="float32")
    shared = prompts[4][:200]
    first, second = shared + [101, 102, 103], shared + [201, 202]
    llm.generate([first], GREEDY, use_tqdm=False)
    out = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 192  # 12 whole blocks of 16
    assert out.token_ids == generate_reference(hf, second)
    _assert_clean(llm)


def test_host_cache_tier_restores_evicted_prefixes_on_the_gpu(model_dir, hf, prompts):
    """A 24-block device pool and a host tier: other prompts evict the first one's blocks
    (copied to host memory), and its second run gets them back by copy, token-exact."""
    llm = LLM(model_dir, device="cuda", dtype="float32", num_blocks=24, host_cache_gb=0.05)
    target = prompts[4][:200] + [101]
    llm.generate([target], GREEDY, use_tqdm=False)
    for index in range(2):
        llm.generate([[100 + index] * 330], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    out = llm.generate([target], GREEDY, use_tqdm=False)[0]
    stats = llm.engine.scheduler.stats()
    assert stats.host_cache_hits > 0 and out.num_cached_tokens > 0
    assert out.token_ids == generate_reference(hf, target)
    _assert_clean(llm)


def test_grammar_mask_on_cuda_logits_matches_the_cpu_kernel():
    pytest.importorskip("xgrammar")  # a GPU machine without it skips (its installs are not carried)
    from engine.structured_output import apply_bitmask

    generator = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-2**31, 2**31, (6, 1536), dtype=torch.int64, generator=generator).to(torch.int32)
    bitmask[:, :100] = 0
    logits = torch.randn(6, 49152, generator=generator)
    on_cpu, on_gpu = logits.clone(), logits.cuda()
    apply_bitmask(on_cpu, bitmask, [0, 2, 5])
    apply_bitmask(on_gpu, bitmask, [0, 2, 5])
    assert torch.equal(on_gpu.cpu(), on_cpu)


def _bf16_outputs(model_dir, prompts, **options):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", max_num_batched_tokens=64, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _assert_clean(llm)
    return outputs


def _assert_close_starts(ours, reference):
    """bf16 runs of one model by different kernels: the first token and its logprob agree closely
    and most of the top 5 are shared."""
    for a, b in zip(ours, reference):
        assert a.token_ids[0] == b.token_ids[0]
        assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=0.1)
        assert len({t for t, _ in a.logprobs[0].top_logprobs} & {t for t, _ in b.logprobs[0].top_logprobs}) >= 3


def test_bf16_triton_agrees_with_torch_attention(model_dir, prompts):
    _assert_close_starts(_bf16_outputs(model_dir, prompts, attention_backend="triton"),
                         _bf16_outputs(model_dir, prompts, attention_backend="torch"))


def test_bf16_fused_triton_ops_agree_with_the_torch_expressions(model_dir, prompts, monkeypatch):
    from engine.model import fused_ops, triton_ops
    calls = {"n": 0}
    original = triton_ops.rms_norm

    def counting(*args):
        calls["n"] += 1
        return original(*args)

    monkeypatch.setattr(triton_ops, "rms_norm", counting)
    fused = _bf16_outputs(model_dir, prompts)
    assert calls["n"] > 0  # the fused kernels ran
    monkeypatch.setattr(fused_ops, "native_for", lambda x: None)
    _assert_close_starts(fused, _bf16_outputs(model_dir, prompts))


def test_async_engine_streams_on_the_gpu(model_dir, prompts, reference):
    llm = LLM(model_dir, device="cuda", dtype="float32")
    engine = AsyncEngine(llm.engine)

    async def main():
        return await asyncio.gather(*(collect_tokens(engine, p, GREEDY) for p in prompts))

    try:
        assert asyncio.run(main()) == reference
        stats = engine.call(lambda e: e.scheduler.stats()).result(timeout=30)
        assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    finally:
        engine.shutdown()
