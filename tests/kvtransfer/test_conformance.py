"""One conformance suite, run against every transport available in this process.

Senders (or receivers) live in spawned processes where the scenario needs a real peer: the
byte-exact, layer-wise, concurrency, cancel and dead/silent peer tests.
"""
from __future__ import annotations

import multiprocessing.resource_tracker
import random

import pytest

from kvtransfer import KVLayout, LayoutMismatchError, TransferConfig, TransferState, create_receiver, create_sender
from ..helpers import eventually

from .peer import (SENTINEL, CacheSpec, PeerError, PeerProcess, is_sentinel,
                   kvtransfer_thread_stacks, kvtransfer_threads, open_fd_count, same_bytes,
                   sentinel_caches, source_caches)

from .variants import options, transport, variant  # noqa: F401 (fixtures: every transport variant)
SPEC = CacheSpec()
SEED = 1234
TIMEOUT_S = 3.0  # dead/silent peer timeout of the long-lived pairs
SHORT_TIMEOUT_S = 1.0  # for the dead/silent peer tests
GUARD_S = 60.0  # hang guard for waits; never a performance bound
# sliding windows as in Gemma 3 (5 windowed layers, then a full one), 2 blocks per window here
WINDOWS = ([2 * SPEC.block_size] * 5 + [0]) * (SPEC.num_layers // 6)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # starts processes


@pytest.fixture(scope="module")
def sender_options(variant, options):
    """PeerProcess options of a sender peer: the config fields, plus shared caches for shm-mapped."""
    return dict(options, shared_source=True) if variant == "shm-mapped" else options


@pytest.fixture(scope="module")
def source():
    return source_caches(SPEC, SEED)


@pytest.fixture(scope="module")
def sender_peer(transport, sender_options):
    peer = PeerProcess("sender", transport, SPEC, SEED, timeout_s=TIMEOUT_S, **sender_options)
    yield peer
    peer.close()


def _sentinel_receiver(transport, options, layer_windows=()):
    caches = sentinel_caches(SPEC)
    receiver = create_receiver(transport, caches, TransferConfig(timeout_s=TIMEOUT_S, **options),
                               layer_windows=layer_windows)
    receiver.caches = caches
    return receiver


def _reset(receiver):
    for cache in receiver.caches:
        cache.fill_(SENTINEL)
    return receiver


@pytest.fixture(scope="module")
def shared_receiver(transport, options):
    receiver = _sentinel_receiver(transport, options)
    yield receiver
    receiver.close()


@pytest.fixture
def receiver(shared_receiver):
    """The module's receiver (one per transport: set-up is slow), its caches reset."""
    yield _reset(shared_receiver)


@pytest.fixture(scope="module")
def windowed_sender_peer(transport, sender_options):
    peer = PeerProcess("sender", transport, SPEC, SEED, timeout_s=TIMEOUT_S, layer_windows=WINDOWS,
                       **sender_options)
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def shared_windowed_receiver(transport, options):
    receiver = _sentinel_receiver(transport, options, WINDOWS)
    yield receiver
    receiver.close()


@pytest.fixture
def windowed_receiver(shared_windowed_receiver):
    """The module's receiver with sliding-window layers, its caches reset."""
    yield _reset(shared_windowed_receiver)


def random_blocks(rng: random.Random, count: int) -> tuple[list[int], list[int]]:
    return (rng.sample(range(SPEC.num_blocks), count), rng.sample(range(SPEC.num_blocks), count))


def assert_arrived(receiver, source, src_ids, dst_ids, layers) -> None:
    for layer in layers:
        for src, dst in zip(src_ids, dst_ids):
            assert same_bytes(receiver.caches[layer][dst], source[layer][src]), (layer, src, dst)


def assert_untouched(receiver, dst_ids, layers) -> None:
    for layer in layers:
        for dst in dst_ids:
            assert is_sentinel(receiver.caches[layer][dst]), (layer, dst)


def test_random_noncontiguous_blocks_arrive_byte_exact(receiver, sender_peer, source):
    src_ids, dst_ids = random_blocks(random.Random(1), 20)
    receiver.expect("exact", dst_ids)
    assert receiver.poll("exact").state is TransferState.PENDING
    sender_peer.call("send", "exact", receiver.address, src_ids, dst_ids)

    received = receiver.wait("exact", GUARD_S)
    sent = sender_peer.call("wait", "exact", GUARD_S)
    expected_bytes = SPEC.num_layers * len(src_ids) * SPEC.chunk_nbytes
    assert received.state is TransferState.SUCCESS, received.error
    assert sent.state is TransferState.SUCCESS, sent.error
    assert received.bytes_transferred == sent.bytes_transferred == expected_bytes
    assert received.layers_done == SPEC.num_layers
    assert receiver.total_bytes_received == expected_bytes
    assert_arrived(receiver, source, src_ids, dst_ids, range(SPEC.num_layers))
    others = [block for block in range(SPEC.num_blocks) if block not in dst_ids]
    assert_untouched(receiver, others, range(SPEC.num_layers))
    sender_peer.call("cancel", "exact")
    receiver.cancel("exact")


def test_each_shm_variant_runs_on_its_own_data_path(receiver, sender_peer, variant, transport):
    """The shm variants must not silently share one path: after a transfer, the receiver's
    connection from the peer reports ring, cma (when the OS permits it) or mapped."""
    if transport != "shm":
        pytest.skip("shm only")
    from kvtransfer.transports import _cma
    receiver.expect("path", [5])
    sender_peer.call("send", "path", receiver.address, [4], [5])
    assert receiver.wait("path", GUARD_S).ok
    modes = {connection.channel.mode for connection in receiver._connections}
    expected = {"shm": "ring", "shm-cma": "cma" if _cma.available() else "ring", "shm-mapped": "mapped"}[variant]
    assert expected in modes, modes
    sender_peer.call("cancel", "path")
    receiver.cancel("path")


def _on_ucx_same_host_path(receiver) -> bool:
    """Whether every ucx connection of `receiver` sends payloads over the same-host endpoint
    (UCX's cma path); expected wherever cross-memory reads are possible, as here."""
    return all(connection.channel.same_host_fast_path for connection in receiver._connections)


def test_ucx_payloads_take_the_same_host_path(receiver, sender_peer, transport):
    """ucx between two processes of one host with CPU caches: payloads on the endpoint UCX
    can put on its shared-memory transports, not on the control endpoint's TCP."""
    if transport != "ucx":
        pytest.skip("ucx only")
    from kvtransfer.transports import _cma
    receiver.expect("local", [5])
    sender_peer.call("send", "local", receiver.address, [4], [5])
    assert receiver.wait("local", GUARD_S).ok
    assert _on_ucx_same_host_path(receiver) == _cma.available()
    sender_peer.call("cancel", "local")
    receiver.cancel("local")


def test_layerwise_streaming_arrives_byte_exact_in_order(receiver, sender_peer, source):
    src_ids, dst_ids = random_blocks(random.Random(2), 12)
    receiver.expect("layers", dst_ids)
    sender_peer.call("start", "layers", receiver.address, src_ids, dst_ids)
    groups = [range(start, start + 10) for start in range(0, SPEC.num_layers, 10)]
    for number, group in enumerate(groups):
        sender_peer.call("send_layers", "layers", list(group))
        assert receiver.wait_layer("layers", group[-1], GUARD_S)
        assert receiver.layers_ready("layers") == group[-1] + 1
        assert_arrived(receiver, source, src_ids, dst_ids, group)
        if number < len(groups) - 1:
            assert receiver.poll("layers").state is TransferState.TRANSFERRING
            assert_untouched(receiver, dst_ids, range(group[-1] + 1, SPEC.num_layers))
    assert receiver.wait("layers", GUARD_S).state is TransferState.SUCCESS
    assert sender_peer.call("wait", "layers", GUARD_S).state is TransferState.SUCCESS
    assert_arrived(receiver, source, src_ids, dst_ids, range(SPEC.num_layers))
    sender_peer.call("cancel", "layers")


def test_subset_of_layers_in_any_order(receiver, sender_peer, source):
    src_ids, dst_ids = random_blocks(random.Random(3), 5)
    layers = [17, 3, 4, 29]
    receiver.expect("subset", dst_ids, layers=layers)
    sender_peer.call("start", "subset", receiver.address, src_ids, dst_ids, layers=layers)
    sender_peer.call("send_layers", "subset", [4, 29])
    assert receiver.wait_layer("subset", 29, GUARD_S)
    assert receiver.layers_ready("subset") == 0  # layer 17, expected first, is still missing
    sender_peer.call("send_layers", "subset", [17, 3])
    assert receiver.wait("subset", GUARD_S).state is TransferState.SUCCESS
    assert receiver.layers_ready("subset") == 4
    assert_arrived(receiver, source, src_ids, dst_ids, layers)
    others = [layer for layer in range(SPEC.num_layers) if layer not in layers]
    assert_untouched(receiver, dst_ids, others)
    sender_peer.call("cancel", "subset")


def window_skips(num_blocks: int) -> list[int]:
    """Per cache layer, leading blocks not moved: 0 for full-attention layers, a spread from 0
    to num_blocks - 1 (only the last block moves) for windowed ones."""
    return [(layer * 5) % num_blocks if window else 0 for layer, window in enumerate(WINDOWS)]


def moved_bytes(num_blocks: int, skips, end: int | None = None) -> int:
    """Bytes of the chunks a transfer with `skips` moves, counting blocks below `end` only."""
    end = num_blocks if end is None else end
    return sum(max(0, end - skip) for skip in skips) * SPEC.chunk_nbytes


def assert_moved_unless_skipped(receiver, source, src_ids, dst_ids, skips, end: int | None = None) -> None:
    """Per layer: blocks [skip, end) equal the source, the skipped ones and those from `end` on keep
    the sentinel."""
    end = len(src_ids) if end is None else end
    for layer, skip in enumerate(skips):
        assert_untouched(receiver, dst_ids[:skip], [layer])
        assert_arrived(receiver, source, src_ids[skip:end], dst_ids[skip:end], [layer])
        assert_untouched(receiver, dst_ids[max(skip, end):], [layer])


def test_skipped_blocks_are_not_moved(windowed_receiver, windowed_sender_peer, source):
    receiver = windowed_receiver
    src_ids, dst_ids = random_blocks(random.Random(11), 12)
    skips = window_skips(12)
    before = receiver.total_bytes_received
    receiver.expect("skips", dst_ids, skip_blocks=skips)
    windowed_sender_peer.call("send", "skips", receiver.address, src_ids, dst_ids, skip_blocks=skips)
    received = receiver.wait("skips", GUARD_S)
    sent = windowed_sender_peer.call("wait", "skips", GUARD_S)
    assert received.state is TransferState.SUCCESS, received.error
    assert sent.state is TransferState.SUCCESS, sent.error
    assert received.bytes_transferred == sent.bytes_transferred == moved_bytes(12, skips)
    assert receiver.total_bytes_received - before == moved_bytes(12, skips)
    assert received.layers_done == SPEC.num_layers and receiver.layers_ready("skips") == SPEC.num_layers
    assert_moved_unless_skipped(receiver, source, src_ids, dst_ids, skips)
    others = [block for block in range(SPEC.num_blocks) if block not in dst_ids]
    assert_untouched(receiver, others, range(SPEC.num_layers))
    windowed_sender_peer.call("cancel", "skips")
    receiver.cancel("skips")


def test_layerwise_block_steps_with_skips(windowed_receiver, windowed_sender_peer, source):
    """Prompt chunks of 3 blocks pushed for every layer: a layer whose skip covers a whole step
    pushes nothing in it, and each layer moves exactly its blocks from its skip on."""
    receiver = windowed_receiver
    src_ids, dst_ids = random_blocks(random.Random(12), 12)
    skips = window_skips(12)
    receiver.expect("steps", dst_ids, skip_blocks=skips)
    windowed_sender_peer.call("start", "steps", receiver.address, src_ids, dst_ids, skip_blocks=skips)
    for end in (3, 6, 9):
        assert any(skip >= end for skip in skips)  # some layers have nothing in this step
        windowed_sender_peer.call("send_layers", "steps", range(SPEC.num_layers), num_blocks=end)
        assert eventually(lambda: receiver.poll("steps").bytes_transferred == moved_bytes(12, skips, end))
        assert_moved_unless_skipped(receiver, source, src_ids, dst_ids, skips, end)
        assert receiver.layers_ready("steps") == 0
    windowed_sender_peer.call("send_layers", "steps", range(0, 15))  # the last step, in two layer groups
    assert receiver.wait_layer("steps", 14, GUARD_S)
    assert eventually(lambda: receiver.layers_ready("steps") == 15)
    assert not receiver.wait_layer("steps", 15, 0.0)
    windowed_sender_peer.call("send_layers", "steps", range(15, SPEC.num_layers))
    received = receiver.wait("steps", GUARD_S)
    sent = windowed_sender_peer.call("wait", "steps", GUARD_S)
    assert received.state is TransferState.SUCCESS and sent.state is TransferState.SUCCESS
    assert received.bytes_transferred == sent.bytes_transferred == moved_bytes(12, skips)
    assert receiver.layers_ready("steps") == SPEC.num_layers
    assert_moved_unless_skipped(receiver, source, src_ids, dst_ids, skips)
    windowed_sender_peer.call("cancel", "steps")
    receiver.cancel("steps")


def test_skips_that_differ_fail_both_sides_naming_both(windowed_receiver, windowed_sender_peer):
    receiver = windowed_receiver
    src_ids, dst_ids = random_blocks(random.Random(13), 6)
    expected, sent_skips = window_skips(6), window_skips(6)
    sent_skips[1] = 0 if expected[1] else 1
    receiver.expect("skipdiff", dst_ids, skip_blocks=expected)
    windowed_sender_peer.call("send", "skipdiff", receiver.address, src_ids, dst_ids, skip_blocks=sent_skips)
    sent = windowed_sender_peer.call("wait", "skipdiff", GUARD_S)
    received = receiver.wait("skipdiff", GUARD_S)
    for status in (sent, received):
        assert status.state is TransferState.FAILED
        assert "skip_blocks differ" in status.error
        assert str(sent_skips) in status.error and str(expected) in status.error
    assert_untouched(receiver, dst_ids, range(SPEC.num_layers))
    windowed_sender_peer.call("cancel", "skipdiff")
    receiver.cancel("skipdiff")


def test_bad_skips_are_refused(windowed_receiver, windowed_sender_peer):
    receiver = windowed_receiver
    good = window_skips(4)
    full_layer = WINDOWS.index(0)
    cases = [(good[:-1], "29 entries"), ([*good[:1], 4, *good[2:]], r"skip_blocks\[1\] is 4"),
             ([-1, *good[1:]], r"skip_blocks\[0\] is -1"),
             ([1 if layer == full_layer else skip for layer, skip in enumerate(good)],
              f"layer {full_layer} has full attention")]
    for skips, message in cases:
        with pytest.raises(ValueError, match=message):
            receiver.expect("bad", [0, 1, 2, 3], skip_blocks=skips)
        with pytest.raises(PeerError, match=message) as raised:
            windowed_sender_peer.call("start", "bad", receiver.address, [0, 1, 2, 3], [0, 1, 2, 3],
                                      skip_blocks=skips)
        assert raised.value.type_name == "ValueError"
    with pytest.raises(KeyError):
        receiver.poll("bad")


def test_windows_that_differ_are_refused_naming_both_layouts(windowed_receiver, transport, options):
    other = [2 * SPEC.block_size] * (SPEC.num_layers - 1) + [0]
    sender = create_sender(transport, source_caches(SPEC, 0), TransferConfig(timeout_s=TIMEOUT_S, **options),
                           layer_windows=other)
    try:
        with pytest.raises(LayoutMismatchError) as raised:
            sender.connect(windowed_receiver.address)
        message = str(raised.value)
        assert sender.layout.describe() in message and windowed_receiver.layout.describe() in message
        assert "windows=[32x29, full]" in message and "windows=[32x5, full, 32x5," in message
    finally:
        sender.close()


def test_mismatched_layout_is_refused_naming_both(receiver, transport, options):
    other = CacheSpec(head_dim=32)
    sender = create_sender(transport, source_caches(other, 0), TransferConfig(timeout_s=TIMEOUT_S, **options))
    try:
        with pytest.raises(LayoutMismatchError) as raised:
            sender.connect(receiver.address)
        message = str(raised.value)
        assert "head_dim=32" in message and "head_dim=64" in message
        assert KVLayout.from_caches(receiver.caches).describe() in message

        receiver.expect("mismatch", [0, 1])
        sender.send("mismatch", receiver.address, [0, 1], [0, 1])
        status = sender.wait("mismatch", GUARD_S)
        assert status.state is TransferState.FAILED
        assert "layout mismatch" in status.error and "head_dim=32" in status.error
        assert receiver.poll("mismatch").state is TransferState.PENDING
        assert_untouched(receiver, [0, 1], range(SPEC.num_layers))
    finally:
        sender.close()


def test_cancel_while_pending_drops_the_late_transfer(receiver, sender_peer):
    src_ids, dst_ids = random_blocks(random.Random(4), 8)
    receiver.expect("late", dst_ids)
    receiver.cancel("late")
    with pytest.raises(KeyError):
        receiver.poll("late")
    sender_peer.call("send", "late", receiver.address, src_ids, dst_ids)
    status = sender_peer.call("wait", "late", GUARD_S)
    assert status.state is TransferState.FAILED
    assert "cancelled by the receiver" in status.error
    assert_untouched(receiver, dst_ids, range(SPEC.num_layers))
    sender_peer.call("cancel", "late")


def test_cancel_while_transferring_stops_writes(receiver, sender_peer, source):
    src_ids, dst_ids = random_blocks(random.Random(5), 8)
    receiver.expect("midway", dst_ids)
    sender_peer.call("start", "midway", receiver.address, src_ids, dst_ids)
    sender_peer.call("send_layers", "midway", range(0, 10))
    assert receiver.wait_layer("midway", 9, GUARD_S)
    assert receiver.poll("midway").state is TransferState.TRANSFERRING
    receiver.cancel("midway")
    sender_peer.call("send_layers", "midway", range(10, SPEC.num_layers))
    status = sender_peer.call("wait", "midway", GUARD_S)
    assert status.state is TransferState.FAILED
    assert "cancelled by the receiver" in status.error
    assert_arrived(receiver, source, src_ids, dst_ids, range(0, 10))
    assert_untouched(receiver, dst_ids, range(10, SPEC.num_layers))
    sender_peer.call("cancel", "midway")

    # the same request id can be expected again and succeeds cleanly
    receiver.expect("midway", dst_ids)
    sender_peer.call("send", "midway", receiver.address, src_ids, dst_ids)
    assert receiver.wait("midway", GUARD_S).state is TransferState.SUCCESS
    assert_arrived(receiver, source, src_ids, dst_ids, range(SPEC.num_layers))
    sender_peer.call("cancel", "midway")


def test_cancel_after_success_and_after_failure_forgets(receiver, sender_peer):
    src_ids, dst_ids = random_blocks(random.Random(6), 4)
    receiver.expect("done", dst_ids)
    sender_peer.call("send", "done", receiver.address, src_ids, dst_ids)
    assert receiver.wait("done", GUARD_S).state is TransferState.SUCCESS
    assert sender_peer.call("wait", "done", GUARD_S).state is TransferState.SUCCESS
    receiver.cancel("done")
    sender_peer.call("cancel", "done")
    with pytest.raises(KeyError):
        receiver.poll("done")
    with pytest.raises(PeerError, match="unknown request id"):
        sender_peer.call("poll", "done")
    receiver.cancel("done")  # idempotent

    # sender cancels midway -> the receiver's transfer fails; then cancel forgets it
    receiver.expect("gave-up", dst_ids)
    sender_peer.call("start", "gave-up", receiver.address, src_ids, dst_ids)
    sender_peer.call("send_layers", "gave-up", [0])
    assert receiver.wait_layer("gave-up", 0, GUARD_S)
    sender_peer.call("cancel", "gave-up")
    status = receiver.wait("gave-up", GUARD_S)
    assert status.state is TransferState.FAILED and "sender gave up" in status.error
    receiver.cancel("gave-up")
    with pytest.raises(KeyError):
        receiver.poll("gave-up")


def test_sender_cancel_before_any_data(receiver, sender_peer):
    receiver.expect("early", [1, 2])
    sender_peer.call("start", "early", receiver.address, [3, 4], [1, 2])
    sender_peer.call("cancel", "early")
    with pytest.raises(PeerError, match="unknown request id"):
        sender_peer.call("poll", "early")
    status = receiver.wait("early", GUARD_S)
    assert status.state is TransferState.FAILED and "sender gave up" in status.error
    assert_untouched(receiver, [1, 2], range(SPEC.num_layers))
    receiver.cancel("early")


def test_concurrent_transfers_from_two_senders_do_not_mix(receiver, sender_peer, source, transport, options):
    rng = random.Random(7)
    local_seed = SEED + 1
    local_source = source_caches(SPEC, local_seed)
    local = create_sender(transport, local_source, TransferConfig(timeout_s=TIMEOUT_S, **options))
    try:
        dst_pool = rng.sample(range(SPEC.num_blocks), 40)
        requests = []
        for number in range(8):
            src_ids = rng.sample(range(SPEC.num_blocks), 5)
            dst_ids = dst_pool[number * 5:(number + 1) * 5]
            remote = number % 2 == 0
            requests.append((f"mix-{number}", src_ids, dst_ids, remote))
            receiver.expect(f"mix-{number}", dst_ids)
        for request_id, src_ids, dst_ids, remote in requests:
            if remote:
                sender_peer.call("start", request_id, receiver.address, src_ids, dst_ids)
            else:
                local.start(request_id, receiver.address, src_ids, dst_ids)
        for start in range(0, SPEC.num_layers, 6):
            for request_id, _, _, remote in requests:
                layers = list(range(start, start + 6))
                if remote:
                    sender_peer.call("send_layers", request_id, layers)
                else:
                    local.send_layers(request_id, layers)
        for request_id, src_ids, dst_ids, remote in requests:
            status = receiver.wait(request_id, GUARD_S)
            assert status.state is TransferState.SUCCESS, status.error
            assert_arrived(receiver, source if remote else local_source, src_ids, dst_ids,
                           range(SPEC.num_layers))
            receiver.cancel(request_id)
            if remote:
                assert sender_peer.call("wait", request_id, GUARD_S).ok
                sender_peer.call("cancel", request_id)
            else:
                assert local.wait(request_id, GUARD_S).ok
                local.cancel(request_id)
        untouched = [block for block in range(SPEC.num_blocks) if block not in dst_pool]
        assert_untouched(receiver, untouched, range(SPEC.num_layers))
    finally:
        local.close()


def _baseline(transport):
    """Thread names and open fds before the scenario; transports with process-wide state
    (ucx, gloo) are warmed up first so only our own resources are counted."""
    multiprocessing.resource_tracker.ensure_running()  # spawn starts it once per process
    if transport in ("ucx", "nccl"):
        caches = sentinel_caches(CacheSpec(num_layers=1, num_blocks=2))
        with create_receiver(transport, caches) as warm_receiver:
            with create_sender(transport, source_caches(CacheSpec(num_layers=1, num_blocks=2), 0)) as s:
                warm_receiver.expect("warm", [0])
                s.send("warm", warm_receiver.address, [1], [0])
                assert warm_receiver.wait("warm", GUARD_S).ok
    return kvtransfer_threads(), open_fd_count()


def _assert_nothing_leaked(baseline) -> None:
    threads, fds = baseline
    assert eventually(lambda: kvtransfer_threads() == threads), \
        f"{kvtransfer_threads()} after, {threads} before:\n{kvtransfer_thread_stacks()}"
    assert eventually(lambda: open_fd_count() <= fds), (open_fd_count(), fds)


def test_killed_sender_fails_the_transfer_and_nothing_leaks(transport, options, sender_options):
    baseline = _baseline(transport)
    caches = sentinel_caches(SPEC)
    receiver = create_receiver(transport, caches, TransferConfig(timeout_s=SHORT_TIMEOUT_S, **options))
    peer = PeerProcess("sender", transport, SPEC, SEED, timeout_s=SHORT_TIMEOUT_S, **sender_options)
    try:
        receiver.expect("killed", [5, 6, 7])
        peer.call("start", "killed", receiver.address, [1, 2, 3], [5, 6, 7])
        peer.call("send_layers", "killed", range(0, 5))
        assert receiver.wait_layer("killed", 4, GUARD_S)
        if transport == "ucx":  # the kill must hit the same-host payload path too
            from kvtransfer.transports import _cma
            assert _on_ucx_same_host_path(receiver) == _cma.available()
        peer.kill()
        status = receiver.wait("killed", GUARD_S)
        assert status.state is TransferState.FAILED
        assert "sender" in status.error and ("connection" in status.error or "nothing" in status.error)
        assert not receiver.wait_layer("killed", 5, 0.0)
    finally:
        peer.close()
        receiver.close()
    _assert_nothing_leaked(baseline)


def test_silent_sender_fails_within_the_timeout(transport, options, sender_options):
    caches = sentinel_caches(SPEC)
    receiver = create_receiver(transport, caches, TransferConfig(timeout_s=SHORT_TIMEOUT_S, **options))
    peer = PeerProcess("sender", transport, SPEC, SEED, timeout_s=SHORT_TIMEOUT_S, **sender_options)
    try:
        receiver.expect("silent", [5, 6])
        peer.call("start", "silent", receiver.address, [1, 2], [5, 6])
        peer.call("send_layers", "silent", [0])
        assert receiver.wait_layer("silent", 0, GUARD_S)
        peer.freeze()
        status = receiver.wait("silent", GUARD_S)
        assert status.state is TransferState.FAILED
        assert f"sent nothing for {SHORT_TIMEOUT_S:g} s" in status.error
    finally:
        peer.kill()
        peer.close()
        receiver.close()


def test_an_idle_connection_whose_sender_went_silent_is_closed(transport, options, sender_options, monkeypatch):
    """No transfer bound, and the sender stopped heartbeating (frozen, or a dead peer's half-open
    connection): the receiver closes the connection rather than hold its buffers for good."""
    import time

    import kvtransfer.receiver

    monkeypatch.setattr(kvtransfer.receiver, "IDLE_SILENCE_S", 0.0)  # then 4 x timeout_s: 4 s
    receiver = create_receiver(transport, sentinel_caches(SPEC), TransferConfig(timeout_s=SHORT_TIMEOUT_S, **options))
    peer = PeerProcess("sender", transport, SPEC, SEED, timeout_s=SHORT_TIMEOUT_S, **sender_options)
    try:
        receiver.expect("before", [5, 6])
        peer.call("send", "before", receiver.address, [1, 2], [5, 6])
        assert receiver.wait("before", GUARD_S).state is TransferState.SUCCESS
        assert len(receiver._connections) == 1
        time.sleep(3 * SHORT_TIMEOUT_S)
        assert len(receiver._connections) == 1  # a live sender's heartbeats keep it
        peer.freeze()
        deadline = time.monotonic() + GUARD_S
        while receiver._connections:
            assert time.monotonic() < deadline, "the silent connection was never closed"
            time.sleep(0.1)
    finally:
        peer.kill()
        peer.close()
        receiver.close()


def test_killed_receiver_fails_the_sender_and_nothing_leaks(transport, options):
    baseline = _baseline(transport)
    peer = PeerProcess("receiver", transport, SPEC, 0, timeout_s=SHORT_TIMEOUT_S, **options)
    sender = create_sender(transport, source_caches(SPEC, SEED),
                           TransferConfig(timeout_s=SHORT_TIMEOUT_S, **options))
    try:
        peer.call("expect", "orphan", [5, 6, 7])
        sender.start("orphan", peer.address, [1, 2, 3], [5, 6, 7])
        sender.send_layers("orphan", [0, 1])
        assert eventually(lambda: sender.poll("orphan").layers_done == 2)
        peer.kill()
        sender.send_layers("orphan", range(2, SPEC.num_layers))
        status = sender.wait("orphan", GUARD_S)
        assert status.state is TransferState.FAILED
        assert "receiver" in status.error
        sender.cancel("orphan")
    finally:
        peer.close()
        sender.close()
    _assert_nothing_leaked(baseline)


def test_unstarted_expectation_fails_after_pending_timeout(transport, options):
    caches = sentinel_caches(CacheSpec(num_layers=2, num_blocks=4))
    config = TransferConfig(timeout_s=SHORT_TIMEOUT_S, pending_timeout_s=0.3, **options)
    with create_receiver(transport, caches, config) as receiver:
        receiver.expect("nobody", [0, 1])
        status = receiver.wait("nobody", GUARD_S)
        assert status.state is TransferState.FAILED
        assert "no sender started the transfer within 0.3 s" in status.error


def test_close_releases_threads_and_sockets(transport, options):
    baseline = _baseline(transport)
    spec = CacheSpec(num_layers=4, num_blocks=8)
    source = source_caches(spec, 3)
    caches = sentinel_caches(spec)
    receiver = create_receiver(transport, caches, TransferConfig(**options))
    sender = create_sender(transport, source, TransferConfig(**options))
    receiver.expect("one", [7, 0])
    sender.send("one", receiver.address, [2, 5], [7, 0])
    assert receiver.wait("one", GUARD_S).ok
    assert sender.wait("one", GUARD_S).ok
    receiver.expect("unfinished", [1])
    sender.start("unfinished", receiver.address, [1], [1])
    sender.close()
    receiver.close()
    assert receiver.poll("unfinished").state is TransferState.FAILED
    assert sender.poll("unfinished").state is TransferState.FAILED
    assert same_bytes(caches[3][7], source[3][2]) and same_bytes(caches[0][0], source[0][5])
    _assert_nothing_leaked(baseline)
    with pytest.raises(Exception, match="closed"):
        receiver.expect("after-close", [2])
