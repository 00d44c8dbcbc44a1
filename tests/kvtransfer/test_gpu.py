"""CUDA caches: device memory through every transport that can take it (skipped without CUDA).

nccl needs its two ranks on different GPUs, so it runs here only with two or more devices.
"""
from __future__ import annotations

import pytest
import torch

from kvtransfer import TransferConfig, available_transports, create_receiver, create_sender

from .peer import CacheSpec, is_sentinel, same_bytes, sentinel_caches, source_caches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPEC = CacheSpec(num_layers=6, num_blocks=32, dtype=torch.bfloat16)
GUARD_S = 60.0


def _gpu_transports() -> list[str]:
    names = [name for name in ("tcp", "shm", "ucx") if name in available_transports()]
    if torch.cuda.device_count() >= 2 and "nccl" in available_transports():
        names.append("nccl")
    return names


@pytest.mark.parametrize("transport", _gpu_transports())
def test_cuda_caches_arrive_byte_exact(transport):
    receiver_device = "cuda:1" if transport == "nccl" else "cuda:0"
    source = [layer.to("cuda:0") for layer in source_caches(SPEC, 11)]
    caches = [layer.to(receiver_device) for layer in sentinel_caches(SPEC)]
    config = TransferConfig(timeout_s=10.0)
    with create_receiver(transport, caches, config) as receiver, \
            create_sender(transport, source, config) as sender:
        src_ids, dst_ids = [3, 17, 9, 30, 1], [0, 31, 12, 5, 6]
        receiver.expect("gpu", dst_ids)
        handle = sender.start("gpu", receiver.address, src_ids, dst_ids)
        for start in range(0, SPEC.num_layers, 2):
            handle.send_layers(range(start, start + 2))
        assert receiver.wait("gpu", GUARD_S).ok
        assert handle.wait(GUARD_S).ok
        torch.cuda.synchronize()
        for layer in range(SPEC.num_layers):
            for src, dst in zip(src_ids, dst_ids):
                assert same_bytes(caches[layer][dst].cpu(), source[layer][src].cpu())
        assert is_sentinel(caches[0][2].float().cpu())


def test_auto_picks_a_device_capable_transport_for_cuda_caches():
    caches = [layer.to("cuda:0") for layer in sentinel_caches(SPEC)]
    with create_receiver("auto", caches) as receiver:
        first = receiver.address.split(",")[0].split("://")[0]
        assert first in ("ucx", "nccl")
