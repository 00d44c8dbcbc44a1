"""Host memory a same-host peer can map: the sender's side of shm's mapped data path.

A sender whose caches lie in a shared-memory file (a memfd) hands `SharedMemory` to
`create_sender`; the shm transport then passes the descriptor to each same-host receiver over
its Unix socket, and the receiver maps the sender's caches read-only and copies blocks straight
out of them: one memcpy per chunk, no staging, no permission beyond the descriptor itself
(unlike process_vm_readv, which Yama may forbid).
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedMemory:
    """`nbytes` bytes of the file `fd`, mapped shared at `address` in this process."""

    fd: int
    address: int
    nbytes: int

    def covers(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.nbytes


def allocate_shared(nbytes: int, name: str = "pdserve-kv") -> tuple[torch.Tensor, SharedMemory, mmap.mmap]:
    """A zeroed uint8 tensor of `nbytes` in a fresh memfd, its `SharedMemory`, and the mapping
    (keep it, and the fd, alive as long as the tensor). Linux only.

    Every page is allocated now (MAP_POPULATE), as `engine.kv_cache.allocate_kv_cache` does for a
    worker's shared cache: a receiver maps the whole file with MAP_POPULATE at its first
    connection, which on untouched pages allocates them (~1.4 s per 512 MiB, not ~30 ms)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return tensor, SharedMemory(fd, tensor.data_ptr(), nbytes), mapping
