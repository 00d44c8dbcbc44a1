"""LLMEngine over the real scheduler and a fake model runner: what it reports (the prefill work
queued) and what a refused construction leaves behind."""
from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest
import torch

import kvtransfer
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.kv_groups import KVGroups
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from tests.engine.fake_runner import FakeModelRunner

BS = 4


class EngineRunner(FakeModelRunner):
    """The fake runner with what LLMEngine reads of a ModelRunner (and, for a KV transport, a
    small transfer cache: [num_blocks, 2, block_size, heads, head_dim] per layer)."""

    def __init__(self, num_blocks: int, block_size: int = BS) -> None:
        super().__init__(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.max_model_len = 256
        self.num_swap_slots = 0
        self.num_host_cache_slots = 0
        self.kv_shards = None
        self.kv_groups = KVGroups.uniform(2)
        self.weight_bytes = 0
        self.transfer_cache = SimpleNamespace(layers=[torch.zeros(num_blocks, 2, block_size, 1, 4) for _ in range(2)],
                                              kv_format=None, layer_windows=())
        self.closed = False

    def close(self) -> None:
        self.closed = True


def make_engine(num_blocks=32, role="both", kv_transport=None, **scheduler):
    config = EngineConfig(model="fake", device="cpu", role=role, cache=CacheConfig(block_size=BS),
                          scheduler=SchedulerConfig(**scheduler))
    runner = EngineRunner(num_blocks)
    return LLMEngine(config, runner=runner, tokenizer=None, kv_transport=kv_transport), runner


PARAMS = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def queued(engine: LLMEngine) -> int:
    return engine.stats()[1]


# ---- prefill work queued (Stats' prefill_tokens_queued) -------------------------------------

def test_prefill_tokens_queued_counts_a_recompute_preempted_requests_outputs():
    """A request preempted by recompute must compute its outputs again before it decodes: they
    are queued prefill work (the router, /metrics and the planner read it), as its prompt is."""
    engine, _ = make_engine(num_blocks=12, max_num_batched_tokens=64)
    engine.add(engine.make_request([1] * 8, PARAMS, "a"), detokenize=False)
    engine.add(engine.make_request([2] * 8, PARAMS, "b"), detokenize=False)
    assert queued(engine) == 16
    engine.step()  # both prompts in one step: both decode now
    assert queued(engine) == 0
    for _ in range(40):
        engine.step()
        preempted = [r for r in engine.scheduler.waiting if r.num_preemptions]
        if preempted:
            break
    else:
        pytest.fail("no request was preempted: the cache is no longer too small for both")
    victim = preempted[0]
    assert victim.num_output_tokens > 1 and victim.num_computed_tokens == 0
    # its prompt and every output so far; the request still running decodes (0)
    assert all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)
    assert queued(engine) == victim.num_tokens == 8 + victim.num_output_tokens
    while engine.has_unfinished():
        engine.step()
    assert queued(engine) == 0


def test_prefill_tokens_queued_counts_resumed_outputs_and_chunks_left():
    engine, _ = make_engine(max_num_batched_tokens=8)
    resumed = engine.make_request(list(range(1, 11)) + [50, 51, 52], PARAMS, "r", num_resumed_tokens=3)
    engine.add(resumed, detokenize=False)
    assert queued(engine) == 13  # the delivered outputs are computed like the prompt
    engine.step()  # a chunk of 8
    assert resumed.status is RequestStatus.RUNNING and queued(engine) == 5
    engine.step()  # the rest, and a new output: it decodes
    assert resumed.num_output_tokens == 4 and queued(engine) == 0


# ---- a refused construction ------------------------------------------------------------------

def _kvtransfer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvtransfer")}


def _listening(address: str) -> bool:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as probe:
        probe.settimeout(2.0)
        return probe.connect_ex((host, int(port))) == 0


def test_a_refused_construction_closes_the_kv_transport():
    """The connector's receiver is built before the Scheduler; a config the Scheduler refuses must
    not leave its I/O thread and listening socket behind."""
    built = []

    def make_receiver(kv_cache, on_transfer_end):
        receiver = kvtransfer.create_receiver("tcp", kv_cache.layers, kvtransfer.TransferConfig(host="127.0.0.1"),
                                              on_transfer_end)
        built.append(receiver)
        return receiver

    before = _kvtransfer_threads()
    for _ in range(2):
        with pytest.raises(ValueError, match="without chunked prefill"):
            make_engine(role="decode", kv_transport=make_receiver, max_num_batched_tokens=16,
                        enable_chunked_prefill=False)
    assert len(built) == 2
    assert _kvtransfer_threads() - before == set()
    for receiver in built:
        assert not _listening(receiver.address), f"{receiver.address} still listens"
