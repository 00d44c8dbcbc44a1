"""Choosing transports by name and building senders and receivers.

    tcp    asyncio sockets, zero-copy for host-memory caches; works everywhere
    shm    same host: a shared-memory ring per connection, Unix socket for control
    ucx    UCX through ucxx (optional dependency); device memory directly on GPU
    nccl   torch.distributed point-to-point, a 2-rank group per sender/receiver pair
           (NCCL for GPU caches, gloo for CPU caches)
    auto   receiver: listen on the best transports for its caches (CPU: shm and tcp; GPU:
           ucx or nccl, and tcp) and advertise them all, best first; sender: use the first
           offered transport that works from here (shm only on the same host)
"""
from __future__ import annotations

import importlib
from typing import Callable, Sequence

import torch

from .addresses import TRANSPORT_CLASSES, TRANSPORT_NAMES
from .config import TransferConfig
from .layout import KVLayout, PackedBlocks
from .shared_memory import SharedMemory
from .receiver import KVReceiver
from .sender import KVSender
from .status import TransportUnavailableError
from .transports.base import Transport


def _transport_class(name: str) -> type[Transport]:
    """The class of transport `name` (`TRANSPORT_CLASSES`), its module imported now."""
    if name not in TRANSPORT_CLASSES:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(TRANSPORT_NAMES)} "
                         "or auto")
    module, _, class_name = TRANSPORT_CLASSES[name].partition(":")
    return getattr(importlib.import_module(f".transports.{module}", __package__), class_name)


def transport_unavailable_reason(name: str) -> str | None:
    """None if `name` can be used in this process, else why not."""
    return _transport_class(name).unavailable_reason()


def available_transports() -> list[str]:
    """The transports usable in this process, in TRANSPORT_NAMES order."""
    return [name for name in TRANSPORT_NAMES if transport_unavailable_reason(name) is None]


def _make(name: str) -> Transport:
    reason = transport_unavailable_reason(name)
    if reason is not None:
        raise TransportUnavailableError(f"transport {name!r} is unavailable: {reason}")
    return _transport_class(name)()


def _usable(names: Sequence[str]) -> list[str]:
    return [name for name in names if transport_unavailable_reason(name) is None]


def auto_receiver_transports(layout: KVLayout) -> list[str]:
    """What an `auto` receiver listens on, best first: CPU caches -> shm, tcp;
    GPU caches -> ucx (else nccl), tcp."""
    if not layout.is_cuda:
        return _usable(["shm", "tcp"])
    fast = _usable(["ucx"]) or _usable(["nccl"])
    return fast + _usable(["tcp"])


def auto_sender_transports(layout: KVLayout) -> list[str]:
    """What an `auto` sender may use: every usable transport, so that one sender reaches any
    receiver; the order of the receiver's address picks among them."""
    if not layout.is_cuda:
        return _usable(["shm", "tcp", "ucx", "nccl"])
    return _usable(["ucx", "nccl", "shm", "tcp"])


def create_receiver(transport: str, layer_caches: Sequence[torch.Tensor],
                    config: TransferConfig | None = None,
                    on_transfer_end: Callable[[str], None] | None = None,
                    packed: PackedBlocks | None = None, layer_windows: Sequence[int] = ()) -> KVReceiver:
    """A receiver listening on `transport` ("tcp", "shm", "ucx", "nccl" or "auto");
    `receiver.address` is what senders need. `packed`: the caches hold 8-bit blocks in that
    format; `layer_windows`: each layer's sliding window in tokens, 0 = full attention
    (kvtransfer/layout.py; the sender's must be the same)."""
    layout = KVLayout.from_caches(layer_caches, packed, layer_windows)
    names = auto_receiver_transports(layout) if transport == "auto" else [transport]
    return KVReceiver([_make(name) for name in names], layer_caches, config, on_transfer_end, packed,
                      layer_windows)


def create_sender(transport: str, layer_caches: Sequence[torch.Tensor],
                  config: TransferConfig | None = None,
                  shared_memory: SharedMemory | None = None, epoch: int | None = None,
                  on_transfer_end: Callable[[str], None] | None = None,
                  packed: PackedBlocks | None = None, layer_windows: Sequence[int] = ()) -> KVSender:
    """A sender over `transport` ("tcp", "shm", "ucx", "nccl" or "auto"). `shared_memory`: the
    shared file the (host) caches lie in, which lets shm receivers copy straight out of them.
    `epoch` and `on_transfer_end`: see kvtransfer/sender.py; `packed` and `layer_windows`: as
    for `create_receiver`."""
    layout = KVLayout.from_caches(layer_caches, packed, layer_windows)
    names = auto_sender_transports(layout) if transport == "auto" else [transport]
    return KVSender([_make(name) for name in names], layer_caches, config,
                    transport_name=transport, shared_memory=shared_memory, epoch=epoch,
                    on_transfer_end=on_transfer_end, packed=packed, layer_windows=layer_windows)
