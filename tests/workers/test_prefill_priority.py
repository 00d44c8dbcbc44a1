"""A request's priority reaches the prefill worker's engine: the decode worker's Prefill call
carries it (wire/convert.py), the prefill worker's engine request has it (serving.request_from_wire),
so a prefill worker serves an interactive prompt before a batch one queued ahead of it."""
from __future__ import annotations

import grpc
import pytest
import torch

import kvtransfer
import serving
import wire
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.kv_groups import KVGroups
from engine.kv_hooks import ImportPlan
from engine.request import Request
from engine.sampling_params import SamplingParams
from prefill_worker.server import PrefillWorker, PrefillWorkerConfig
from tests.engine.fake_runner import FakeModelRunner
from tests.engine.tiny_models import save_tiny_model, tiny_config
from tests.workers.harness import sampling
from wire.convert import prefill_request_to_wire

BS = 4
PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


class Runner(FakeModelRunner):
    def __init__(self, num_blocks: int = 32) -> None:
        super().__init__(num_blocks, BS)
        self.num_blocks, self.max_model_len, self.kv_shards = num_blocks, 256, None
        self.num_swap_slots = self.num_host_cache_slots = 0
        self.kv_groups = KVGroups.uniform(2)


def prefill_engine(**scheduler) -> LLMEngine:
    """A prefill-role engine over the fake runner, as AsyncEngine's caller sees it (`.engine`)."""
    config = EngineConfig(model="fake", device="cpu", role="prefill", cache=CacheConfig(block_size=BS),
                          scheduler=SchedulerConfig(**scheduler))
    return LLMEngine(config, runner=Runner(), tokenizer=None)


def prefill_call(request_id: str, prompt: list[int], priority: int):
    """The decode worker's Prefill message for an engine request of `priority`."""
    request = Request(request_id, prompt, PARAMS, priority=priority)
    plan = ImportPlan(request_id, [0, 1], 0, [(0, 5), (1, 6)])
    layout = kvtransfer.KVLayout.from_caches([torch.zeros(8, 2, BS, 1, 4)])
    return prefill_request_to_wire(request, plan, "tcp://127.0.0.1:1", layout)


async def test_priority_goes_over_the_wire_both_ways():
    engine = prefill_engine()  # request_from_wire needs its make_request only, as AsyncEngine's
    message = prefill_call("batch", [1, 2, 3, 4, 5], priority=7)
    assert message.priority == 7
    message = wire.messages().PrefillRequest.FromString(message.SerializeToString())
    request = await serving.request_from_wire(engine, message, message.request_id)
    assert request.priority == 7
    message.ClearField("priority")  # an older decode worker's call: the default priority
    assert (await serving.request_from_wire(engine, message, "old")).priority == 0


async def test_a_prefill_engine_serves_an_interactive_prompt_before_a_batch_one_queued_first():
    engine = prefill_engine(max_num_seqs=1)
    for request_id, prompt, priority in (("batch", [3, 4, 5, 6, 7], 1), ("interactive", [8, 9, 10, 11, 12], 0)):
        message = prefill_call(request_id, prompt, priority)  # (batch arrives first)
        engine.add(await serving.request_from_wire(engine, message, request_id), detokenize=False)
    finished = []
    while engine.has_unfinished():
        finished += [delta.request_id for delta in engine.step() if delta.finished]
    assert finished == ["interactive", "batch"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), tiny_config())


async def test_a_prefill_workers_engine_gets_the_calls_priority(model_dir):
    worker = PrefillWorker(PrefillWorkerConfig(model=model_dir, transport="tcp",
                                               engine_options={"device": "cpu", "num_blocks": 64, "block_size": 4}))
    added = []
    add = worker.engine.add

    def recording_add(request, detokenize=True):
        added.append((request.request_id, request.priority))
        add(request, detokenize)
    worker.engine.add = recording_add
    server = grpc.aio.server(options=list(wire.GRPC_OPTIONS))
    worker.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        pb = wire.messages()
        destination = pb.KVDestination(transport="tcp", address="tcp://127.0.0.1:1", layout=worker.layout,
                                       block_ids=[0, 1])
        request = pb.PrefillRequest(request_id="p", prompt_token_ids=[3, 4, 5, 6, 7], sampling=sampling(max_tokens=4),
                                    destination=destination, priority=3)
        await wire.services().PrefillServiceStub(channel).Prefill(request, timeout=60)  # (nothing receives the KV)
        assert added == [("p", 3)]
    finally:
        await channel.close()
        await server.stop(0)
        await worker.close()
