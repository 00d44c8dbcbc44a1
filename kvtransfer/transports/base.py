"""The interface every transport implements: listen, connect, and a channel per connection.

The transport-independent logic (handshake, bookkeeping, acknowledgements, timeouts) lives in
`kvtransfer.receiver` and `kvtransfer.sender`; a transport only moves control messages and data
payloads over one connection. Every method runs on the owner's event loop thread.
"""
from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from ..addresses import Endpoint
from ..config import TransferConfig
from ..layout import KVLayout
from .._payload import BlockSink, BlockSource, DiscardSink
from ..shared_memory import SharedMemory


class ChannelClosed(ConnectionError):
    """The connection ended (peer closed or died, or we closed it)."""


@dataclass
class TransportContext:
    """What a transport needs from its owner."""

    config: TransferConfig
    layout: KVLayout
    loop: asyncio.AbstractEventLoop
    role: str  # "sender" or "receiver"
    cache_addresses: tuple[int, ...] = ()  # data_ptr of each layer's cache (host memory only)
    shared_memory: SharedMemory | None = None  # sender: the shared file its caches lie in


class Channel(ABC):
    """One connection between a sender and a receiver.

    Control messages are JSON-able dicts. `send_control` and `send_data` may be called by
    several tasks: implementations serialize them. `last_rx` is the monotonic time of the last
    byte received; the owner declares the peer dead when it grows older than the timeout.
    `max_payload_bytes`: the most one `send_data` may carry (a staged transport's buffer size);
    None: the sender's `max_message_bytes`.
    """

    max_payload_bytes: int | None = None

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self._last_rx = self._last_tx = time.monotonic()

    @property
    def last_rx(self) -> float:
        return self._last_rx

    @property
    def last_tx(self) -> float:
        return self._last_tx

    def mark_rx(self) -> None:
        self._last_rx = time.monotonic()

    def mark_tx(self) -> None:
        self._last_tx = time.monotonic()

    @abstractmethod
    async def send_control(self, message: dict) -> None: ...

    @abstractmethod
    async def recv_control(self) -> dict:
        """The next control message; raises ChannelClosed when the connection ends."""

    @abstractmethod
    async def send_data(self, header: dict, source: BlockSource) -> None:
        """Send a `data` header and its payload. When it returns the source blocks have been
        read (the payload may still be in flight). If `source.is_active()` turns False
        midway, the rest of the payload may be filler."""

    @abstractmethod
    async def recv_data(self, header: dict, sink: BlockSink | DiscardSink) -> bool | asyncio.Future:
        """Receive the payload announced by `header` into `sink`, writing into blocks only while
        `sink.is_active()`; return whether every byte landed in the blocks, or a future of that
        when the transport must confirm with the sender first."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connection; idempotent; pending operations raise ChannelClosed."""

    def hello_fields(self) -> dict:
        """Extra fields a sender puts in its hello."""
        return {}

    async def after_auth(self) -> None:
        """Both sides of a keyed connection (`TransferConfig.auth_key`), once the peer proved
        the key: the sender after sending its proof, the receiver after verifying it, before
        `accept_hello`. Hand over what only an authenticated peer may have (shm: the sender's
        shared caches). Not called without a key."""

    async def accept_hello(self, hello: dict) -> dict:
        """Receiver: check transport-specific hello fields; return extra hello_ok fields."""
        return {}

    async def after_hello_ok(self, reply: dict) -> None:
        """Both sides, once the handshake succeeded: set up data paths that need a peer."""


class Listener(ABC):
    endpoint: Endpoint

    @abstractmethod
    async def close(self) -> None: ...


class Transport(ABC):
    name: str

    @staticmethod
    def unavailable_reason() -> str | None:
        """None when usable in this process, else a sentence saying why not."""
        return None

    def acquire_shared_loop(self):
        """A LoopThread that every user of this transport in the process must share, or None
        (then the owner runs its own). Each acquire is paired with `release_shared_loop()`."""
        return None

    @abstractmethod
    async def listen(self, ctx: TransportContext,
                     on_channel: Callable[[Channel], None]) -> Listener: ...

    @abstractmethod
    async def connect(self, ctx: TransportContext, endpoint: Endpoint) -> Channel: ...

    def release_shared_loop(self) -> None:
        """Undo one `acquire_shared_loop()` that returned a loop."""
