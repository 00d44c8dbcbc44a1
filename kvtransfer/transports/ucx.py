"""ucx: UCX through `ucxx` (optional dependency: `pip install ucxx-cu12 libucx-cu12`).

UCX picks the fastest path it finds between the two processes: shared memory or TCP on one
host, RDMA between hosts, CUDA IPC / GPUDirect for device memory, which it sends directly.
Control messages and payloads are tagged messages on one endpoint per connection (payloads
on their own tag); each payload is one contiguous staging buffer, gathered from and scattered
into the blocks on the device where the caches live.

Same host: the connection's endpoint comes from a listener and asks for UCX's peer-failure
handling, which UCX's shared-memory transports do not offer for a whole endpoint, so UCX runs
it over TCP loopback. With CPU caches on both sides of one host, the two sides therefore also
open a payload endpoint to each other's worker address without that handling: UCX then uses
sysv for small messages and cma (the receiver reads the sender's staging buffer with one
process_vm_readv) for payloads. The receiver first checks that the OS lets it read the sender's
memory (a probe buffer named in the hello): where it may not (Yama ptrace_scope, seccomp), UCX's
cma reads would fail mid-transfer, so the connection keeps TCP. The control endpoint keeps the
failure handling and the heartbeats, and a failure there aborts both endpoints, which cancels
the payload requests.

ucxx keeps one context per process, bound to the event loop it was started on, so every ucx
sender and receiver in a process shares one loop thread (`_UcxRuntime`); the runtime resets
ucxx (stopping its threads) when its last user closes. Set UCX_TLS and friends in the
environment to restrict transports (e.g. UCX_TLS=tcp,self on a machine without RDMA/GPU).
"""
from __future__ import annotations

import asyncio
import collections
import gc
import json
import logging
import os
import secrets
import socket
import struct
import threading
from typing import Callable

import numpy as np
import torch

from . import _cma
from .._common import cancel_and_wait, staging_buffer
from .._loop import LoopThread
from .._payload import BlockSink, BlockSource, DiscardSink
from ..addresses import Endpoint
from ..status import TransferError
from .base import Channel, ChannelClosed, Listener, Transport, TransportContext

_PAYLOAD_TAG = 0x6B76  # an int: ucxx hashes tags with hash(), which is stable only for ints
# Control messages: one tagged message of at most this many bytes, with a length header.
_CONTROL_BYTES = 64 << 10
_CONTROL_HEADER = struct.Struct("<Q")
_PIPELINE_DEPTH = 2  # staging buffers per direction: copy one while the other is on the wire
# UCX's TCP transport moves 64 KiB segments by default: with 1 MiB it gets near plain-socket
# speed on loopback and LAN. Environment variables (UCX_TCP_TX_SEG_SIZE...) take precedence.
_DEFAULT_UCX_OPTIONS = {"TCP_TX_SEG_SIZE": "1m", "TCP_RX_SEG_SIZE": "1m"}
# How long a closing channel waits for UCX to end its aborted requests before it leaves them
# (and their buffers) to the runtime, which keeps them until they end.
_CLOSE_WAIT_S = 5.0
_log = logging.getLogger(__name__)


def _import_ucxx():
    # ucxx sets UCX_MEMTYPE_CACHE, which recent UCX no longer knows and warns about at init
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx
    return ucxx


class _UcxRuntime:
    """The process-wide loop thread that every ucx sender and receiver runs on.

    This is the one piece of process-level state in kvtransfer, mirroring ucxx's own
    process-wide context."""

    _lock = threading.Lock()
    _loop: LoopThread | None = None
    _users = 0
    # requests of closed channels that UCX had not ended: kept, with the buffers their
    # coroutines hold, until they end (or the process does), so UCX never writes freed memory
    _unfinished: set[asyncio.Future] = set()

    @classmethod
    def keep_until_done(cls, requests) -> None:
        for request in requests:
            cls._unfinished.add(request)
            request.add_done_callback(cls._unfinished.discard)

    @classmethod
    def acquire(cls) -> LoopThread:
        with cls._lock:
            if cls._loop is None:
                loop = LoopThread("kvtransfer-ucx")
                try:
                    loop.run(cls._init())
                except BaseException:
                    loop.stop()
                    raise
                cls._loop = loop
            cls._users += 1
            return cls._loop

    @classmethod
    def release(cls) -> None:
        with cls._lock:  # held throughout, so that no one re-initialises ucxx mid-reset
            cls._users -= 1
            if cls._users > 0 or cls._loop is None:
                return
            loop, cls._loop = cls._loop, None
            try:
                loop.run(cls._reset(), timeout=30.0)
            finally:
                loop.stop()
                # ucxx patches `loop.close` with a closure holding its progress task (and
                # through it the UCX worker and its progress thread); drop it so both go now.
                vars(loop.loop).pop("close", None)
                gc.collect()

    @staticmethod
    async def _init() -> None:
        ucxx = _import_ucxx()
        try:
            ucxx.init(options=_DEFAULT_UCX_OPTIONS, env_takes_precedence=True,
                      progress_mode="thread", enable_python_future=True)
        except RuntimeError as exc:  # initialised elsewhere in this process: share it
            _log.warning("ucxx was already initialised outside kvtransfer: %s", exc)

    @staticmethod
    async def _reset() -> None:
        ucxx = _import_ucxx()
        await asyncio.sleep(0)
        for attempt in range(2):  # reset() itself collects garbage before it checks for live objects
            try:
                ucxx.reset()
                return
            except Exception as exc:  # objects still alive: ucxx stays up until exit
                if attempt == 1:
                    _log.warning("could not reset ucxx: %s", exc)
                await asyncio.sleep(0.05)


def _host_identity() -> str | None:
    """Equal for two processes that UCX's shared-memory transports can connect: same boot of
    the same host, same network, PID and IPC namespaces. None when it cannot be told."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            parts = [socket.gethostname(), boot.read().strip()]
        parts += [str(os.stat(f"/proc/self/ns/{name}").st_ino) for name in ("net", "pid", "ipc")]
    except OSError:
        return None
    return ":".join(parts)


def _drop_failure(future: asyncio.Future) -> None:
    """Retrieve a failed request's exception and cut its traceback (see `_failure`)."""
    if not future.cancelled() and future.exception() is not None:
        future.exception().__traceback__ = None


def _abort_made_endpoint(creating: asyncio.Future) -> None:
    """The endpoint of a connect whose caller was cancelled: aborted as soon as it exists."""
    if creating.cancelled():
        return
    if creating.exception() is not None:
        creating.exception().__traceback__ = None
        return
    try:
        creating.result().abort()
    except Exception as exc:  # already broken: nothing left to release
        _log.debug("ucx endpoint abort: %s", exc)


def _as_ucx_buffer(tensor: torch.Tensor):
    return tensor if tensor.is_cuda else tensor.numpy()


class UcxChannel(Channel):
    """Control messages: `send_obj`/`recv_obj` on the endpoint's default tag. Payloads: one
    tagged message each, from/into staging buffers of `max_payload_bytes`; the sender gathers
    the next payload while the previous one is on the wire, the receiver posts the next receive
    before scattering the one that arrived.

    Memory contract: UCX reads or writes a request's buffer until the request completes, from
    its progress thread. So every request runs as a future of its own (`_request`) whose
    coroutine holds the buffer, callers await it shielded (a cancelled caller never frees a
    buffer under UCX), and `close` aborts the endpoints, which makes UCX end their requests,
    then waits for them to end rather than cancelling them."""

    def __init__(self, endpoint, ctx: TransportContext, peer: str) -> None:
        super().__init__(peer)
        self._ep = endpoint
        self._ctx = ctx
        self._send_lock = asyncio.Lock()
        self._closed = False
        self._error: ChannelClosed | None = None
        self.max_payload_bytes = ctx.config.max_message_bytes
        self._free_buffers: asyncio.Queue[torch.Tensor] | None = None
        self._payload_sends: set[asyncio.Task] = set()
        self._requests: set[asyncio.Future] = set()  # every UCX request not yet ended
        self._posted: collections.deque[tuple[asyncio.Future, torch.Tensor]] = collections.deque()
        self._spare_buffers: list[torch.Tensor] = []
        # the same-host payload endpoint (see the module docstring) and its tag, once agreed
        self._payload_ep = None
        self._payload_tag: int | None = None
        self._probe = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()  # sender: read by the peer

    @property
    def same_host_fast_path(self) -> bool:
        return self._payload_ep is not None

    def _fast_path_allowed(self) -> bool:
        return self._ctx.config.ucx_same_host_fast_path and not self._ctx.layout.is_cuda

    @staticmethod
    def _worker_address_hex() -> str:
        return bytes(_import_ucxx().get_worker_address()).hex()

    async def _open_payload_endpoint(self, address_hex: str) -> None:
        ucxx = _import_ucxx()
        try:
            address = ucxx.get_ucx_address_from_buffer(bytes.fromhex(address_hex))
            self._payload_ep = await ucxx.create_endpoint_from_worker_address(
                address, endpoint_error_handling=False)
        except Exception as exc:  # the control endpoint's path still works
            _log.warning("ucx: no same-host payload endpoint to %s (%s); payloads go over "
                         "the control endpoint", self.peer, exc)

    def _failure(self, exc: Exception) -> ChannelClosed:
        # ucxx's request future keeps this exception alive from C++; its traceback would pin
        # our frames and, through them, the endpoint and the whole UCX worker.
        exc.__traceback__ = None
        return ChannelClosed(f"ucx connection to {self.peer} failed: {exc or type(exc).__name__}")

    def _request(self, operation) -> asyncio.Future:
        """Run one ucxx send/recv coroutine as a tracked future (see the class docstring)."""
        future = asyncio.ensure_future(operation)
        self._requests.add(future)
        future.add_done_callback(self._requests.discard)
        future.add_done_callback(_drop_failure)
        return future

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed or self._ep is None:
            raise ChannelClosed(f"connection to {self.peer} is closed")

    def _new_buffer(self) -> torch.Tensor:
        return staging_buffer(self.max_payload_bytes, self._ctx.layout.device)

    def hello_fields(self) -> dict:
        identity = _host_identity() if self._fast_path_allowed() else None
        if identity is None:
            return {}
        return {"ucx_host": identity, "ucx_worker_address": self._worker_address_hex(),
                "ucx_probe": {"pid": os.getpid(), "address": int(self._probe.ctypes.data),
                              "bytes": self._probe.tobytes().hex()}}

    def _may_read_sender(self, hello: dict) -> bool:
        probe = hello.get("ucx_probe") or {}
        try:
            return _cma.probe(int(probe["pid"]), int(probe["address"]), bytes.fromhex(probe["bytes"]))
        except (KeyError, TypeError, ValueError):
            return False

    async def accept_hello(self, hello: dict) -> dict:
        reply = {"max_payload_bytes": self.max_payload_bytes}
        identity = _host_identity() if self._fast_path_allowed() else None
        if (identity is not None and hello.get("ucx_host") == identity
                and hello.get("ucx_worker_address") and self._may_read_sender(hello)):
            await self._open_payload_endpoint(hello["ucx_worker_address"])
            if self._payload_ep is not None:
                # a tag of its own per connection: tag matching spans the whole (shared) worker
                self._payload_tag = secrets.randbits(62)
                reply.update(ucx_worker_address=self._worker_address_hex(),
                             ucx_payload_tag=self._payload_tag)
        return reply

    async def after_hello_ok(self, reply: dict) -> None:
        if "max_payload_bytes" in reply:  # sender: never send more than the receiver posts
            self.max_payload_bytes = min(self.max_payload_bytes, int(reply["max_payload_bytes"]))
        if self._ctx.role == "sender" and reply.get("ucx_worker_address") and self._fast_path_allowed():
            # The receiver posts its payload receives on this tag. Tag matching is per worker,
            # so if our payload endpoint cannot be opened, payloads sent on the control endpoint
            # with this tag still match them (over TCP).
            self._payload_tag = int(reply["ucx_payload_tag"])
            await self._open_payload_endpoint(reply["ucx_worker_address"])

    async def _send_control_unlocked(self, message: dict) -> None:
        """One tagged message `[u64 length][json]` (ucxx's send_obj takes two, each a round trip
        through its completion notifier); a message above `_CONTROL_BYTES` goes in two parts."""
        self._check_open()
        body = json.dumps(message, separators=(",", ":")).encode()
        frame = _CONTROL_HEADER.pack(len(body)) + body
        try:
            await asyncio.shield(self._request(self._ep.send(frame[:_CONTROL_BYTES])))
            if len(frame) > _CONTROL_BYTES:
                await asyncio.shield(self._request(self._ep.send(frame[_CONTROL_BYTES:])))
        except Exception as exc:
            raise self._failure(exc) from None
        self.mark_tx()

    async def send_control(self, message: dict) -> None:
        async with self._send_lock:
            await self._send_control_unlocked(message)

    async def recv_control(self) -> dict:
        self._check_open()
        first = bytearray(_CONTROL_BYTES)  # a shorter message fills only its head
        try:
            await asyncio.shield(self._request(self._ep.recv(first)))
            (length,) = _CONTROL_HEADER.unpack_from(first)
            end = _CONTROL_HEADER.size + length
            if end <= _CONTROL_BYTES:
                body = first[_CONTROL_HEADER.size:end]
            else:
                rest = bytearray(end - _CONTROL_BYTES)
                await asyncio.shield(self._request(self._ep.recv(rest)))
                body = first[_CONTROL_HEADER.size:] + rest
        except Exception as exc:
            raise self._failure(exc) from None
        self.mark_rx()
        return json.loads(bytes(body))

    async def send_data(self, header: dict, source: BlockSource) -> None:
        if self._free_buffers is None:
            self._free_buffers = asyncio.Queue()
            for _ in range(_PIPELINE_DEPTH):
                self._free_buffers.put_nowait(self._new_buffer())
        buffer = await self._free_buffers.get()
        async with self._send_lock:
            self._check_open()
            if not source.is_active():
                self._free_buffers.put_nowait(buffer)
                return
            staged = source.gather_into(buffer)
            if staged.is_cuda:
                torch.cuda.current_stream(staged.device).synchronize()
            # Post the payload right behind its header instead of after the header's completion
            # comes back through ucxx's notifier; the lock stays held until the header is out,
            # which keeps control messages in order.
            loop = asyncio.get_running_loop()
            control = loop.create_task(self._send_control_unlocked(dict(header, nbytes=source.nbytes)))
            task = loop.create_task(self._send_payload(staged, buffer))
            self._payload_sends.add(task)
            task.add_done_callback(self._payload_sends.discard)
            await control

    async def _send_payload(self, staged: torch.Tensor, buffer: torch.Tensor) -> None:
        try:
            if self._payload_tag is not None:
                endpoint = self._payload_ep or self._ep
                send = endpoint.send(_as_ucx_buffer(staged), tag=self._payload_tag, force_tag=True)
            else:
                send = self._ep.send(_as_ucx_buffer(staged), tag=_PAYLOAD_TAG)
            await asyncio.shield(self._request(send))
            self.mark_tx()
        except Exception as exc:
            self._error = self._failure(exc)
            self._abort_endpoint()  # wakes the connection's reader, which reports the failure
        finally:
            if self._free_buffers is not None:
                self._free_buffers.put_nowait(buffer)

    def _post_recvs(self) -> None:
        """Keep `_PIPELINE_DEPTH` payload receives posted, each into its own buffer, so the next
        payload lands (UCX's rendezvous starts) the moment the previous one completes, without
        waiting for this loop to get round to posting it. Tag matching keeps them in order."""
        self._check_open()
        while len(self._posted) < _PIPELINE_DEPTH:
            buffer = self._spare_buffers.pop() if self._spare_buffers else self._new_buffer()
            if self._payload_ep is not None:
                receive = self._payload_ep.recv(_as_ucx_buffer(buffer), tag=self._payload_tag, force_tag=True)
            else:
                receive = self._ep.recv(_as_ucx_buffer(buffer), tag=_PAYLOAD_TAG)
            self._posted.append((self._request(receive), buffer))

    async def recv_data(self, header: dict, sink: BlockSink | DiscardSink) -> bool:
        self._check_open()
        nbytes = int(header["nbytes"])
        if nbytes > self.max_payload_bytes:
            raise ChannelClosed(f"{self.peer} sent a {nbytes}-byte payload, above the "
                                f"{self.max_payload_bytes} bytes agreed")
        self._post_recvs()
        future, buffer = self._posted.popleft()
        try:
            await future
        except Exception as exc:
            raise self._failure(exc) from None
        self.mark_rx()
        self._post_recvs()  # into a spare buffer: this one is read below
        try:
            return sink.scatter_from(buffer[:nbytes])
        finally:
            if buffer.is_cuda:  # the scatter is only queued on the stream, and UCX writes the next
                torch.cuda.current_stream(buffer.device).synchronize()  # payload outside it
            self._spare_buffers.append(buffer)

    def _abort_endpoint(self) -> None:
        """Abort the control endpoint and the payload endpoint (cancelling their requests)."""
        endpoints = (self._ep, self._payload_ep)
        self._ep = self._payload_ep = None
        for endpoint in endpoints:
            if endpoint is None:
                continue
            try:
                endpoint.abort()
            except Exception as exc:  # already broken: nothing left to release
                _log.debug("ucx endpoint abort: %s", exc)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._abort_endpoint()  # UCX cancels or fails every request on these endpoints
        await cancel_and_wait(list(self._payload_sends))  # their requests run on, shielded
        if self._requests:
            _, unfinished = await asyncio.wait(set(self._requests), timeout=_CLOSE_WAIT_S)
            if unfinished:
                _log.warning("ucx: %d request(s) to %s still running %.0f s after the abort; "
                             "their buffers stay allocated until they end",
                             len(unfinished), self.peer, _CLOSE_WAIT_S)
                _UcxRuntime.keep_until_done(unfinished)
        self._posted.clear()
        self._free_buffers = None
        self._spare_buffers = []


class _UcxListener(Listener):
    def __init__(self, ctx: TransportContext, on_channel: Callable[[Channel], None]) -> None:
        ucxx = _import_ucxx()

        async def on_endpoint(endpoint) -> None:
            on_channel(UcxChannel(endpoint, ctx, f"ucx peer {endpoint.uid:#x}"))

        self._listener = ucxx.create_listener(on_endpoint, port=ctx.config.port,
                                              connect_timeout=ctx.config.timeout_s)
        self.endpoint = Endpoint("ucx", ctx.config.public_host, self._listener.port)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class UcxTransport(Transport):
    name = "ucx"

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            _import_ucxx()
        except Exception as exc:  # ImportError, or a missing/broken libucx
            return (f"ucxx cannot be imported ({type(exc).__name__}: {exc}); install it with "
                    "`pip install ucxx-cu12 libucx-cu12`")
        return None

    def acquire_shared_loop(self) -> LoopThread:
        return _UcxRuntime.acquire()

    def release_shared_loop(self) -> None:
        _UcxRuntime.release()

    async def listen(self, ctx: TransportContext,
                     on_channel: Callable[[Channel], None]) -> Listener:
        return _UcxListener(ctx, on_channel)

    async def connect(self, ctx: TransportContext, endpoint: Endpoint) -> Channel:
        ucxx = _import_ucxx()
        # ucxx's connection handshake receives into a buffer that its coroutine owns: cancelled
        # mid-way, it would free that buffer under UCX. So it always runs to its end; a cancelled
        # caller leaves it to the runtime, which aborts the endpoint it makes.
        creating = asyncio.ensure_future(ucxx.create_endpoint(endpoint.host, endpoint.port,
                                                              connect_timeout=ctx.config.timeout_s))
        try:
            ep = await asyncio.shield(creating)
        except asyncio.CancelledError:
            creating.add_done_callback(_abort_made_endpoint)
            _UcxRuntime.keep_until_done([creating])
            raise
        except Exception as exc:
            exc.__traceback__ = None  # see UcxChannel._failure
            raise TransferError(f"ucx connect to {endpoint} failed: {exc or type(exc).__name__}") from None
        return UcxChannel(ep, ctx, str(endpoint))
