"""Transfer states, the status snapshot that `poll()` returns, kvtransfer's exceptions and how a
layout mismatch names the values and the sliding windows (torch-free: the wire imports it)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class TransferState(enum.Enum):
    PENDING = "pending"  # known, no byte moved yet
    TRANSFERRING = "transferring"  # bound to a peer, some layers may have arrived
    SUCCESS = "success"  # every expected layer written (receiver) / acknowledged (sender)
    FAILED = "failed"  # ended without success; `error` says why

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)


@dataclass(frozen=True)
class TransferStatus:
    """A snapshot of one transfer, as seen by the side that polled it."""

    request_id: str
    state: TransferState
    error: str | None
    bytes_transferred: int  # bytes written into the receiver's blocks (acknowledged, on the sender)
    layers_done: int  # layers complete on the receiver (acknowledged, on the sender)
    num_layers: int  # layers the transfer covers
    # receiver: the epoch the sender announced in its `begin` (0 before it began); it names
    # the process incarnation whose bytes landed, which a caller can check against its report
    producer_epoch: int = 0
    # sender: it failed because a handshake was refused for want of the shared auth_key (either
    # side refused: the keys differ, or only one side has one); `error` says which
    auth_refused: bool = False

    @property
    def done(self) -> bool:
        return self.state.is_terminal

    @property
    def ok(self) -> bool:
        return self.state is TransferState.SUCCESS


class TransferError(RuntimeError):
    """A transfer or connection failed; the message says why."""


class LayoutMismatchError(TransferError):
    """The two sides describe different KV cache layouts."""


class AuthenticationError(TransferError):
    """A KV handshake was refused: the peer did not prove the shared key (`TransferConfig.auth_key`),
    or only one side has one."""


class TransportUnavailableError(TransferError):
    """The requested transport cannot be used in this process (missing dependency, platform)."""


def dtype_description(kv_format: str, dtype: str) -> str:
    """How a layout's values are named in mismatch messages (this side's and a peer's alike)."""
    return f"{kv_format} with float32 scales and bf16 K references" if kv_format else dtype


def windows_description(layer_windows: Sequence[int]) -> str:
    """A layout's per-layer sliding windows (tokens, 0 = full attention) in mismatch messages, runs
    of one value folded: [512, 512, 0] -> "512x2, full"."""
    runs: list[list] = []
    for window in layer_windows:
        if runs and runs[-1][0] == window:
            runs[-1][1] += 1
        else:
            runs.append([window, 1])
    return ", ".join(f"{window or 'full'}x{count}" if count > 1 else f"{window or 'full'}"
                     for window, count in runs)
