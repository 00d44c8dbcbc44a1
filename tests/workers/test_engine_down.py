"""A worker whose engine cannot take requests (its loop died, it shut down) answers new calls
UNAVAILABLE, which the router retries on another worker, and Health ok=False with Stats still
answering, so that the router's poll (Health and Stats together) takes it out of routing at once.

In-process workers over a tiny random model, each behind its own gRPC server on 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

import wire
from decode_worker.server import DecodeWorker, DecodeWorkerConfig
from prefill_worker.server import PrefillWorker, PrefillWorkerConfig
from tests.engine.tiny_models import save_tiny_model, tiny_config
from tests.workers.harness import sampling

ENGINE = {"device": "cpu", "num_blocks": 64, "block_size": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), tiny_config())


@contextlib.asynccontextmanager
async def serving(worker):
    """(address, stub) of `worker` behind a gRPC server; the worker is closed afterwards."""
    server = grpc.aio.server(options=list(wire.GRPC_OPTIONS))
    worker.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    services = wire.services()
    stub = services.PrefillServiceStub(channel) if worker.role == "prefill" else services.DecodeServiceStub(channel)
    try:
        yield f"127.0.0.1:{port}", stub
    finally:
        await channel.close()
        await server.stop(0)
        await worker.close()


async def generate(stub, request_id):
    request = wire.messages().GenerateRequest(request_id=request_id, prompt_token_ids=[3, 4, 5, 6, 7],
                                              sampling=sampling(max_tokens=4))
    return [chunk async for chunk in stub.Generate(request, timeout=60)]


async def router_pool(address, role, model_dir):
    """A router's WorkerPool of the one worker, polled once while the worker is up."""
    from router.config import RouterConfig
    from router.pool import WorkerPool
    kind = "prefill" if role == "prefill" else "colocated"
    pool = WorkerPool(RouterConfig(model=model_dir, kv_events=False, **{kind: [address]}))
    await pool.poll_worker(pool.workers()[0])
    assert pool.workers()[0].healthy
    return pool


async def check_down(stub, pool, role):
    """Health says not ok, Stats still answers, and the router's next poll takes the worker out."""
    pb = wire.messages()
    health = await stub.Health(pb.HealthRequest(), timeout=30)
    assert not health.ok and health.role == role
    stats = await stub.Stats(pb.StatsRequest(), timeout=30)  # the last snapshot, not UNAVAILABLE
    assert stats.role == role and stats.kv_blocks_total == ENGINE["num_blocks"]
    worker = pool.workers()[0]
    await pool.poll_worker(worker)
    assert not worker.healthy and worker.consecutive_failures == 1  # at once, not after 4 failed polls
    assert worker.last_error == "the worker reports it is not ok"
    await pool.stop()


async def test_a_decode_worker_whose_engine_loop_died_is_unavailable(model_dir):
    worker = DecodeWorker(DecodeWorkerConfig(model=model_dir, role="both", engine_options=ENGINE))
    async with serving(worker) as (address, stub):
        assert (await generate(stub, "before"))[-1].finish_reason == "length"
        pool = await router_pool(address, "both", model_dir)

        def bug():  # anything raised outside a step's own try ends the engine loop
            raise RuntimeError("simulated engine loop bug")
        worker.engine.engine.run_batch = bug
        for request_id in ("kills-the-loop", "after"):  # the request it died under, then a new one
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await generate(stub, request_id)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
            assert "engine loop died" in caught.value.details()
        await check_down(stub, pool, "both")


async def test_a_shut_down_prefill_worker_is_unavailable(model_dir):
    worker = PrefillWorker(PrefillWorkerConfig(model=model_dir, transport="tcp", engine_options=ENGINE))
    async with serving(worker) as (address, stub):
        pool = await router_pool(address, "prefill", model_dir)
        await asyncio.to_thread(worker.engine.shutdown)
        pb = wire.messages()
        destination = pb.KVDestination(transport="tcp", address="tcp://127.0.0.1:1", layout=worker.layout,
                                       block_ids=[0, 1])
        request = pb.PrefillRequest(request_id="p", prompt_token_ids=[3, 4, 5, 6, 7], sampling=sampling(max_tokens=4),
                                    destination=destination)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Prefill(request, timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
        assert "shut down" in caught.value.details()
        await check_down(stub, pool, "prefill")
