"""tcp: asyncio-driven sockets; payloads go straight from source blocks into destination
blocks with scatter/gather syscalls (sendmsg / recvmsg_into), no intermediate copy for caches
in host memory."""
from __future__ import annotations

import socket
from typing import Callable

from .._common import accept_connections, cancel_and_wait
from ..addresses import Endpoint
from ._stream import AsyncSocket, SocketPayloadChannel
from .base import Channel, Listener, Transport, TransportContext

def tune_tcp_socket(sock: socket.socket) -> None:
    """No Nagle delay for the small control messages; buffer sizes are left to the kernel's
    autotuning, which beats any fixed size on both loopback and real links."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpListener(Listener):
    """Accepts TCP connections and hands each one to `on_socket`."""

    def __init__(self, ctx: TransportContext, scheme: str,
                 on_socket: Callable[[socket.socket, str], None]) -> None:
        config = ctx.config
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((config.host, config.port))
            self._sock.listen(128)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        self.endpoint = Endpoint(scheme, config.public_host, self.port)
        self._on_socket = on_socket
        self._task = ctx.loop.create_task(accept_connections(ctx.loop, self._sock, self._accepted, str(self.endpoint)))

    def _accepted(self, conn: socket.socket, peer: tuple) -> None:
        tune_tcp_socket(conn)
        self._on_socket(conn, f"{peer[0]}:{peer[1]}")

    async def close(self) -> None:
        await cancel_and_wait([self._task])
        self._sock.close()


async def open_tcp_socket(ctx: TransportContext, host: str, port: int) -> socket.socket:
    infos = await ctx.loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, protocol, _, address = infos[0]
    sock = socket.socket(family, kind, protocol)
    sock.setblocking(False)
    try:
        await ctx.loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    tune_tcp_socket(sock)
    return sock


class TcpTransport(Transport):
    name = "tcp"

    async def listen(self, ctx: TransportContext,
                     on_channel: Callable[[Channel], None]) -> Listener:
        def on_socket(conn: socket.socket, peer: str) -> None:
            on_channel(SocketPayloadChannel(AsyncSocket(conn, ctx.loop, f"tcp://{peer}")))

        return TcpListener(ctx, "tcp", on_socket)

    async def connect(self, ctx: TransportContext, endpoint: Endpoint) -> Channel:
        sock = await open_tcp_socket(ctx, endpoint.host, endpoint.port)
        return SocketPayloadChannel(AsyncSocket(sock, ctx.loop, str(endpoint)))
