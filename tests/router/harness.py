"""Test harness for the router: a background event loop hosting real grpc.aio fake workers and
a real uvicorn server, plus a tiny byte-level BPE tokenizer built in memory.

The fake decode worker implements `DecodeService` over real gRPC with scripted token streams
and a simulated KV block pool (blocks are taken at Generate and given back when the stream
ends, is cancelled or aborted), so tests can check through `/status` that a disconnect frees
blocks. The fake prefill worker only answers Health and Stats (the router never calls Prefill).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

import wire
from engine.step_times import STEP_TIME_BUCKETS
from tests.helpers import wait_until

BLOCK_SIZE = 16
TINY_CONTEXT = 512
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAINING_TEXT = ["The quick brown fox jumps over the lazy dog. Hello world, hello there!",
                 "Once upon a time, in a small village, there lived a curious cat.",
                 "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"] * 20


def tiny_tokenizer():
    """engine.tokenizer.Tokenizer over a byte-level BPE trained in memory (multibyte characters
    split into several tokens, like real byte-level vocabularies)."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from engine.tokenizer import Tokenizer

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rust.train_from_iterator(TRAINING_TEXT, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                 unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    return Tokenizer(hf, source="tiny-bpe", max_model_len=TINY_CONTEXT)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class BackgroundLoop:
    """An asyncio loop in a daemon thread; `run(coro)` runs a coroutine there and returns its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


# ---- scripted decode worker ---------------------------------------------------------------------

@dataclass
class Fail:
    """Script step: end the call with a gRPC status."""
    code: grpc.StatusCode
    message: str


@dataclass
class Hang:
    """Script step: wait until the request is aborted or cancelled (or `release` is set)."""
    release: asyncio.Event | None = None


@dataclass
class ActiveRequest:
    request_id: str
    num_blocks: int
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class FakeDecodeWorker:
    """DecodeService over real gRPC; `script(request) -> list of TokenChunk | Fail | Hang`."""

    def __init__(self, loop: BackgroundLoop, role: str = "decode", num_blocks: int = 64) -> None:
        self.loop = loop
        self.role = role
        self.num_blocks = num_blocks
        self.ok = True
        self.silent = False  # Health and Stats never answer (a hung worker)
        self.script: Callable[[Any], list] | None = None
        self.requests: list[Any] = []  # every GenerateRequest received
        self.cancelled: list[str] = []  # request ids whose stream the caller cancelled
        self.aborts: list[str] = []  # request ids named by Abort calls
        self.finished: list[str] = []  # request ids whose stream ended (any way)
        self.active: dict[str, ActiveRequest] = {}
        self.stats_calls = 0
        self.kv_transfer_failures: dict[str, int] = {}  # reported in Stats, by reason
        # reported in Stats: two decode steps of 30-40 ms and one above every bound
        counts = [0] * (len(STEP_TIME_BUCKETS) + 1)
        counts[STEP_TIME_BUCKETS.index(0.04)], counts[-1] = 2, 1
        self.step_times = wire.messages().StepTimes(kind="decode", bucket_counts=counts, sum_seconds=6.07)
        self.address = ""
        self._server: grpc.aio.Server | None = None

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - sum(r.num_blocks for r in self.active.values())

    def start(self) -> "FakeDecodeWorker":
        self.loop.run(self._start())
        return self

    async def _start(self) -> None:
        _, services = wire.load()
        outer = self

        class Servicer(services.DecodeServiceServicer):
            async def Generate(self, request, context):
                async for chunk in outer._generate(request, context):
                    yield chunk

            async def Abort(self, request, context):
                return await outer._abort(request)

            async def Health(self, request, context):
                await outer._hang_if_silent()
                return outer._health()

            async def Stats(self, request, context):
                await outer._hang_if_silent()
                return outer._stats()

        self._server = grpc.aio.server()
        services.add_DecodeServiceServicer_to_server(Servicer(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self.loop.run(self._server.stop(grace=None))
            self._server = None

    async def _generate(self, request, context):
        pb = wire.messages()
        self.requests.append(request)
        num_blocks = math.ceil((len(request.prompt_token_ids) + request.sampling.max_tokens) / BLOCK_SIZE)
        if num_blocks > self.free_blocks:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of KV blocks")
        state = ActiveRequest(request.request_id, num_blocks)
        self.active[request.request_id] = state
        steps = self.script(request) if self.script is not None else default_script(request)
        try:
            for step in steps:
                if state.aborted.is_set():
                    yield pb.TokenChunk(finish_reason="abort")
                    return
                if isinstance(step, Fail):
                    await context.abort(step.code, step.message)
                elif isinstance(step, Hang):
                    waits = [asyncio.ensure_future(state.aborted.wait())]
                    if step.release is not None:
                        waits.append(asyncio.ensure_future(step.release.wait()))
                    try:
                        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for wait in waits:
                            wait.cancel()
                else:
                    yield step
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.active.pop(request.request_id, None)
            self.finished.append(request.request_id)

    async def _abort(self, request):
        self.aborts.append(request.request_id)
        state = self.active.get(request.request_id)
        if state is not None:
            state.aborted.set()
        return wire.messages().AbortResponse(found=state is not None)

    async def _hang_if_silent(self) -> None:
        while self.silent:
            await asyncio.sleep(0.05)

    def _health(self):
        return wire.messages().HealthResponse(ok=self.ok, role=self.role, model="tiny", transport_address="fake://")

    def _stats(self):
        self.stats_calls += 1
        free = self.free_blocks
        return wire.messages().WorkerStats(role=self.role, running=len(self.active), waiting=0,
                                           kv_blocks_total=self.num_blocks, kv_blocks_free=free,
                                           kv_blocks_cached=3, prefix_cache_queries=100, prefix_cache_hits=25,
                                           block_size=BLOCK_SIZE, kv_transfer_failures=self.kv_transfer_failures,
                                           rss_bytes=3 << 30, weight_bytes=1 << 30, spec_drafts=10,
                                           spec_draft_tokens=40, spec_accepted_tokens=30,
                                           step_times=[self.step_times])


class FakePrefillWorker:
    """PrefillService Health/Stats over real gRPC (the decode worker, not the router, calls Prefill)."""

    def __init__(self, loop: BackgroundLoop, queued_tokens: int = 0) -> None:
        self.loop = loop
        self.ok = True
        self.queued_tokens = queued_tokens
        self.address = ""
        self._server: grpc.aio.Server | None = None

    def start(self) -> "FakePrefillWorker":
        self.loop.run(self._start())
        return self

    async def _start(self) -> None:
        pb, services = wire.load()
        outer = self

        class Servicer(services.PrefillServiceServicer):
            async def Health(self, request, context):
                return pb.HealthResponse(ok=outer.ok, role="prefill", model="tiny", transport_address="fake://")

            async def Stats(self, request, context):
                return pb.WorkerStats(role="prefill", kv_blocks_total=64, kv_blocks_free=64,
                                      prefill_tokens_queued=outer.queued_tokens, block_size=BLOCK_SIZE)

        self._server = grpc.aio.server()
        services.add_PrefillServiceServicer_to_server(Servicer(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self.loop.run(self._server.stop(grace=None))
            self._server = None


def token_chunks(token_ids: list[int], finish_reason: str, num_cached_tokens: int = 0, kv_bytes: int = 0,
                 logprobs: bool = False, per_chunk: int = 1, kv_failure_reason: str = "") -> list:
    """A stream sending `token_ids` `per_chunk` at a time, the last chunk with `finish_reason`;
    the first says how the KV came: `kv_bytes` from a prefill worker, or a failed transfer
    (`kv_failure_reason`) then a local prefill."""
    pb = wire.messages()
    chunks = []
    groups = [token_ids[i:i + per_chunk] for i in range(0, len(token_ids), per_chunk)] or [[]]
    for index, group in enumerate(groups):
        chunk = pb.TokenChunk(token_ids=group, num_cached_tokens=num_cached_tokens,
                              finish_reason=finish_reason if index == len(groups) - 1 else "")
        if index == 0:
            chunk.kv_bytes_received = kv_bytes
            chunk.kv_transfer_seconds = 0.25 if kv_bytes else 0.0
            chunk.prefilled_remotely = bool(kv_bytes) and not kv_failure_reason
            chunk.kv_failure_reason = kv_failure_reason
        if logprobs:
            for position, token in enumerate(group):
                entry = chunk.logprobs.add(token_id=token, logprob=-0.5 - position)
                entry.top.add(token_id=token, logprob=-0.5 - position)
                entry.top.add(token_id=(token + 1) % 256, logprob=-3.0)
        chunks.append(chunk)
    return chunks


def default_script(request) -> list:
    """Echo the prompt's tokens back (wrapping), up to max_tokens: finish "length"."""
    prompt = list(request.prompt_token_ids)
    count = request.sampling.max_tokens
    return token_chunks([prompt[i % len(prompt)] for i in range(count)], "length")


def reply_script(tokenizer, text: str, eos: bool = True, **options) -> Callable[[Any], list]:
    """Stream `text`'s tokens (then EOS, finish "stop"); cut at max_tokens with finish "length"."""
    reply = tokenizer.encode(text, add_special_tokens=False)
    eos_id = min(tokenizer.eos_token_ids)

    def script(request) -> list:
        tokens = reply + ([eos_id] if eos else [])
        limit = request.sampling.max_tokens
        if len(tokens) > limit:
            return token_chunks(tokens[:limit], "length", logprobs=request.sampling.HasField("logprobs"), **options)
        return token_chunks(tokens, "stop", logprobs=request.sampling.HasField("logprobs"), **options)

    return script


class RouterServer:
    """`create_app(config, tokenizer)` served by uvicorn on a free 127.0.0.1 port in the loop."""

    def __init__(self, loop: BackgroundLoop, config, tokenizer) -> None:
        import uvicorn

        from router.app import create_app

        self.loop = loop
        self.app = create_app(config, tokenizer=tokenizer)
        self.state = self.app.state.router
        sock = free_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self._task = loop.submit(self._serve(sock))
        wait_until(lambda: self._server.started or self._task.done(), timeout=30, what="the router to start")
        if self._task.done():
            self._task.result()

    async def _serve(self, sock) -> None:
        try:
            await self._server.serve(sockets=[sock])
        except SystemExit as exc:  # uvicorn exits on a startup failure; keep the loop thread alive
            raise RuntimeError(f"the router failed to start (exit {exc.code})") from None

    def stop(self) -> None:
        self._server.should_exit = True
        self._task.result(30)
