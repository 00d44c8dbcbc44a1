"""Worker processes for tests: start `python -m prefill_worker` / `python -m decode_worker` as
subprocesses on 127.0.0.1 with free ports, parse their ready line, stop them."""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import grpc

import wire
from tests.helpers import REPO, kill_process, start_python, stop_process

READY_TIMEOUT_S = 240.0
COMMON = ["--model", "default", "--host", "127.0.0.1", "--port", "0", "--block-size", "16"]


@dataclass
class WorkerProcess:
    kind: str  # "prefill" or "decode"
    process: subprocess.Popen
    grpc_address: str
    transport_address: str
    log: list[str]

    def stub(self):
        channel = grpc.insecure_channel(self.grpc_address)
        services = wire.services()
        return services.PrefillServiceStub(channel) if self.kind == "prefill" else services.DecodeServiceStub(channel)

    def stats(self):
        return self.stub().Stats(wire.messages().StatsRequest(), timeout=30)

    def kill(self) -> None:
        kill_process(self.process, 30)

    def stop(self, terminate: bool = True) -> None:
        """SIGTERM (once: a second one during the graceful stop would kill it), wait, then SIGKILL."""
        stop_process(self.process, 30, signal.SIGTERM if terminate else None)


def _launch(kind: str, args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return start_python(["-m", f"{kind}_worker", *COMMON, *args], env)


def _wait_ready(kind: str, process: subprocess.Popen) -> WorkerProcess:
    log: list[str] = []
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not selector.select(timeout=1.0):
            if process.poll() is not None:
                break
            continue
        line = process.stdout.readline()
        if not line:
            break
        log.append(line)
        if line.startswith("READY "):
            fields = dict(part.split("=", 1) for part in line.split()[1:])
            selector.close()
            worker = WorkerProcess(kind, process, fields["grpc"], fields["transport"], log)
            threading.Thread(target=_drain, args=(process, log), daemon=True).start()
            return worker
    process.kill()
    raise RuntimeError(f"{kind} worker did not become ready:\n{''.join(log[-40:])}")


def _drain(process: subprocess.Popen, log: list[str]) -> None:
    for line in process.stdout:
        log.append(line)


def start_workers(specs: list[tuple[str, list[str]]]) -> list[WorkerProcess]:
    """Start several workers at once (they load the model in parallel); wait for all."""
    processes = [(kind, _launch(kind, args)) for kind, args in specs]
    workers = []
    try:
        for kind, process in processes:
            workers.append(_wait_ready(kind, process))
    except BaseException:
        for _, process in processes:
            process.kill()
        raise
    return workers


def stop_workers(workers: list[WorkerProcess]) -> None:
    """Stop every worker with SIGTERM; then check that each one still running exited cleanly and
    none logged a traceback (an unhandled error in a handler)."""
    running = [worker for worker in workers if worker.process.poll() is None]
    for worker in running:
        worker.process.terminate()
    for worker in workers:
        worker.stop(terminate=False)
    for worker in running:
        assert worker.process.returncode == 0, f"{worker.kind} worker exited with {worker.process.returncode}"
    for worker in workers:
        text = "".join(worker.log)
        assert "Traceback" not in text, f"{worker.kind} worker {worker.grpc_address} logged an error:\n{text[-4000:]}"


def sampling(max_tokens: int = 12, temperature: float = 0.0, seed: int | None = None, logprobs: int | None = None,
             **overrides):
    """A complete wire SamplingParams (the router always sends every field)."""
    fields = dict(max_tokens=max_tokens, temperature=temperature, top_p=1.0, top_k=-1, min_p=0.0,
                  presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, ignore_eos=True)
    fields.update(overrides)
    message = wire.messages().SamplingParams(**fields)
    if seed is not None:
        message.seed = seed
    if logprobs is not None:
        message.logprobs = logprobs
    return message


@dataclass
class Generation:
    token_ids: list
    chunks: list
    finish_reason: str
    error: str

    @property
    def kv_outcome(self):
        return kv_outcome(self.chunks)


def kv_outcome(chunks: list, attempted: bool = False):
    """The chunk that says how a request got its KV: the one with a transfer's time (after the
    first token when the decode worker streamed the prefill worker's as it answered), else the
    first (a local prefill). `attempted`: a remote prefill was tried, so that chunk must be there."""
    found = next((chunk for chunk in chunks if chunk.kv_transfer_seconds), None)
    assert found is not None or not attempted, "no chunk says how the KV transfer ended"
    return found if found is not None else chunks[0]


def generate(decode: WorkerProcess, request_id: str, prompt: list[int], prefill: WorkerProcess | None = None,
             params=None, timeout: float = 300.0, num_resumed_tokens: int = 0) -> Generation:
    request = wire.messages().GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                              sampling=params or sampling(),
                                              prefill_address=prefill.grpc_address if prefill else "",
                                              num_resumed_tokens=num_resumed_tokens)
    chunks = list(decode.stub().Generate(request, timeout=timeout))
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    return Generation(tokens, chunks, chunks[-1].finish_reason, chunks[-1].error)


def all_blocks_free(worker: WorkerProcess) -> bool:
    stats = worker.stats()
    return stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0 and stats.waiting == 0
