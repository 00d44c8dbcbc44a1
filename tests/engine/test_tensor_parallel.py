"""Tensor parallelism through the offline API (`LLM(model, tensor_parallel_size=N)`), on CPU with gloo.

Greedy output must be token-identical to one process: the ranks split the heads and the MLP, so
float32 sums run in another order (the row-parallel partial sums are added by the all-reduce) and
logits move by a few ulps; greedy tokens compare exactly on these models (and logprobs within
1e-4). Also: sizes that cannot split a model are refused before any process starts, and no
follower process outlives its engine (closed, or killed).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.model.arch import ModelArchConfig
from engine.model.decoder import TensorParallelShard
from engine.parallel import TensorParallelGroup, host_store
from tests.engine.tiny_models import save_tiny_model, tiny_config

PROMPTS = [[5, 17, 99, 3], [42] * 23, list(range(1, 40)), [7, 8], [100, 3, 56, 77, 12, 9, 31] * 3]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
SMALL = dict(num_blocks=96, block_size=4, max_num_batched_tokens=32)  # chunked prefill, mixed steps


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py


def _children(parent: int | None = None) -> set[int]:
    """Live pids whose parent is `parent` (default: this process), from /proc."""
    parent = os.getpid() if parent is None else parent
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if int(ppid) == parent and state != "Z":
                found.add(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _generate(folder: str, tp: int, prompts=PROMPTS, params=GREEDY, **options):
    with LLM(folder, tensor_parallel_size=tp, **{**SMALL, **options}) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


def _assert_same(outputs, reference):
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    for out, ref in zip(outputs, reference):
        torch.testing.assert_close([lp.logprob for lp in out.logprobs], [lp.logprob for lp in ref.logprobs],
                                   atol=1e-4, rtol=0)


# name: (model kind, config overrides, TP size). Heads 4 q / 2 KV unless said.
CASES = {
    "gqa-kv-split": ("llama", {}, 2),  # each rank: 2 q heads, 1 KV head
    "one-kv-head-replicated": ("llama", {"num_key_value_heads": 1}, 2),  # both ranks hold KV head 0
    "tp4-kv-replicated-in-pairs": ("llama", {}, 4),  # 1 q head each; ranks 0,1 -> KV 0, ranks 2,3 -> KV 1
    "qwen2-qkv-bias": ("qwen2", {}, 2),  # q/k/v biases sliced with their rows
    "llama-o-proj-bias-untied": ("llama", {"attention_bias": True, "tie_word_embeddings": False}, 2),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    kind, overrides, tp = CASES[request.param]
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param), tiny_config(kind, **overrides))
    return folder, tp


def test_greedy_output_is_token_identical_to_one_process(case):
    folder, tp = case
    reference = _generate(folder, 1)
    assert len({tuple(o.token_ids) for o in reference}) == len(PROMPTS)  # the model does not just repeat
    _assert_same(_generate(folder, tp), reference)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_an_8bit_kv_cache_splits_by_head_like_any_other(kv_cache_dtype, tmp_path):
    """Each rank quantizes its own KV heads (scales are per block and head, so the bytes are the
    single process's): greedy tokens equal one process with the same 8-bit cache, the KV heads
    replicated across ranks too."""
    for overrides, tp in (({}, 2), ({"num_key_value_heads": 1}, 2)):
        folder = save_tiny_model(tmp_path / f"kv{overrides.get('num_key_value_heads', 2)}", tiny_config(**overrides))
        reference = _generate(folder, 1, kv_cache_dtype=kv_cache_dtype)
        assert [o.token_ids for o in _generate(folder, tp, kv_cache_dtype=kv_cache_dtype)] == \
            [r.token_ids for r in reference]


def test_swap_preemption_and_the_host_cache_tier_copy_every_ranks_kv(tmp_path):
    """A pool too small for the batch (swap preemption: the KV goes to host slots and back) and a
    host tier (evicted prefix blocks saved and reloaded): every rank makes the same copies of its
    own KV heads, so the outputs are the single process's under the same scheduling."""
    folder = save_tiny_model(tmp_path, tiny_config())
    options = dict(num_blocks=24, block_size=4, max_num_batched_tokens=32, preemption_mode="swap",
                   swap_space_gb=0.01, host_cache_gb=0.01)
    session = [9, 8, 7, 6, 5] * 7
    filler = list(range(40, 100))

    def scenario(llm):
        outs = [o.token_ids for o in llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)]
        for turn in range(3):  # the session's blocks are evicted by the filler, then come back
            outs.append(llm.generate([session], GREEDY, use_tqdm=False)[0].token_ids)
            session.extend(outs[-1])
            llm.generate([filler + [turn]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        return outs, llm.engine.scheduler.stats()

    start = list(session)
    with LLM(folder, **options) as single:
        expected, _ = scenario(single)
    session[:] = start
    with LLM(folder, tensor_parallel_size=2, **options) as parallel:
        got, stats = scenario(parallel)
    assert got == expected
    assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks > 0
    assert stats.offloaded_blocks > 0 and stats.reloaded_blocks > 0 and stats.host_cache_hits > 0


def test_a_size_that_cannot_split_the_model_is_refused_before_any_process_starts(tmp_path):
    folder = save_tiny_model(tmp_path, tiny_config())  # 4 q heads, 2 KV heads, intermediate 112
    before = _children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .*num_attention_heads \(4\) is not divisible"
                                         r".*num_key_value_heads \(2\).*\(sizes that can: 1, 2, 4\)"):
        LLM(folder, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        LLM(folder, tensor_parallel_size=0)
    assert _children() == before


def test_the_default_model_splits_in_3_not_2():
    """SmolLM2-135M: 9 query heads, 3 KV heads, intermediate 1536: 3 ranks (or 9), never 2."""
    from engine.model.loader import resolve_model
    arch = resolve_model("default").arch
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) is not divisible.*sizes that can: 1, 3\b"):
        TensorParallelShard.of(arch, 0, 2)
    shards = [TensorParallelShard.of(arch, r, 3) for r in range(3)]
    assert [(s.head_start, s.num_heads, s.kv_head_start, s.num_kv_heads, s.inter_start, s.intermediate_size)
            for s in shards] == [(0, 3, 0, 1, 0, 512), (3, 3, 1, 1, 512, 512), (6, 3, 2, 1, 1024, 512)]


def test_kv_heads_are_replicated_to_the_ranks_whose_query_heads_read_them():
    arch = ModelArchConfig.from_hf_config(tiny_config(num_attention_heads=8, num_key_value_heads=2))
    shards = [TensorParallelShard.of(arch, r, 4) for r in range(4)]
    group = arch.num_attention_heads // arch.num_key_value_heads
    for shard in shards:
        assert shard.num_kv_heads == 1
        # every query head of the rank reads this KV head (GQA: head h reads h // group)
        heads = range(shard.head_start, shard.head_start + shard.num_heads)
        assert {h // group for h in heads} == {shard.kv_head_start}
    assert [s.kv_head_start for s in shards] == [0, 0, 1, 1]


class _Rank:
    """What the model reads of its group when it is built and loaded (no collective runs)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def test_each_rank_loads_its_slices_of_the_hugging_face_tensors(tmp_path):
    from engine.model.decoder import DecoderForCausalLM
    from engine.model.loader import resolve_model
    loaded = resolve_model(save_tiny_model(tmp_path, tiny_config(attention_bias=True)))
    hf = dict(loaded.iter_weights())
    layer = "model.layers.1."
    for r in range(2):
        model = DecoderForCausalLM(loaded.arch, tp=_Rank(r, 2))
        model.load_weights(hf.items())
        params = dict(model.named_parameters())
        q, kv, inter = slice(32 * r, 32 * r + 32), slice(16 * r, 16 * r + 16), slice(56 * r, 56 * r + 56)
        for kind in ("weight", "bias"):  # q: heads 2r, 2r+1; k and v: KV head r
            expected = torch.cat([hf[f"{layer}self_attn.{p}_proj.{kind}"][rows]
                                  for p, rows in (("q", q), ("k", kv), ("v", kv))])
            assert torch.equal(params[f"layers.1.self_attn.qkv_proj.{kind}"], expected)
        assert torch.equal(params["layers.1.self_attn.o_proj.weight"], hf[f"{layer}self_attn.o_proj.weight"][:, q])
        assert torch.equal(params["layers.1.self_attn.o_proj.bias"], hf[f"{layer}self_attn.o_proj.bias"])  # whole
        gate_up = [hf[f"{layer}mlp.{p}_proj.weight"][inter] for p in ("gate", "up")]
        assert torch.equal(params["layers.1.mlp.gate_up_proj.weight"], torch.cat(gate_up))
        assert torch.equal(params["layers.1.mlp.down_proj.weight"], hf[f"{layer}mlp.down_proj.weight"][:, inter])
        assert torch.equal(params["embed_tokens.weight"], hf["model.embed_tokens.weight"])  # replicated
    # A misshapen tensor is named with the whole model's shape, not the rank's slice.
    wrong = dict(hf, **{f"{layer}self_attn.k_proj.weight": torch.zeros(48, 64)})
    with pytest.raises(ValueError, match=r"k_proj.weight.*\(48, 64\), expected \(32, 64\)"):
        DecoderForCausalLM(loaded.arch, tp=_Rank(1, 2)).load_weights(wrong.items())


def test_followers_are_gone_once_the_llm_is_closed(tmp_path):
    folder = save_tiny_model(tmp_path, tiny_config())
    before = _children()
    llm = LLM(folder, tensor_parallel_size=2, **SMALL)
    followers = _children() - before
    assert len(followers) == 1
    llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    llm.close()
    llm.close()  # idempotent
    assert _children() == before
    assert not any(_alive(pid) for pid in followers)
    with pytest.raises(RuntimeError, match="tensor-parallel group is down"):
        llm.engine.runner.execute(_one_seq_batch(llm))


def test_a_follower_that_dies_fails_the_step_and_stops_the_group(tmp_path):
    """The next collective fails at once (gloo: connection closed); that step's requests end with
    an error, the other followers are stopped and later requests fail fast: no hang, no orphan."""
    folder = save_tiny_model(tmp_path, tiny_config())
    before = _children()
    with LLM(folder, tensor_parallel_size=4, **SMALL) as llm:
        followers = _children() - before
        assert len(followers) == 3
        os.kill(min(followers), signal.SIGKILL)
        for attempt in range(2):
            out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
            assert out.finish_reason == "error" and out.error, attempt
        assert "tensor-parallel group is down" in out.error
        assert _children() == before
        assert llm.engine.broken is not None  # a worker's health reports it (AsyncEngine.stats raises)
        served = AsyncEngine(llm.engine)
        try:
            with pytest.raises(RuntimeError, match="engine cannot step: "):
                served.stats()
        finally:
            served.shutdown()
    llm.engine.scheduler.check_integrity()


def test_a_follower_that_dies_idle_is_reported_before_any_request(tmp_path):
    """A follower that exits while nothing runs makes `broken` (what a worker's Health reads)
    say so at once, rather than when the next request fails on it."""
    folder = save_tiny_model(tmp_path, tiny_config())
    before = _children()
    with LLM(folder, tensor_parallel_size=2, **SMALL) as llm:
        served = AsyncEngine(llm.engine)
        try:
            served.stats()  # healthy
            assert llm.engine.broken is None
            (follower,) = _children() - before
            os.kill(follower, signal.SIGKILL)
            deadline = time.monotonic() + 15
            while llm.engine.broken is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert llm.engine.broken == f"tensor-parallel follower rank 1 (pid {follower}) exited with code -9"
            with pytest.raises(RuntimeError, match="engine cannot step: tensor-parallel follower rank 1"):
                served.stats()  # Health: not ok
        finally:
            served.shutdown()
    assert _children() == before


def _one_seq_batch(llm):
    request = llm.engine.make_request([5, 6], GREEDY)
    llm.engine.scheduler.add_request(request)
    return llm.engine.scheduler.schedule()


def test_followers_exit_when_the_engine_process_is_killed(tmp_path):
    """No orphans: SIGKILL leaves rank 0 no chance to say shutdown; its followers notice."""
    folder = save_tiny_model(tmp_path, tiny_config())
    script = textwrap.dedent(f"""
        import sys, time, torch
        torch.set_num_threads(1)
        from engine import LLM
        llm = LLM({folder!r}, tensor_parallel_size=2, num_blocks=32, block_size=4)
        print("ready", flush=True)
        time.sleep(600)
    """)
    project = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=project)
    try:
        assert engine.stdout.readline().strip() == "ready"
        followers = _children(engine.pid)
        assert len(followers) == 1 and all(_alive(pid) for pid in followers)
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in followers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in followers)
    finally:
        engine.kill()
        engine.wait()


def test_group_all_reduce_and_broadcast_object_between_two_ranks():
    """The group's contract on its own (two ranks as two threads): a sum on every rank, rank 0's
    objects on the other, small ones in one broadcast and big ones (past the inline buffer) too."""
    store, address = host_store(2)
    results: dict[int, list] = {0: [], 1: []}
    errors = []

    def rank(r: int) -> None:
        try:
            group = TensorParallelGroup(r, 2, "cpu", address, store=store if r == 0 else None)
            results[r].append(group.all_reduce(torch.full((3,), float(r + 1))).tolist())
            for message in ({"ids": [1, 2, 3]}, ("forward", list(range(20_000))), ("shutdown",)):
                results[r].append(group.broadcast_object(message if r == 0 else None))
            group.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert results[0] == results[1] == [[3.0, 3.0, 3.0], {"ids": [1, 2, 3]}, ("forward", list(range(20_000))),
                                        ("shutdown",)]


@pytest.mark.slow
def test_default_model_tp3_greedy_matches_one_process():
    """SmolLM2-135M cannot split in 2 (9 query heads): 3 ranks, one KV head each."""
    with LLM("default") as single:
        tok = single.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": "Name a fruit that is yellow."}]),
                   tok.encode("The history of the Roman empire"), tok.encode("Les fleurs du jardin sont")]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
        reference = single.generate(prompts, params, use_tqdm=False)
    with LLM("default", tensor_parallel_size=3) as parallel:
        _assert_same(parallel.generate(prompts, params, use_tqdm=False), reference)
