"""Configuration shared by senders and receivers of every transport."""
from __future__ import annotations

from dataclasses import dataclass, field

AUTH_KEY_BYTES = 32  # TransferConfig.auth_key: a raw 256-bit key


@dataclass(frozen=True)
class TransferConfig:
    """Timeouts, listening address and buffer sizes.

    timeout_s: a peer that sends nothing (data, acknowledgement or heartbeat) for this long
        while a transfer depends on it is declared dead and its transfers end FAILED; also
        bounds connecting and the layout handshake.
    pending_timeout_s: a receiver fails an expected transfer that no sender started within
        this long (None: wait until cancelled).
    host / port: where a receiver listens (port 0: any free port).
    advertise_host: the host written into `receiver.address` (default: `host`).
    max_message_bytes: the largest single data message; bounds the staging buffers of the
        staged transports (ucx, nccl, GPU caches over tcp).
    shm_slot_bytes / shm_num_slots: the shared-memory ring of one shm connection.
    shm_cross_memory_attach: let a same-host receiver copy blocks straight out of the sender's
        memory (process_vm_readv: one copy instead of two through the ring, and no CPU spent
        by the sender) when both sides enable it and the OS permits it; else the ring. Off by
        default: on caches in 4 KiB pages it measured slower end to end than the ring (see
        kvtransfer/README.md); with huge pages it is the faster one.
    shm_copy_threads: threads a receiver splits each cross-memory copy over (the kernel's
        page-by-page copy runs well below memory bandwidth on one thread).
    shm_mapped: when the sender's caches lie in shared memory (`create_sender(...,
        shared_memory=...)`), let a same-host receiver map them read-only and copy blocks
        straight out (one memcpy per chunk; preferred over cross-memory reads and the ring).
        Both sides must allow it.
    ucx_same_host_fast_path: between two processes of one host (same boot, network, PID and
        IPC namespaces) with CPU caches, send ucx payloads over a second UCX endpoint that UCX
        may put on its shared-memory transports (cma, sysv), which it offers only to endpoints
        without UCX-level peer-failure handling; the control endpoint keeps that handling and
        watches the peer. Both sides must allow it; otherwise payloads take the control
        endpoint's path (TCP on one host).
    auth_key: a shared secret of AUTH_KEY_BYTES bytes (None: no authentication). A receiver
        with a key accepts a connection only once its sender proved the same key, a sender with
        one only a receiver that proved it (a challenge-response at the handshake: the key never
        crosses the wire; kvtransfer/_auth.py). Both sides must have it, or neither: a refused
        handshake fails the sender's transfers ("KV handshake refused: ..."). Not in `repr`.
    """

    timeout_s: float = 5.0
    pending_timeout_s: float | None = 120.0
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    max_message_bytes: int = 16 << 20
    shm_slot_bytes: int = 16 << 20
    shm_num_slots: int = 4
    shm_cross_memory_attach: bool = False
    shm_copy_threads: int = 2
    shm_mapped: bool = True
    ucx_same_host_fast_path: bool = True
    auth_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.pending_timeout_s is not None and not self.pending_timeout_s > 0:
            raise ValueError(f"pending_timeout_s must be > 0 or None, got {self.pending_timeout_s!r}")
        if not self.host:
            raise ValueError("host must be a non-empty host name or IP address")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_message_bytes < 4096:
            raise ValueError(f"max_message_bytes must be >= 4096, got {self.max_message_bytes}")
        if self.shm_slot_bytes < 4096:
            raise ValueError(f"shm_slot_bytes must be >= 4096, got {self.shm_slot_bytes}")
        if self.shm_copy_threads < 1:
            raise ValueError(f"shm_copy_threads must be >= 1, got {self.shm_copy_threads}")
        if self.shm_num_slots < 1:
            raise ValueError(f"shm_num_slots must be >= 1, got {self.shm_num_slots}")
        if self.auth_key is not None and (not isinstance(self.auth_key, bytes)
                                          or len(self.auth_key) != AUTH_KEY_BYTES):
            got = (f"{len(self.auth_key)} bytes" if isinstance(self.auth_key, bytes)
                   else type(self.auth_key).__name__)  # never the value: it is a secret
            raise ValueError(f"auth_key must be None or {AUTH_KEY_BYTES} bytes, got {got}")

    @property
    def heartbeat_interval_s(self) -> float:
        """How often an idle connection sends a heartbeat: well inside `timeout_s`."""
        return self.timeout_s / 4

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host
