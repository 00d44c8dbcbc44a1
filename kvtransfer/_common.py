"""Small helpers shared by the sender and the receiver."""
from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import socket
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import torch

from .layout import KVLayout
from .status import TransferError

log = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20


def staging_buffer(nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """A uint8 buffer for staged payloads. On the CPU it lies in transparent huge pages where
    Linux offers them (`madvise`, as the engine's KV cache does): a payload is copied in and
    out at memory speed and UCX's cma reads it page by page, so 4 KiB pages would cost a TLB
    miss and a page pin every 4 KiB."""
    if torch.device(device).type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    # private and anonymous (a plain mmap(-1) is shared memory, which THP treats apart); freed
    # with the tensor, which keeps `region` alive
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, same bytes
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE  # align, so every 2 MiB of it can be one page
    return whole[start:start + nbytes]


def normalize_layers(layers: Iterable[int] | None, num_layers: int) -> tuple[int, ...]:
    """None -> every layer; else a non-empty sequence of distinct layer indices in range."""
    if layers is None:
        return tuple(range(num_layers))
    result = tuple(int(layer) for layer in layers)
    if not result:
        raise ValueError("layers is empty")
    if len(set(result)) != len(result):
        raise ValueError(f"layers has duplicates: {list(result)}")
    bad = [layer for layer in result if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: the cache has {num_layers} layers")
    return result


def check_block_ids(block_ids: Sequence[int], num_blocks: int | None, name: str) -> list[int]:
    ids = [int(block) for block in block_ids]
    if not ids:
        raise ValueError(f"{name} is empty")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} has duplicate block ids")
    upper = num_blocks if num_blocks is not None else float("inf")
    bad = [block for block in ids if not 0 <= block < upper]
    if bad:
        limit = f"0..{num_blocks - 1}" if num_blocks is not None else ">= 0"
        raise ValueError(f"{name} {bad[:8]} out of range (valid: {limit})")
    return ids


def check_skip_blocks(skip_blocks: Sequence[int] | None, layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    """Per cache layer, how many leading blocks of a `num_blocks`-block transfer it does not move
    (None: none, every layer all blocks). Each is in [0, num_blocks): every layer moves at least
    its last block; and 0 for a full-attention layer (`layout.window(layer)` 0)."""
    if skip_blocks is None:
        return (0,) * layout.num_layers
    skips = tuple(int(skip) for skip in skip_blocks)
    if len(skips) != layout.num_layers:
        raise ValueError(f"skip_blocks has {len(skips)} entries: need one per cache layer ({layout.num_layers})")
    for layer, skip in enumerate(skips):
        if not 0 <= skip < num_blocks:
            raise ValueError(f"skip_blocks[{layer}] is {skip}: a layer skips 0 to {num_blocks - 1} of the "
                             f"transfer's {num_blocks} blocks (it moves at least the last one)")
        if skip and not layout.window(layer):
            raise ValueError(f"skip_blocks[{layer}] is {skip}, but layer {layer} has full attention "
                             "(window 0 in the layout): it reads every block, so it skips none")
    return skips


def check_request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    return request_id


class BoundedSet:
    """Remembers the last `capacity` keys (to explain late messages for ended transfers)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._items[key] = None
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def discard(self, key: str) -> None:
        self._items.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._items


async def within(seconds: float, awaitable):
    """`await awaitable` with a time limit (TimeoutError). Unlike Python 3.11's
    `asyncio.wait_for`, it never swallows a cancellation that races with completion."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


class TaskSet:
    """Keeps fire-and-forget tasks alive and lets the owner cancel them all."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        # A lost connection or a failed transfer reaches its transfers' states. Anything else is a
        # bug that would vanish with the task (a watchdog or a serving loop that stopped): log it.
        if exc is not None and not isinstance(exc, (OSError, TransferError, asyncio.TimeoutError)):
            log.error("kvtransfer task %s failed", task.get_coro().__qualname__, exc_info=exc)

    async def cancel_all(self) -> None:
        await cancel_and_wait(self._tasks)


# accept() errors that pass: out of descriptors or memory, or a peer that gave up while queued
_ACCEPT_RETRY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED})


async def accept_connections(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                             handle: Callable[[socket.socket, Any], None], what: str) -> None:
    """A listener's accept loop, until cancelled: `handle(conn, peer_address)` per connection.
    An error that passes is logged once and retried every 50 ms (no spinning); any other (the
    socket is broken) ends the loop, logged, rather than retrying forever in silence."""
    waiting = False
    while True:
        try:
            conn, peer = await loop.sock_accept(sock)
        except OSError as exc:
            if exc.errno not in _ACCEPT_RETRY:
                log.error("%s stopped accepting connections: %s", what, exc)
                return
            if not waiting:
                log.warning("%s cannot accept a connection now (%s): retrying", what, exc)
                waiting = True
            await asyncio.sleep(0.05)
            continue
        waiting = False
        handle(conn, peer)


async def cancel_and_wait(tasks) -> None:
    """Cancel tasks and wait for them to end, cancelling again any that swallowed it."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
