"""kvtransfer pieces in one process: layout, config, addresses, message planning, transport
selection, argument validation, dtypes, and refusals that need no second process."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import sys

import numpy as np
import pytest
import torch

import kvtransfer
import kvtransfer.sender
from kvtransfer import (KVLayout, LayoutMismatchError, TransferConfig, TransferError,
                        TransferState, TransportUnavailableError, available_transports,
                        create_receiver, create_sender)
from kvtransfer._payload import BlockSource, CacheViews, DataPiece, DiscardSink, BlockSink, plan_pieces
from kvtransfer.addresses import parse_address
from kvtransfer.layout import check_layouts
from kvtransfer.transports._stream import AsyncSocket, SocketPayloadChannel

from ..helpers import eventually, free_port
from ..memory_maps import THP_ON, mapping_at
from ..transports import transport_params
from .peer import SENTINEL, CacheSpec, is_sentinel, same_bytes, sentinel_caches, source_caches

GUARD_S = 60.0
SMALL = CacheSpec(num_layers=4, num_blocks=8)


def test_layout_from_caches_and_describe():
    layout = KVLayout.from_caches(source_caches(CacheSpec(), 0))
    assert layout == KVLayout(30, 48, 16, 3, 64, torch.float32, "cpu")
    assert layout.chunk_nbytes == 2 * 16 * 3 * 64 * 4
    assert layout.describe() == ("layers=30 blocks=48 block_size=16 kv_heads=3 head_dim=64 "
                                 "dtype=float32 device=cpu")
    assert KVLayout.from_wire(layout.to_wire()) == layout


@pytest.mark.parametrize("caches, message", [
    ([], "empty"),
    ([torch.zeros(4, 2, 16, 3)], "expected"),
    ([torch.zeros(4, 3, 16, 3, 64)], "expected"),
    ([torch.zeros(4, 2, 16, 3, 64), torch.zeros(5, 2, 16, 3, 64)], "all layers must match"),
    ([torch.zeros(4, 2, 16, 3, 64), torch.zeros(4, 2, 16, 3, 64, dtype=torch.float16)],
     "all layers must match"),
    ([torch.zeros(2, 4, 16, 3, 64).transpose(0, 1)], "not contiguous"),
    ([torch.zeros(4, 2, 64, 3, 16).transpose(2, 4)], "not contiguous"),
])
def test_layout_rejects_bad_caches(caches, message):
    with pytest.raises(ValueError, match=message):
        KVLayout.from_caches(caches)


def test_layout_compatibility_ignores_pool_size_and_device_only():
    base = KVLayout(30, 100, 16, 3, 64, torch.bfloat16, "cpu")
    assert base.transfer_compatible(KVLayout(30, 7, 16, 3, 64, torch.bfloat16, "cuda:0"))
    for other in (KVLayout(29, 100, 16, 3, 64, torch.bfloat16),
                  KVLayout(30, 100, 32, 3, 64, torch.bfloat16),
                  KVLayout(30, 100, 16, 4, 64, torch.bfloat16),
                  KVLayout(30, 100, 16, 3, 128, torch.bfloat16),
                  KVLayout(30, 100, 16, 3, 64, torch.float16)):
        assert not base.transfer_compatible(other)
        with pytest.raises(LayoutMismatchError) as raised:
            check_layouts(other, base)
        assert other.describe() in str(raised.value) and base.describe() in str(raised.value)


def test_layout_sliding_windows_normalize_describe_and_travel():
    caches = source_caches(SMALL, 0)
    assert KVLayout.from_caches(caches, layer_windows=[0, 0, 0, 0]).layer_windows == ()
    assert KVLayout.from_caches(caches, layer_windows=[]) == KVLayout.from_caches(caches)
    windowed = KVLayout.from_caches(caches, layer_windows=[512, 512, 0, 512])
    assert windowed.layer_windows == (512, 512, 0, 512)
    assert [windowed.window(layer) for layer in range(4)] == [512, 512, 0, 512]
    assert KVLayout.from_caches(caches).window(3) == 0
    assert windowed.describe().endswith(" device=cpu windows=[512x2, full, 512]")
    assert "windows" not in KVLayout.from_caches(caches).describe()
    gemma = KVLayout(18, 8, 16, 1, 256, torch.bfloat16, layer_windows=([512] * 5 + [0]) * 3)
    assert gemma.describe().endswith("windows=[512x5, full, 512x5, full, 512x5, full]")
    assert KVLayout.from_wire(windowed.to_wire()) == windowed
    old_peer = {name: value for name, value in windowed.to_wire().items() if name != "layer_windows"}
    assert KVLayout.from_wire(old_peer).layer_windows == ()
    assert not windowed.transfer_compatible(KVLayout.from_caches(caches))
    assert not windowed.transfer_compatible(KVLayout.from_caches(caches, layer_windows=[512, 512, 0, 256]))
    assert windowed.transfer_compatible(KVLayout.from_caches(caches[:1] * 4, layer_windows=[512, 512, 0, 512]))
    with pytest.raises(LayoutMismatchError) as raised:
        check_layouts(windowed, KVLayout.from_caches(caches))
    assert "windows=[512x2, full, 512]" in str(raised.value)
    for bad, message in (([512, 0], "2 entries for 4 layers"), ([512, -1, 0, 0], "non-negative ints"),
                         ([512, 1.5, 0, 0], "non-negative ints"), ([True, 0, 0, 0], "non-negative ints")):
        with pytest.raises(ValueError, match=message):
            KVLayout.from_caches(caches, layer_windows=bad)


@pytest.mark.parametrize("kwargs, message", [
    ({"timeout_s": 0}, "timeout_s"),
    ({"pending_timeout_s": -1.0}, "pending_timeout_s"),
    ({"host": ""}, "host"),
    ({"port": 70000}, "port"),
    ({"max_message_bytes": 10}, "max_message_bytes"),
    ({"shm_slot_bytes": 10}, "shm_slot_bytes"),
    ({"shm_num_slots": 0}, "shm_num_slots"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransferConfig(**kwargs)


def test_config_defaults_detect_a_dead_peer_in_seconds():
    config = TransferConfig()
    assert 0 < config.timeout_s <= 10 and config.heartbeat_interval_s < config.timeout_s


def test_parse_addresses():
    endpoints = parse_address("shm://Host-1/123-abc,tcp://10.0.0.5:4000,nccl://h:1?store=2")
    assert [e.scheme for e in endpoints] == ["shm", "tcp", "nccl"]
    assert endpoints[0].path == "123-abc" and endpoints[1].port == 4000
    assert endpoints[2].query == {"store": "2"}
    assert str(endpoints[1]) == "tcp://10.0.0.5:4000"
    for bad, message in (("http://x:1", "unknown transport"), ("tcp://x", "no port"),
                         ("shm://host", "no shared-memory token"), ("", "non-empty")):
        with pytest.raises(ValueError, match=message):
            parse_address(bad)


@pytest.mark.parametrize("num_layers, num_blocks, max_chunks", [
    (30, 20, 700), (30, 20, 45), (7, 100, 30), (3, 1, 1), (5, 9, 4)])
def test_plan_pieces_covers_every_chunk_once(num_layers, num_blocks, max_chunks):
    layout = KVLayout(num_layers, 200, 16, 3, 64, torch.float32)
    layers = random.Random(0).sample(range(num_layers), num_layers)
    pieces = plan_pieces(layers, num_blocks, layout, max_chunks * layout.chunk_nbytes)
    covered = [(layer, block) for piece in pieces for layer in piece.layers
               for block in range(piece.block_start, piece.block_end)]
    assert sorted(covered) == sorted((layer, block) for layer in layers for block in range(num_blocks))
    assert all(piece.nbytes(layout) <= max_chunks * layout.chunk_nbytes for piece in pieces)


@pytest.mark.parametrize("block_start, num_blocks, max_chunks", [(3, 20, 700), (19, 20, 2), (5, 9, 4), (4, 4, 9)])
def test_plan_pieces_of_a_block_range_cover_only_it(block_start, num_blocks, max_chunks):
    """A prompt chunk's push: blocks [block_start, num_blocks) of every layer, once each."""
    layout = KVLayout(6, 200, 16, 3, 64, torch.float32)
    pieces = plan_pieces(range(6), num_blocks, layout, max_chunks * layout.chunk_nbytes, block_start)
    covered = [(layer, block) for piece in pieces for layer in piece.layers
               for block in range(piece.block_start, piece.block_end)]
    assert sorted(covered) == [(layer, block) for layer in range(6) for block in range(block_start, num_blocks)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "memmove"])
@pytest.mark.parametrize("nbytes", [1, 63, 1000, 1024, 24576 + 17])
def test_copy_chunks_moves_scattered_chunks_byte_exact(monkeypatch, native, nbytes):
    """The shared CPU copier: scattered sources to scattered, unaligned destinations (the
    streaming path has an unaligned head and a tail), nothing outside the chunks touched."""
    from kvtransfer import _chunk_copy
    if not native:
        monkeypatch.setattr(_chunk_copy, "_library", lambda: None)
    elif not _chunk_copy.native():
        pytest.skip("no C compiler here")
    count, stride = 37, nbytes + 29  # odd stride: chunks start at every alignment
    generator = torch.Generator().manual_seed(nbytes)
    src = torch.randint(0, 256, (count * stride,), dtype=torch.uint8, generator=generator)
    dst = torch.zeros(count * stride + 3, dtype=torch.uint8)
    order = torch.randperm(count, generator=generator)
    src_at = np.arange(count, dtype=np.uint64) * np.uint64(stride) + np.uint64(src.data_ptr())
    dst_at = order.numpy().astype(np.uint64) * np.uint64(stride) + np.uint64(dst.data_ptr() + 3)
    _chunk_copy.copy_chunks(dst_at, src_at, nbytes)
    expected = torch.zeros_like(dst)
    for i, j in enumerate(order.tolist()):
        expected[3 + j * stride:3 + j * stride + nbytes] = src[i * stride:i * stride + nbytes]
    assert torch.equal(dst, expected)
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        _chunk_copy.copy_chunks(dst_at[:2], src_at[:1], nbytes)


def test_cache_views_gather_then_scatter_moves_chunks_layer_major():
    """CPU staging (ring slots, ucx/nccl buffers): a payload is layer-major, block by block."""
    spec = CacheSpec(num_layers=3, num_blocks=12)
    layout = KVLayout.from_caches(source_caches(spec, 0))
    source = source_caches(spec, 5)
    destination = sentinel_caches(spec)
    src_views, dst_views = CacheViews(source, layout), CacheViews(destination, layout)
    layers, src_ids, dst_ids = (2, 0), [7, 1, 4], [0, 11, 3]
    staging = torch.empty(len(layers) * len(src_ids) * layout.chunk_nbytes, dtype=torch.uint8)
    out = staging.view(layout.dtype).view(len(layers), len(src_ids), *layout.chunk_shape)
    src_views.gather(layers, torch.tensor(src_ids), out)
    for position, layer in enumerate(layers):
        for j, block in enumerate(src_ids):
            assert same_bytes(out[position, j], source[layer][block])
    dst_views.scatter(layers, torch.tensor(dst_ids), out)
    for layer in range(spec.num_layers):
        for block in range(spec.num_blocks):
            if layer in layers and block in dst_ids:
                assert same_bytes(destination[layer][block], source[layer][src_ids[dst_ids.index(block)]])
            else:
                assert is_sentinel(destination[layer][block])


def test_plan_pieces_refuses_a_chunk_above_the_limit():
    layout = KVLayout(2, 4, 16, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="above the message limit"):
        plan_pieces([0, 1], 4, layout, layout.chunk_nbytes - 1)


def test_available_transports_and_unknown_names():
    names = available_transports()
    assert "tcp" in names and "shm" in names
    assert ("nccl" in names) == torch.distributed.is_available()
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        create_receiver("carrier-pigeon", sentinel_caches(SMALL))


def test_the_transport_registry_names_each_class():
    from kvtransfer.addresses import TRANSPORT_CLASSES, TRANSPORT_NAMES
    from kvtransfer.factory import _transport_class
    assert TRANSPORT_NAMES == tuple(TRANSPORT_CLASSES) and kvtransfer.TRANSPORT_NAMES == TRANSPORT_NAMES
    for name in TRANSPORT_NAMES:  # importing the ucx and nccl modules loads neither optional package
        assert _transport_class(name).name == name


def test_ucx_without_ucxx_is_a_clear_error(monkeypatch):
    from kvtransfer.transports import ucx

    def broken_import():
        raise ImportError("No module named 'ucxx'")

    monkeypatch.setattr(ucx, "_import_ucxx", broken_import)
    assert "ucx" not in available_transports()
    with pytest.raises(TransportUnavailableError, match="pip install ucxx-cu12 libucx-cu12"):
        create_receiver("ucx", sentinel_caches(SMALL))
    with pytest.raises(TransportUnavailableError, match="No module named 'ucxx'"):
        create_sender("ucx", sentinel_caches(SMALL))


@pytest.fixture
def tcp_pair():
    source = source_caches(SMALL, 5)
    caches = sentinel_caches(SMALL)
    receiver = create_receiver("tcp", caches, TransferConfig(timeout_s=2.0))
    sender = create_sender("tcp", source, TransferConfig(timeout_s=2.0))
    yield receiver, sender, caches, source
    sender.close()
    receiver.close()


@pytest.mark.parametrize("transport", transport_params(("ucx", "tcp", "shm")))
def test_a_control_message_above_one_frame_arrives_whole(transport):
    """A `begin` naming 20000 blocks is ~120 KB of JSON: ucx sends control messages as one tagged
    message of at most 64 KiB, so this one goes in two parts and must arrive whole."""
    num_blocks = 20000
    caches = [torch.arange(num_blocks * 8, dtype=torch.float32).view(num_blocks, 2, 1, 1, 4)]
    destination = [torch.zeros_like(caches[0])]
    src_ids = list(range(num_blocks))
    dst_ids = random.Random(0).sample(range(num_blocks), num_blocks)
    config = TransferConfig(timeout_s=10.0)
    receiver = create_receiver(transport, destination, config)
    sender = create_sender(transport, caches, config)
    try:
        receiver.expect("big", dst_ids)
        assert sender.send("big", receiver.address, src_ids, dst_ids).wait(60).ok
        assert receiver.wait("big", 60).ok
        assert torch.equal(destination[0][torch.tensor(dst_ids)], caches[0])
    finally:
        sender.close()
        receiver.close()


def test_auto_prefers_shm_on_the_same_host_and_falls_back_to_tcp():
    source = source_caches(SMALL, 1)
    caches = sentinel_caches(SMALL)
    with create_receiver("auto", caches) as receiver, create_sender("auto", source) as sender:
        schemes = [endpoint.scheme for endpoint in parse_address(receiver.address)]
        assert schemes == ["shm", "tcp"]
        assert sender.connect(receiver.address) == "shm"
        elsewhere = receiver.address.replace(parse_address(receiver.address)[0].host, "otherhost", 1)
        with create_sender("auto", source) as remote_sender:
            assert remote_sender.connect(elsewhere) == "tcp"
            receiver.expect("fallback", [3, 4])
            assert remote_sender.send("fallback", elsewhere, [0, 7], [3, 4]).wait(GUARD_S).ok
        assert receiver.wait("fallback", GUARD_S).ok
        assert same_bytes(caches[2][4], source[2][7])


def test_sender_without_a_matching_transport_says_what_is_offered():
    with create_sender("tcp", source_caches(SMALL, 0)) as sender:
        with pytest.raises(TransportUnavailableError, match="offers shm; this sender uses tcp"):
            sender.start("r", "shm://somehost/token", [0], [0])


def test_argument_validation(tcp_pair):
    receiver, sender, _, _ = tcp_pair
    with pytest.raises(ValueError, match="dst_block_ids has duplicate"):
        receiver.expect("a", [1, 1])
    with pytest.raises(ValueError, match=r"out of range \(valid: 0..7\)"):
        receiver.expect("a", [8])
    with pytest.raises(ValueError, match="layers \\[4\\] out of range"):
        receiver.expect("a", [1], layers=[4])
    with pytest.raises(ValueError, match="request_id"):
        receiver.expect("", [1])
    receiver.expect("a", [1])
    with pytest.raises(ValueError, match="already expected"):
        receiver.expect("a", [2])
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        receiver.poll("nope")
    with pytest.raises(ValueError, match="2 source blocks but 1 destination"):
        sender.start("s", receiver.address, [0, 1], [0])
    with pytest.raises(ValueError, match="src_block_ids"):
        sender.start("s", receiver.address, [9], [0])
    sender.start("s", receiver.address, [0], [1], layers=[0, 1])
    with pytest.raises(ValueError, match="already has a transfer"):
        sender.start("s", receiver.address, [0], [1])
    with pytest.raises(ValueError, match=r"layers \[2\] are not part of transfer"):
        sender.send_layers("s", [2])
    sender.send_layers("s", [0])
    with pytest.raises(ValueError, match=r"blocks \[1, 1\) are already sent"):
        sender.send_layers("s", [0])
    with pytest.raises(ValueError, match=r"layer 0 of 's': blocks \[1, 1\) are already sent"):
        sender.send_layers("s", [0, 1])  # refused as a whole: layer 1 is still unsent (below)
    with pytest.raises(ValueError, match=r"blocks \[0, 2\) are already sent or outside its 1 blocks"):
        sender.send_layers("s", [1], num_blocks=2)
    sender.cancel("s")


def test_dst_blocks_or_layers_that_differ_fail_both_sides(tcp_pair):
    receiver, sender, caches, _ = tcp_pair
    receiver.expect("blocks", [1, 2])
    status = sender.send("blocks", receiver.address, [0, 1], [2, 1]).wait(GUARD_S)
    assert status.state is TransferState.FAILED and "dst_block_ids differ" in status.error
    assert receiver.wait("blocks", GUARD_S).state is TransferState.FAILED
    receiver.expect("layers", [3], layers=[0, 1])
    status = sender.send("layers", receiver.address, [0], [3], layers=[0, 2]).wait(GUARD_S)
    assert status.state is TransferState.FAILED and "layers differ" in status.error
    assert "layers differ" in receiver.wait("layers", GUARD_S).error
    assert all(is_sentinel(cache) for cache in caches)


WINDOWED = [64, 0, 64, 64]  # SMALL's layers: layer 1 has full attention


@pytest.fixture
def windowed_tcp_pair():
    source = source_caches(SMALL, 6)
    caches = sentinel_caches(SMALL)
    receiver = create_receiver("tcp", caches, TransferConfig(timeout_s=2.0), layer_windows=WINDOWED)
    sender = create_sender("tcp", source, TransferConfig(timeout_s=2.0), layer_windows=WINDOWED)
    yield receiver, sender, caches, source
    sender.close()
    receiver.close()


def test_send_layers_with_skips_starts_each_layer_at_its_own_block(windowed_tcp_pair):
    """One call pushes layers that start at different blocks; a layer with nothing new below
    `num_blocks` (all skipped) is left alone, one that had blocks pushed there is refused."""
    receiver, sender, caches, source = windowed_tcp_pair
    skips = [3, 0, 1, 5]
    src, dst = [7, 6, 5, 4, 3, 2], [0, 1, 2, 3, 4, 5]
    receiver.expect("w", dst, skip_blocks=skips)
    sender.start("w", receiver.address, src, dst, skip_blocks=skips)
    transfer = sender._transfers["w"]
    assert transfer.blocks_queued == [3, 0, 1, 5]
    sender.send_layers("w", range(4), num_blocks=2)  # layers 0 and 3: all skipped below 2
    assert transfer.blocks_queued == [3, 2, 2, 5]
    with pytest.raises(ValueError, match=r"layer 1 of 'w': blocks \[2, 2\) are already sent"):
        sender.send_layers("w", [0, 1], num_blocks=2)
    with pytest.raises(ValueError, match=r"layer 2 of 'w': blocks \[2, 1\) are already sent"):
        sender.send_layers("w", [2], num_blocks=1)
    sender.send_layers("w", [0, 3], num_blocks=3)  # layer 0's skip is exactly 3: nothing yet
    assert transfer.blocks_queued == [3, 2, 2, 5]
    sender.send_layers("w", range(4))
    status = receiver.wait("w", GUARD_S)
    assert status.ok and sender.wait("w", GUARD_S).ok
    moved = sum(len(src) - skip for skip in skips)
    assert status.bytes_transferred == sender.poll("w").bytes_transferred == moved * SMALL.chunk_nbytes
    for layer, skip in enumerate(skips):
        for position, (s, d) in enumerate(zip(src, dst)):
            assert (is_sentinel(caches[layer][d]) if position < skip
                    else same_bytes(caches[layer][d], source[layer][s])), (layer, position)


def test_send_layers_groups_layers_by_start(windowed_tcp_pair, monkeypatch):
    """Layers with the same first block are planned as one group (few messages)."""
    receiver, sender, _, _ = windowed_tcp_pair
    planned = []
    real_plan = kvtransfer.sender.plan_pieces

    def spy(layers, num_blocks, layout, max_bytes, block_start=0):
        planned.append((tuple(layers), block_start, num_blocks))
        return real_plan(layers, num_blocks, layout, max_bytes, block_start)

    monkeypatch.setattr(kvtransfer.sender, "plan_pieces", spy)
    receiver.expect("g", [0, 1, 2, 3], skip_blocks=[2, 0, 2, 0])
    sender.send("g", receiver.address, [4, 5, 6, 7], [0, 1, 2, 3], skip_blocks=[2, 0, 2, 0])
    assert receiver.wait("g", GUARD_S).ok
    assert planned == [((0, 2), 2, 4), ((1, 3), 0, 4)]


def test_skip_blocks_validation(windowed_tcp_pair, tcp_pair):
    receiver, sender, _, _ = windowed_tcp_pair
    for skips, message in (([1, 0, 0], "3 entries: need one per cache layer"),
                           ([2, 0, 0, 0], r"skip_blocks\[0\] is 2: a layer skips 0 to 1"),
                           ([0, 0, -1, 0], r"skip_blocks\[2\] is -1"),
                           ([0, 1, 0, 0], "layer 1 has full attention")):
        with pytest.raises(ValueError, match=message):
            receiver.expect("v", [0, 1], skip_blocks=skips)
        with pytest.raises(ValueError, match=message):
            sender.start("v", receiver.address, [0, 1], [0, 1], skip_blocks=skips)
    plain_receiver, plain_sender, _, _ = tcp_pair  # no windows: every layer is full
    with pytest.raises(ValueError, match="layer 0 has full attention"):
        plain_sender.send("v", plain_receiver.address, [0, 1], [0, 1], skip_blocks=[1, 0, 0, 0])
    plain_receiver.expect("v", [0, 1], skip_blocks=[0, 0, 0, 0])  # all zero: allowed anywhere


def test_skips_that_differ_or_data_below_a_skip_are_refused(windowed_tcp_pair):
    receiver, sender, caches, _ = windowed_tcp_pair
    receiver.expect("differ", [0, 1, 2], skip_blocks=[2, 0, 0, 0])
    status = sender.send("differ", receiver.address, [3, 4, 5], [0, 1, 2]).wait(GUARD_S)
    assert status.state is TransferState.FAILED
    assert "skip_blocks differ: sender skips [0, 0, 0, 0], receiver expects [2, 0, 0, 0]" in status.error
    assert "skip_blocks differ" in receiver.wait("differ", GUARD_S).error
    # only the transfer's layers must agree
    receiver.expect("subset", [0, 1], layers=[1], skip_blocks=None)
    sender.send("subset", receiver.address, [3, 4], [0, 1], layers=[1], skip_blocks=[1, 0, 0, 0])
    assert receiver.wait("subset", GUARD_S).ok
    receiver.cancel("subset")
    caches[1].fill_(SENTINEL)
    # a sender that pushes blocks below a layer's skip (forced here) is refused, nothing written
    receiver.expect("below", [0, 1, 2], layers=[0], skip_blocks=[2, 0, 0, 0])
    sender.start("below", receiver.address, [3, 4, 5], [0, 1, 2], layers=[0], skip_blocks=[2, 0, 0, 0])
    sender._transfers["below"].blocks_queued[0] = 0
    sender.send_layers("below", [0])
    status = receiver.wait("below", GUARD_S)
    assert status.state is TransferState.FAILED and "below a layer's skip" in status.error
    assert sender.wait("below", GUARD_S).state is TransferState.FAILED
    assert all(is_sentinel(cache) for cache in caches)


def test_windows_that_differ_refuse_the_handshake(tcp_pair):
    plain_receiver, _, _, _ = tcp_pair
    with create_sender("tcp", source_caches(SMALL, 0), layer_windows=WINDOWED) as sender:
        with pytest.raises(LayoutMismatchError) as raised:
            sender.connect(plain_receiver.address)
        message = str(raised.value)
        assert "windows=[64, full, 64x2]" in message
        assert plain_receiver.layout.describe() + "]" in message


def test_unreachable_receiver_fails_fast_with_a_reason():
    dead_port = free_port()
    address = f"tcp://127.0.0.1:{dead_port}"
    with create_sender("tcp", source_caches(SMALL, 0), TransferConfig(timeout_s=1.0)) as sender:
        with pytest.raises(TransferError, match="cannot connect to receiver"):
            sender.connect(address)
        status = sender.send("x", address, [0], [0]).wait(GUARD_S)
        assert status.state is TransferState.FAILED and "cannot connect" in status.error


def test_wait_layer_is_false_once_cancelled(tcp_pair):
    receiver, _, _, _ = tcp_pair
    receiver.expect("gone", [0])
    assert not receiver.wait_layer("gone", 0, 0.05)
    receiver.cancel("gone")
    assert not receiver.wait_layer("gone", 0, GUARD_S)


def test_one_sender_feeds_two_receivers():
    source = source_caches(SMALL, 9)
    first, second = sentinel_caches(SMALL), sentinel_caches(SMALL)
    with create_receiver("tcp", first) as one, create_receiver("shm", second) as two, \
            create_sender("auto", source) as sender:
        one.expect("r", [0, 1])
        two.expect("r2", [6])
        sender.send("r", one.address, [2, 3], [0, 1])
        sender.send("r2", two.address, [5], [6])
        assert one.wait("r", GUARD_S).ok and two.wait("r2", GUARD_S).ok
        assert sender.wait("r", GUARD_S).ok and sender.wait("r2", GUARD_S).ok
        assert sender.total_bytes_sent == 3 * SMALL.num_layers * SMALL.chunk_nbytes
        for layer in range(SMALL.num_layers):
            assert same_bytes(first[layer][1], source[layer][3])
            assert same_bytes(second[layer][6], source[layer][5])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches_arrive_byte_exact(transport, dtype):
    spec = CacheSpec(num_layers=3, num_blocks=6, dtype=dtype)
    source = source_caches(spec, 2)
    caches = sentinel_caches(spec)
    with create_receiver(transport, caches) as receiver, create_sender(transport, source) as sender:
        receiver.expect("half", [5, 0, 2])
        sender.send("half", receiver.address, [1, 4, 3], [5, 0, 2])
        assert receiver.wait("half", GUARD_S).ok
        for layer in range(spec.num_layers):
            for src, dst in ((1, 5), (4, 0), (3, 2)):
                assert same_bytes(caches[layer][dst], source[layer][src])
        assert is_sentinel(caches[1][1])


def test_a_payload_cut_short_by_a_cancel_is_not_counted():
    """tcp pads the rest of a payload when the sender cancels midway; the trailer byte tells the
    receiver not to count it, and the stream stays in step for the next message."""
    spec = CacheSpec(num_layers=2, num_blocks=16)
    layout = KVLayout.from_caches(source_caches(spec, 0))
    src_views = CacheViews(source_caches(spec, 3), layout)
    dst_caches = sentinel_caches(spec)
    dst_views = CacheViews(dst_caches, layout)
    piece = DataPiece((0, 1), 0, 16)
    src_ids, dst_ids = list(range(16)), list(reversed(range(16)))
    src_index, dst_index = torch.tensor(src_ids), torch.tensor(dst_ids)

    async def scenario():
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # many syscalls per payload
        sending = SocketPayloadChannel(AsyncSocket(left, loop, "left"))
        receiving = SocketPayloadChannel(AsyncSocket(right, loop, "right"))
        calls = iter([True, True, False])  # active for the header and one syscall, then cancelled
        cut = BlockSource(src_views, piece, src_ids, src_index, lambda: next(calls, False))
        header = {"type": "data"}
        send = loop.create_task(sending.send_data(header, cut))
        message = await receiving.recv_control()
        sink = BlockSink(dst_views, piece, dst_ids, dst_index, lambda: True)
        first = await receiving.recv_data(message, sink)
        await send
        whole = BlockSource(src_views, piece, src_ids, src_index, lambda: True)
        send = loop.create_task(sending.send_data(header, whole))
        message = await receiving.recv_control()
        second = await receiving.recv_data(message, sink)
        await send
        await sending.close()
        await receiving.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert (first, second) == (False, True)
    for layer in range(2):
        for src, dst in zip(src_ids, dst_ids):
            assert same_bytes(dst_caches[layer][dst], src_views.caches[layer][src])


def test_discard_sink_never_writes():
    sink = DiscardSink(128)
    assert not sink.is_active() and not sink.scatter_from(torch.zeros(128, dtype=torch.uint8))


def test_public_api_is_exported():
    for name in ("create_sender", "create_receiver", "available_transports", "KVLayout",
                 "TransferConfig", "TransferState", "TransferStatus", "LayoutMismatchError"):
        assert hasattr(kvtransfer, name)


def test_a_small_transfer_is_not_stuck_behind_a_large_one():
    """Transfers on one connection take turns message by message."""
    spec = CacheSpec(num_layers=30, num_blocks=48)
    source = source_caches(spec, 4)
    caches = sentinel_caches(spec)
    one_chunk = TransferConfig(max_message_bytes=spec.chunk_nbytes)  # 1440 messages for "large"
    with create_receiver("tcp", caches) as receiver, \
            create_sender("tcp", source, one_chunk) as sender:
        sender.connect(receiver.address)
        receiver.expect("large", list(range(47)))
        receiver.expect("small", [47], layers=[0])
        sender.send("large", receiver.address, list(range(47)), list(range(47)))
        sender.send("small", receiver.address, [47], [47], layers=[0])
        assert receiver.wait("small", GUARD_S).ok
        assert receiver.poll("large").layers_done < spec.num_layers
        assert receiver.wait("large", GUARD_S).ok
        assert same_bytes(caches[0][47], source[0][47])
        assert same_bytes(caches[29][46], source[29][46])


@pytest.mark.skipif("ucx" not in available_transports(), reason="ucxx not installed")
def test_ucx_runtime_is_released_with_its_last_user():
    """ucxx is process-wide: its loop thread and UCX's own threads and descriptors go away
    when the last ucx sender or receiver closes."""
    from .peer import kvtransfer_threads, open_fd_count
    threads, fds = kvtransfer_threads(), open_fd_count()
    source = source_caches(SMALL, 6)
    caches = sentinel_caches(SMALL)
    receiver = create_receiver("ucx", caches)
    sender = create_sender("ucx", source)
    assert "kvtransfer-ucx" in kvtransfer_threads()
    receiver.expect("u", [2])
    assert sender.send("u", receiver.address, [3], [2]).wait(GUARD_S).ok
    sender.close()
    assert "kvtransfer-ucx" in kvtransfer_threads()  # the receiver still uses it
    receiver.close()
    assert kvtransfer_threads() == threads
    assert eventually(lambda: open_fd_count() <= fds), (open_fd_count(), fds)
    assert same_bytes(caches[1][2], source[1][3])


@pytest.mark.skipif("ucx" not in available_transports(), reason="ucxx not installed")
@pytest.mark.parametrize("fast_path", [True, False])
def test_ucx_close_lets_ucx_end_its_requests_before_their_buffers_go(fast_path):
    """UCX writes a posted receive's buffer from its own thread until the request ends: closing
    a channel with receives posted (the control receive, the next payloads') must abort the
    endpoints and wait for UCX to end each request, never cancel it and free its buffer."""
    source, caches = source_caches(SMALL, 4), sentinel_caches(SMALL)
    config = TransferConfig(ucx_same_host_fast_path=fast_path)
    with create_sender("ucx", source, config) as sender:
        receiver = create_receiver("ucx", caches, config)
        try:
            receiver.expect("c", [1])
            assert sender.send("c", receiver.address, [2], [1]).wait(GUARD_S).ok
            assert receiver.wait("c", GUARD_S).ok
            (channel,) = [connection.channel for connection in receiver._connections]
            requests = set(channel._requests)
            assert len(requests) >= 3  # the control receive and _PIPELINE_DEPTH payload receives
        finally:
            receiver.close()
        assert all(request.done() and not request.cancelled() for request in requests)
        assert not channel._requests


@pytest.mark.skipif("ucx" not in available_transports(), reason="ucxx not installed")
@pytest.mark.parametrize("sender_on, receiver_on", [(True, True), (True, False), (False, True)])
def test_ucx_same_host_payload_endpoint_only_when_both_sides_allow_it(sender_on, receiver_on):
    """On one host, CPU caches: payloads go over a second endpoint without UCX-level failure
    handling (so UCX may use its shared-memory transports) only with both sides' consent;
    byte-exact either way."""
    source, caches = source_caches(SMALL, 9), sentinel_caches(SMALL)
    with create_receiver("ucx", caches, TransferConfig(ucx_same_host_fast_path=receiver_on)) as receiver, \
            create_sender("ucx", source, TransferConfig(ucx_same_host_fast_path=sender_on)) as sender:
        receiver.expect("f", [5, 0])
        assert sender.send("f", receiver.address, [1, 6], [5, 0]).wait(GUARD_S).ok
        assert receiver.wait("f", GUARD_S).ok
        channels = [connection.channel for connection in receiver._connections]
        assert [channel.same_host_fast_path for channel in channels] == [sender_on and receiver_on]
        for layer in range(SMALL.num_layers):
            assert same_bytes(caches[layer][5], source[layer][1])
            assert same_bytes(caches[layer][0], source[layer][6])


@pytest.mark.skipif("ucx" not in available_transports(), reason="ucxx not installed")
def test_ucx_keeps_tcp_when_the_receiver_may_not_read_the_sender(monkeypatch):
    """UCX's same-host payloads are cma reads of the sender's memory: where the OS forbids
    them (the probe fails), the connection must stay on the control endpoint's path."""
    from kvtransfer.transports import ucx
    monkeypatch.setattr(ucx._cma, "probe", lambda pid, address, expected: False)
    source, caches = source_caches(SMALL, 10), sentinel_caches(SMALL)
    with create_receiver("ucx", caches) as receiver, create_sender("ucx", source) as sender:
        receiver.expect("p", [3])
        assert sender.send("p", receiver.address, [4], [3]).wait(GUARD_S).ok
        assert [connection.channel.same_host_fast_path for connection in receiver._connections] == [False]
        assert same_bytes(caches[2][3], source[2][4])


@pytest.mark.skipif("ucx" not in available_transports(), reason="ucxx not installed")
def test_ucx_sender_without_its_payload_endpoint_still_reaches_the_receivers_payload_tag(monkeypatch):
    """If only the receiver opened its same-host endpoint, the sender sends payloads on the
    control endpoint with the agreed tag; tag matching is per worker, so they still land."""
    from kvtransfer.transports import ucx
    opened = ucx.UcxChannel._open_payload_endpoint

    async def receiver_only(channel, address_hex):
        if channel._ctx.role == "receiver":
            await opened(channel, address_hex)

    monkeypatch.setattr(ucx.UcxChannel, "_open_payload_endpoint", receiver_only)
    source, caches = source_caches(SMALL, 12), sentinel_caches(SMALL)
    with create_receiver("ucx", caches) as receiver, create_sender("ucx", source) as sender:
        receiver.expect("half", [7, 2])
        assert sender.send("half", receiver.address, [0, 5], [7, 2]).wait(GUARD_S).ok
        assert receiver.wait("half", GUARD_S).ok
        assert [connection.channel.same_host_fast_path for connection in receiver._connections] == [True]
        for layer in range(SMALL.num_layers):
            assert same_bytes(caches[layer][7], source[layer][0])
            assert same_bytes(caches[layer][2], source[layer][5])


def test_ucx_same_host_identity_names_host_and_namespaces():
    from kvtransfer.transports.ucx import _host_identity
    identity = _host_identity()
    if identity is None:
        pytest.skip("no /proc here")
    hostname, boot_id, *namespaces = identity.split(":")
    assert hostname and len(boot_id) == 36 and len(namespaces) == 3 and all(map(str.isdigit, namespaces))
    assert _host_identity() == identity


def _shm_modes(receiver) -> list[str]:
    return [connection.channel.mode for connection in receiver._connections]


@pytest.mark.parametrize("option, sender_on, receiver_on, mode", [
    ("shm_cross_memory_attach", True, True, "cma"), ("shm_cross_memory_attach", True, False, "ring"),
    ("shm_cross_memory_attach", False, True, "ring"), ("shm_mapped", True, True, "mapped"),
    ("shm_mapped", True, False, "ring"), ("shm_mapped", False, True, "ring")])
def test_shm_takes_a_single_copy_path_only_when_both_sides_allow_it(option, sender_on, receiver_on, mode):
    """cma: cross-memory reads; mapped: the sender's caches lie in shared memory (a memfd it
    hands over). Either needs both sides' consent, else the ring; every path is byte-exact."""
    from kvtransfer.transports import _cma

    from .peer import shared_source_caches
    if mode == "cma" and not _cma.available():
        pytest.skip("no process_vm_readv here")
    if option == "shm_mapped":
        source, shared, _keep_alive = shared_source_caches(SMALL, 8)
    else:
        source, shared, _keep_alive = source_caches(SMALL, 8), None, None
    caches = sentinel_caches(SMALL)
    with create_receiver("shm", caches, TransferConfig(**{option: receiver_on})) as receiver, \
            create_sender("shm", source, TransferConfig(**{option: sender_on}), shared_memory=shared) as sender:
        receiver.expect("m", [6, 1])
        handle = sender.start("m", receiver.address, [2, 7], [6, 1])
        handle.send_layers([3, 0])
        assert receiver.wait_layer("m", 3, GUARD_S) and receiver.layers_ready("m") == 1
        handle.send_layers([1, 2])
        assert receiver.wait("m", GUARD_S).ok and handle.wait(GUARD_S).ok
        assert _shm_modes(receiver) == [mode]
        for layer in range(SMALL.num_layers):
            assert same_bytes(caches[layer][6], source[layer][2])
            assert same_bytes(caches[layer][1], source[layer][7])


@pytest.mark.parametrize("mode", ["cma", "mapped"])
def test_a_direct_copy_racing_a_sender_cancel_is_never_counted(monkeypatch, mode):
    """The receiver copies out of the sender's memory (cross-memory reads, or its mapped shared
    caches); if the sender cancelled meanwhile (its blocks may already hold another request's
    data), the copy must not count."""
    from kvtransfer.transports import _cma, shm

    from .peer import shared_source_caches
    if mode == "cma" and not _cma.available():
        pytest.skip("no process_vm_readv here")
    caches = sentinel_caches(SMALL)
    if mode == "cma":
        source, shared, _keep_alive = source_caches(SMALL, 9), None, None
        config = TransferConfig(shm_cross_memory_attach=True)
    else:
        source, shared, _keep_alive = shared_source_caches(SMALL, 9)
        config = TransferConfig()
    copy_name = {"cma": "read_chunks", "mapped": "copy_local"}[mode]
    with create_receiver("shm", caches, config) as receiver, \
            create_sender("shm", source, config, shared_memory=shared) as sender:
        real_copy = getattr(_cma, copy_name)

        def copy_then_sender_cancels(*args, **kwargs):
            copied = real_copy(*args, **kwargs)
            sender.cancel("race")
            return copied

        sender.connect(receiver.address)  # the cma handshake's probe reads too: patch after it
        monkeypatch.setattr(shm._cma, copy_name, copy_then_sender_cancels)
        receiver.expect("race", [1, 2])
        sender.send("race", receiver.address, [3, 4], [1, 2])
        status = receiver.wait("race", GUARD_S)
        assert _shm_modes(receiver) == [mode]
        assert status.state is TransferState.FAILED, status
        assert status.bytes_transferred == 0 and status.layers_done == 0
        assert same_bytes(caches[0][1], source[0][3]), status  # copied, never counted


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cross_memory_reads_split_over_threads_copy_every_chunk(threads):
    """`read_chunks` over several threads (this process reading itself) copies each chunk to its
    place, more than one IOV_MAX batch included, and copies nothing once told to stop."""
    import os

    import numpy as np

    from kvtransfer.transports import _cma
    if not _cma.available():
        pytest.skip("no process_vm_readv here")
    chunk, count = 64, 2500  # > 2 batches of 1024 iovecs
    source = np.random.default_rng(threads).integers(0, 255, size=count * chunk, dtype=np.uint8)
    dest = np.zeros_like(source)
    order = np.random.default_rng(7).permutation(count)
    remote = source.ctypes.data + order.astype(np.uint64) * chunk
    local = dest.ctypes.data + np.arange(count, dtype=np.uint64) * chunk
    assert _cma.read_chunks(os.getpid(), local, remote, chunk, lambda: True, threads=threads)
    assert np.array_equal(dest.reshape(count, chunk), source.reshape(count, chunk)[order])
    dest[:] = 0
    assert not _cma.read_chunks(os.getpid(), local, remote, chunk, lambda: False, threads=threads)
    assert not dest.any()


def test_shm_copy_threads_is_validated():
    with pytest.raises(ValueError, match="shm_copy_threads"):
        TransferConfig(shm_copy_threads=0)




def test_shared_memory_must_contain_the_caches():
    from kvtransfer import SharedMemory
    source = source_caches(SMALL, 1)
    with pytest.raises(ValueError, match="shared_memory must contain every layer cache"):
        create_sender("shm", source, shared_memory=SharedMemory(fd=0, address=1, nbytes=16))


def test_cpu_staging_buffers_are_private_huge_page_aligned_memory():
    from kvtransfer._common import staging_buffer
    buffer = staging_buffer((5 << 20) + 3)
    assert buffer.dtype == torch.uint8 and buffer.numel() == (5 << 20) + 3 and buffer.device.type == "cpu"
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * buffer.numel()
    if not sys.platform.startswith("linux"):
        return
    assert buffer.data_ptr() % (2 << 20) == 0
    mapping = mapping_at(buffer.data_ptr())
    assert mapping
    assert mapping["range"].split()[1].endswith("p")  # private, so anonymous THP applies (not shmem)
    if THP_ON:
        assert "hg" in mapping["VmFlags"].split()  # advised into huge pages


def test_shared_caches_are_allocated_at_start_so_a_peers_first_mapping_does_not_allocate_them():
    """A receiver maps the sender's caches with MAP_POPULATE at its first connection: if the
    sender's pages did not exist yet, that mapping would allocate them (seconds per GiB, holding
    the receiver's GIL). allocate_shared commits them up front, zeroed."""
    nbytes = 8 << 20
    raw, shared, mapping = kvtransfer.allocate_shared(nbytes)
    try:
        assert os.fstat(shared.fd).st_blocks * 512 >= nbytes  # every page of the memfd exists
        assert int(raw.count_nonzero()) == 0
    finally:
        del raw
        mapping.close()
        os.close(shared.fd)


async def test_an_accept_loop_waits_out_a_lack_of_descriptors_and_stops_on_a_broken_socket(caplog):
    import errno

    from kvtransfer._common import accept_connections

    class Loop:  # sock_accept as asyncio's, scripted: EMFILE twice, a connection, then EBADF
        def __init__(self):
            self.results = [OSError(errno.EMFILE, "Too many open files"), OSError(errno.EMFILE, "again"),
                            ("conn", ("127.0.0.1", 5)), OSError(errno.EBADF, "Bad file descriptor")]

        async def sock_accept(self, sock):
            result = self.results.pop(0)
            if isinstance(result, Exception):
                raise result
            return result

    accepted = []
    with caplog.at_level("WARNING", logger="kvtransfer._common"):
        await asyncio.wait_for(accept_connections(Loop(), None, lambda c, p: accepted.append((c, p)), "tcp://x:1"), 5)
    assert accepted == [("conn", ("127.0.0.1", 5))]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["tcp://x:1 cannot accept a connection now ([Errno 24] Too many open files): retrying",
                        "tcp://x:1 stopped accepting connections: [Errno 9] Bad file descriptor"]


async def test_a_transfer_task_that_fails_unexpectedly_is_logged_not_dropped(caplog):
    from kvtransfer._common import TaskSet

    async def lost_connection():
        raise ConnectionResetError("peer gone")  # reported through its transfers: not logged again

    async def refused():
        raise TransferError("refused")

    async def bug():
        raise KeyError("no such transfer")

    tasks = TaskSet()
    with caplog.at_level("ERROR", logger="kvtransfer._common"):
        for coro in (lost_connection(), refused(), bug()):
            task = tasks.spawn(coro)
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run
    [record] = caplog.records
    assert record.getMessage() == ("kvtransfer task test_a_transfer_task_that_fails_unexpectedly_is_logged_not_dropped."
                                   "<locals>.bug failed")
    assert isinstance(record.exc_info[1], KeyError)


def test_a_split_cross_memory_copy_raises_only_once_every_slice_stopped_writing():
    """One slice fails while another still copies into the blocks: the failure is reported only
    after that one ended, so nothing writes into blocks whose transfer was reported failed."""
    import time

    from kvtransfer.transports import _cma

    finished = []

    def copy_range(local, remote, chunk_nbytes, keep_writing):
        if local[0] == 0:
            raise OSError("the first slice failed")
        time.sleep(0.3)
        finished.append(local.tolist())
        return True

    with pytest.raises(OSError, match="the first slice failed"):
        _cma._split(copy_range, np.arange(4), np.arange(4), 1, lambda: True, threads=2)
    assert finished == [[2, 3]]
