"""Receiver addresses: `scheme://...` strings, possibly several joined by commas.

    tcp://HOST:PORT                 one TCP listener
    ucx://HOST:PORT                 one UCX listener
    nccl://HOST:PORT?store=PORT     TCP control listener + torch.distributed TCPStore
    shm://HOSTNAME/TOKEN            same-host Unix socket (abstract namespace) + shared memory
    shm://...,tcp://...             an `auto` receiver listening on several transports, best first
"""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

# The one registry of KV transports: each name (an address's scheme names its transport) and its
# class, as "module:Class" under kvtransfer/transports/ (factory.py imports a module when its
# transport is first asked for: ucx and nccl need optional packages), in the order `auto` prefers
# them where several are usable; each class's `name` is its key here. TRANSPORT_CHOICES is what a
# `--transport` flag takes. Here, not in factory.py, so that configs and command lines can name
# them without loading a transport.
TRANSPORT_CLASSES: dict[str, str] = {"tcp": "tcp:TcpTransport", "shm": "shm:ShmTransport",
                                     "ucx": "ucx:UcxTransport", "nccl": "nccl:NcclTransport"}
TRANSPORT_NAMES: tuple[str, ...] = tuple(TRANSPORT_CLASSES)
TRANSPORT_CHOICES: tuple[str, ...] = ("auto", *TRANSPORT_NAMES)


def check_transport_choice(name: str) -> None:
    """Raise ValueError unless `name` is a `--transport` choice."""
    if name not in TRANSPORT_CHOICES:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {name!r}")


@dataclass(frozen=True)
class Endpoint:
    """One `scheme://...` entry of a receiver address."""

    scheme: str
    host: str
    port: int | None = None
    path: str = ""
    query: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        netloc = self.host if self.port is None else f"{_bracket(self.host)}:{self.port}"
        text = f"{self.scheme}://{netloc}"
        if self.path:
            text += "/" + self.path
        if self.query:
            text += "?" + "&".join(f"{k}={v}" for k, v in sorted(self.query.items()))
        return text


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_address(address: str) -> list[Endpoint]:
    """Split and parse a receiver address; raise ValueError naming the bad part."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"receiver address must be a non-empty string, got {address!r}")
    endpoints = []
    for part in address.split(","):
        part = part.strip()
        parsed = urlsplit(part)
        if parsed.scheme not in TRANSPORT_NAMES:
            raise ValueError(f"address {part!r}: unknown transport {parsed.scheme!r} "
                             f"(known: {', '.join(TRANSPORT_NAMES)})")
        if not parsed.hostname:
            raise ValueError(f"address {part!r} names no host")
        try:
            port = parsed.port
        except ValueError as exc:
            raise ValueError(f"address {part!r}: bad port") from exc
        if parsed.scheme != "shm" and port is None:
            raise ValueError(f"address {part!r} names no port")
        path = parsed.path.lstrip("/")
        if parsed.scheme == "shm" and not path:
            raise ValueError(f"address {part!r} names no shared-memory token")
        endpoints.append(Endpoint(scheme=parsed.scheme, host=parsed.hostname, port=port, path=path,
                                  query=dict(parse_qsl(parsed.query))))
    return endpoints


def join_address(endpoints: list[Endpoint]) -> str:
    return ",".join(str(endpoint) for endpoint in endpoints)
