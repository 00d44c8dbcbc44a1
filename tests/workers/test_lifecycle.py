"""Aborts at every lifecycle state free every block on both workers; a prefill worker killed
during a transfer makes the decode worker fall back to local prefill, or fail cleanly.

The states are reached by observing worker stats, not by timing: a prefill worker that runs one
request at a time with a small token budget keeps a long prompt RUNNING (prefilling) and the next one
WAITING; one started with --hold-kv-send-s keeps a finished prefill in SENDING_KV (blocks pinned,
the decode worker WAITING_FOR_KV) for as long as the test needs.
"""
import random
import threading

import grpc
import pytest

import wire
from tests.helpers import free_port, wait_until
from tests.workers.harness import all_blocks_free, generate, kv_outcome, sampling, start_workers, stop_workers

pytestmark = pytest.mark.slow

HOLD = ["--hold-kv-send-s", "600"]
DECODE = ["--num-blocks", "256", "--transport", "tcp", "--local-prefill-threshold", "8"]


RESTART_PORT = free_port()


@pytest.fixture(scope="module")
def cluster():
    names = ["slow", "hold", "victim", "victim_fail", "restartable", "decode", "decode_fail", "decode_impatient"]
    workers = start_workers([
        ("prefill", ["--num-blocks", "256", "--max-num-seqs", "1", "--max-num-batched-tokens", "32"]),
        ("prefill", ["--num-blocks", "128"] + HOLD),
        ("prefill", ["--num-blocks", "64"] + HOLD),
        ("prefill", ["--num-blocks", "64"] + HOLD),
        ("prefill", ["--num-blocks", "64", "--port", str(RESTART_PORT)] + HOLD),
        ("decode", DECODE),
        ("decode", DECODE + ["--on-transfer-failure", "fail", "--transfer-timeout-s", "8"]),
        ("decode", DECODE + ["--transfer-timeout-s", "3"]),
    ])
    cluster = dict(zip(names, workers))
    yield cluster
    stop_workers(workers + [w for name, w in cluster.items() if name.startswith("restarted")])


def _live_workers(cluster):
    return [w for w in cluster.values() if w.process.poll() is None]


@pytest.fixture(autouse=True)
def no_blocks_held_after(cluster):
    yield
    for worker in _live_workers(cluster):
        wait_until(lambda: all_blocks_free(worker), what=f"{worker.grpc_address} to free every block")


def random_prompt(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


class Streaming:
    """A Generate call read on a background thread, so the test can act while it runs."""

    def __init__(self, decode, request_id, prompt, prefill=None, max_tokens=4000):
        request = wire.messages().GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling(max_tokens),
            prefill_address=prefill.grpc_address if prefill else "")
        self.decode = decode
        self.request_id = request_id
        self.call = decode.stub().Generate(request, timeout=300)
        self.chunks = []
        self.code = None
        self.first_chunk = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for chunk in self.call:
                self.chunks.append(chunk)
                self.first_chunk.set()
        except grpc.RpcError as exc:
            self.code = exc.code()

    def abort_rpc(self):
        response = self.decode.stub().Abort(wire.messages().AbortRequest(request_id=self.request_id), timeout=30)
        assert response.found
        return self.finish()

    def cancel(self):
        self.call.cancel()
        self.thread.join(60)
        assert self.code == grpc.StatusCode.CANCELLED
        return self

    def finish(self):
        self.thread.join(300)
        assert not self.thread.is_alive()
        return self

    @property
    def finish_reason(self):
        return self.chunks[-1].finish_reason if self.chunks else None


def _holding_export(prefill):
    """SENDING_KV: nothing queued or running on the prefill worker, yet blocks are pinned."""
    stats = prefill.stats()
    return stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_free < stats.kv_blocks_total


def test_abort_queued_and_prefilling_on_prefill_worker(cluster):
    decode, slow = cluster["decode"], cluster["slow"]
    long_one = Streaming(decode, "prefilling", random_prompt(1, 2000), slow)
    wait_until(lambda: slow.stats().running == 1, what="the long prompt to be RUNNING (prefilling)")
    queued = Streaming(decode, "queued", random_prompt(2, 300), slow)
    wait_until(lambda: slow.stats().waiting == 1, what="the second prompt to be WAITING behind it")
    assert queued.abort_rpc().finish_reason == "abort"
    assert slow.stats().running == 1  # still prefilling the long one
    long_one.cancel()
    assert not long_one.chunks


@pytest.mark.parametrize("how", ["abort_rpc", "cancel"])
def test_abort_while_transferring(cluster, how):
    decode, hold = cluster["decode"], cluster["hold"]
    stream = Streaming(decode, f"transferring-{how}", random_prompt(3 + len(how), 100), hold)
    wait_until(lambda: _holding_export(hold), what="the prefill worker to hold the export (SENDING_KV)")
    assert decode.stats().waiting == 1  # WAITING_FOR_KV, its blocks allocated
    assert decode.stats().kv_blocks_free < decode.stats().kv_blocks_total
    if how == "abort_rpc":
        assert stream.abort_rpc().finish_reason == "abort"
        assert [t for c in stream.chunks for t in c.token_ids] == []
    else:
        stream.cancel()


@pytest.mark.parametrize("how", ["abort_rpc", "cancel"])
def test_abort_while_decoding(cluster, how):
    decode, slow = cluster["decode"], cluster["slow"]
    stream = Streaming(decode, f"decoding-{how}", random_prompt(5 + len(how), 40), slow)
    assert stream.first_chunk.wait(120)
    # the first token went out as the prefill worker answered; the KV outcome follows
    wait_until(lambda: any(c.kv_transfer_seconds for c in stream.chunks), what="the KV outcome chunk")
    assert kv_outcome(stream.chunks).prefilled_remotely
    if how == "abort_rpc":
        assert stream.abort_rpc().finish_reason == "abort"
    else:
        stream.cancel()
    assert 0 < len([t for c in stream.chunks for t in c.token_ids]) < 4000


def test_abort_unknown_request_is_not_found(cluster):
    stub = cluster["decode"].stub()
    assert not stub.Abort(wire.messages().AbortRequest(request_id="never-seen"), timeout=30).found


def test_killed_prefill_worker_falls_back_to_local_prefill(cluster):
    decode, victim = cluster["decode"], cluster["victim"]
    prompt = random_prompt(9, 60)
    stream = Streaming(decode, "killed-fallback", prompt, victim, max_tokens=10)
    wait_until(lambda: _holding_export(victim), what="the victim to hold the export")
    victim.kill()
    stream.finish()
    assert stream.finish_reason == "length"
    assert not kv_outcome(stream.chunks, attempted=True).prefilled_remotely
    local = generate(decode, "local-reference", prompt, params=sampling(10))
    assert [t for c in stream.chunks for t in c.token_ids] == local.token_ids


def test_killed_prefill_worker_fails_the_request_in_fail_mode(cluster):
    decode, victim = cluster["decode_fail"], cluster["victim_fail"]
    stream = Streaming(decode, "killed-fail", random_prompt(10, 60), victim, max_tokens=10)
    wait_until(lambda: _holding_export(victim), what="the victim to hold the export")
    victim.kill()
    stream.finish()
    assert stream.finish_reason == "error"
    assert "remote prefill failed" in stream.chunks[-1].error
    assert [t for c in stream.chunks for t in c.token_ids] == []


def test_unreachable_prefill_worker_in_fail_mode(cluster):
    result = generate(cluster["decode_fail"], "unreachable", random_prompt(11, 60),
                      params=sampling(5), prefill=type("Dead", (), {"grpc_address": "127.0.0.1:1"})())
    assert result.finish_reason == "error"
    assert "UNAVAILABLE" in result.error


def test_timed_out_transfer_fails_cleanly_and_frees_both_sides(cluster):
    decode, hold = cluster["decode_fail"], cluster["hold"]
    result = generate(decode, "timed-out", random_prompt(12, 60), hold, params=sampling(5))
    assert result.finish_reason == "error"
    assert "remote prefill failed" in result.error
    assert "no KV arrived for 8 s" in result.error


def test_a_timed_out_remote_prefill_is_recomputed_and_the_prefill_side_cancelled_at_once(cluster):
    """Fallback mode: once the decode worker gives up waiting for KV it cancels the Prefill call, so
    a prefill worker that had only queued the prompt drops it rather than computing it for nobody."""
    decode, slow = cluster["decode_impatient"], cluster["slow"]
    long_one = Streaming(cluster["decode"], "blocking", random_prompt(16, 4000), slow)
    wait_until(lambda: slow.stats().running == 1, what="the long prompt to be RUNNING (prefilling)")
    queued = Streaming(decode, "timed-out-fallback", random_prompt(17, 60), slow, max_tokens=4000)
    assert queued.first_chunk.wait(120)  # after the 3 s timeout, prefilled by the decode worker
    assert not kv_outcome(queued.chunks, attempted=True).prefilled_remotely
    wait_until(lambda: slow.stats().waiting == 0, what="the prefill worker to drop the queued prompt")
    assert slow.stats().running == 1 and not long_one.chunks  # still prefilling the long one
    queued.cancel()
    long_one.cancel()


def test_a_prefill_worker_restarted_at_the_same_address_mid_transfer(cluster):
    """Killed while it holds a transfer: the decode worker recomputes (token-exact); restarted on
    the same port (a new process, a new epoch), it serves the next remote prefill."""
    decode, victim = cluster["decode"], cluster["restartable"]
    prompt = random_prompt(13, 60)
    stream = Streaming(decode, "restart-killed", prompt, victim, max_tokens=10)
    wait_until(lambda: _holding_export(victim), what="the prefill worker to hold the export")
    failures_before = sum(decode.stats().kv_transfer_failures.values())
    victim.kill()
    stream.finish()
    assert stream.finish_reason == "length" and not kv_outcome(stream.chunks, attempted=True).prefilled_remotely
    local = generate(decode, "restart-local", prompt, params=sampling(10))
    assert [t for c in stream.chunks for t in c.token_ids] == local.token_ids
    # whichever the decode worker saw first: the connection drop, or the failed Prefill call
    assert sum(decode.stats().kv_transfer_failures.values()) == failures_before + 1
    [restarted] = start_workers([("prefill", ["--num-blocks", "64", "--port", str(RESTART_PORT)])])
    cluster["restarted"] = restarted
    assert restarted.grpc_address == victim.grpc_address
    follow = random_prompt(14, 60)
    result = generate(decode, "restart-after", follow, restarted, params=sampling(10))
    assert result.kv_outcome.prefilled_remotely and result.finish_reason == "length"
    assert result.token_ids == generate(decode, "restart-after-local", follow, params=sampling(10)).token_ids
