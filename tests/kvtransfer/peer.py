"""Test helpers: deterministic KV caches, and a sender or receiver living in another process.

`PeerProcess` spawns a process that builds a sender or receiver over seeded caches and runs
its methods on request (`peer.call("send", ...)`), so tests can kill it (SIGKILL) or freeze it
(SIGSTOP) mid-transfer.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass

import torch

SENTINEL = -7.0  # what destination caches hold before anything arrives
CALL_TIMEOUT_S = 60.0  # a hang guard for one call to the peer, not a performance bound


@dataclass(frozen=True)
class CacheSpec:
    """The shape of the test caches: SmolLM2-like per-layer blocks, fewer of them."""

    num_layers: int = 30
    num_blocks: int = 48
    block_size: int = 16
    num_kv_heads: int = 3
    head_dim: int = 64
    dtype: torch.dtype = torch.float32

    def layer_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def chunk_nbytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * torch.empty(
            (), dtype=self.dtype).element_size()


def source_caches(spec: CacheSpec, seed: int) -> list[torch.Tensor]:
    """Seeded random caches: every (layer, block) chunk is different and reproducible."""
    generator = torch.Generator().manual_seed(seed)
    whole = torch.randn((spec.num_layers, *spec.layer_shape()), generator=generator)
    return list(whole.to(spec.dtype).unbind(0))


def shared_source_caches(spec: CacheSpec, seed: int):
    """`source_caches(spec, seed)` copied into a memfd: (caches, SharedMemory, keep-alive)."""
    from kvtransfer import allocate_shared
    plain = source_caches(spec, seed)
    nbytes = sum(cache.numel() * cache.element_size() for cache in plain)
    raw, shared, mapping = allocate_shared(nbytes)
    whole = raw.view(spec.dtype).view(spec.num_layers, *spec.layer_shape())
    for layer, cache in enumerate(plain):
        whole[layer].copy_(cache)
    return list(whole.unbind(0)), shared, (raw, mapping)


def sentinel_caches(spec: CacheSpec) -> list[torch.Tensor]:
    whole = torch.full((spec.num_layers, *spec.layer_shape()), SENTINEL, dtype=spec.dtype)
    return list(whole.unbind(0))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def is_sentinel(block: torch.Tensor) -> bool:
    return bool((block == SENTINEL).all())


def _peer_main(connection, role: str, transport: str, spec: CacheSpec, seed: int,
               config_kwargs: dict) -> None:
    from kvtransfer import TransferConfig, create_receiver, create_sender
    config_kwargs = dict(config_kwargs)
    shared_source = config_kwargs.pop("shared_source", False)
    layer_windows = config_kwargs.pop("layer_windows", ())
    config = TransferConfig(**config_kwargs)
    if role == "sender":
        if shared_source:  # caches in a memfd, as a prefill worker allocates them
            caches, shared, _keep_alive = shared_source_caches(spec, seed)
            target = create_sender(transport, caches, config, shared_memory=shared, layer_windows=layer_windows)
        else:
            target = create_sender(transport, source_caches(spec, seed), config, layer_windows=layer_windows)
        connection.send(("ready", None))
    else:
        caches = sentinel_caches(spec)
        target = create_receiver(transport, caches, config, layer_windows=layer_windows)
        connection.send(("ready", target.address))
    while True:
        try:
            method, args, kwargs = connection.recv()
        except EOFError:
            break
        if method == "exit":
            target.close()
            connection.send(("ok", None))
            break
        if method == "thread_names":
            connection.send(("ok", sorted(t.name for t in threading.enumerate())))
            continue
        try:
            result = getattr(target, method)(*args, **kwargs)
            if method in ("start", "send"):
                result = None  # the handle stays here
            connection.send(("ok", result))
        except Exception as exc:  # handed back to the test
            connection.send(("error", (type(exc).__name__, str(exc))))


class PeerError(Exception):
    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class PeerProcess:
    """A sender or receiver in a spawned process. `shared_source=True` (sender): its caches lie
    in a memfd handed to `create_sender` (shm's mapped path); `layer_windows`: the layout's
    sliding windows; other keywords go to TransferConfig."""

    def __init__(self, role: str, transport: str, spec: CacheSpec = CacheSpec(), seed: int = 0,
                 **config_kwargs) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self.process = context.Process(
            target=_peer_main, args=(child, role, transport, spec, seed, config_kwargs),
            daemon=True)
        self.process.start()
        child.close()
        kind, self.address = self._receive()
        assert kind == "ready"

    def _receive(self):
        if not self._connection.poll(CALL_TIMEOUT_S):
            self.kill()
            raise TimeoutError(f"peer gave no answer within {CALL_TIMEOUT_S} s")
        return self._connection.recv()

    def call(self, method: str, *args, **kwargs):
        self._connection.send((method, args, kwargs))
        kind, result = self._receive()
        if kind == "error":
            raise PeerError(*result)
        return result

    def freeze(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def kill(self) -> None:
        if self.process._closed:
            return
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(CALL_TIMEOUT_S)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit")
            except (OSError, EOFError, TimeoutError, PeerError):
                pass
            self.process.join(CALL_TIMEOUT_S)
        self.kill()
        self._connection.close()
        self.process.close()


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def kvtransfer_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvtransfer"))


def kvtransfer_thread_stacks() -> str:
    """Where each kvtransfer thread is: the message of a failed leak check."""
    frames = sys._current_frames()
    return "\n".join(f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
                     for t in threading.enumerate()
                     if t.name.startswith("kvtransfer") and t.ident in frames)
