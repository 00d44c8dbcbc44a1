import pytest

from router.config import RouterConfig
from tests.router.harness import (BackgroundLoop, FakeDecodeWorker, FakePrefillWorker, RouterServer,
                                  tiny_tokenizer)

MODEL = "tiny"


@pytest.fixture(scope="session")
def loop():
    background = BackgroundLoop()
    yield background
    background.close()


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def decode(loop):
    worker = FakeDecodeWorker(loop).start()
    yield worker
    worker.stop()


@pytest.fixture
def prefills(loop):
    workers = [FakePrefillWorker(loop).start(), FakePrefillWorker(loop).start()]
    yield workers
    for worker in workers:
        worker.stop()


@pytest.fixture
def make_router(loop, tokenizer):
    """make_router(decode=[...], prefill=[...], **RouterConfig fields) -> a running RouterServer."""
    servers = []

    def make(**options) -> RouterServer:
        options.setdefault("stats_interval_s", 0.2)
        server = RouterServer(loop, RouterConfig(model=MODEL, **options), tokenizer)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def router(make_router, decode, prefills):
    """A router over two fake prefill workers and one fake decode worker."""
    return make_router(decode=[decode.address], prefill=[p.address for p in prefills])
