"""Cross-memory attach: copy chunks straight out of another process's memory with
`process_vm_readv(2)` (Linux), one kernel copy, no shared buffer in between.

The OS must let this process read the other one: same user, and Yama's ptrace_scope 0 (or no
Yama), or CAP_SYS_PTRACE. Callers probe a known buffer first (`probe`) and fall back otherwise.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

import numpy as np

from .._chunk_copy import copy_chunks

_BATCH = 1024  # IOV_MAX: entries per call, each side


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_process_vm_readv():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                         ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    function.restype = ctypes.c_ssize_t
    return function


_PROCESS_VM_READV = _load_process_vm_readv()


def available() -> bool:
    return _PROCESS_VM_READV is not None


def _iovecs(addresses: np.ndarray, length: int) -> np.ndarray:
    table = np.empty((len(addresses), 2), dtype=np.uint64)
    table[:, 0] = addresses
    table[:, 1] = length
    return table


def read_chunks(pid: int, local: np.ndarray, remote: np.ndarray, chunk_nbytes: int,
                keep_writing: Callable[[], bool], threads: int = 1) -> bool:
    """Copy chunk `remote[i]` of process `pid` to local address `local[i]`, for all i, in
    batches; stop (False) as soon as `keep_writing()` turns False before a batch. Raises
    OSError when the other process cannot be read (gone, or not permitted).

    `threads` > 1 splits the chunks over that many threads: the copy is the kernel's, page by
    page, and one thread runs well below memory bandwidth (measured on a 2-vCPU VM with huge
    pages: 7.0 GB/s on one thread, 11.2 GB/s on two, memcpy 12.5 GB/s)."""
    return _split(functools.partial(_read_range, pid), local, remote, chunk_nbytes, keep_writing, threads)


def _split(copy_range: Callable[..., bool], local: np.ndarray, remote: np.ndarray, chunk_nbytes: int,
           keep_writing: Callable[[], bool], threads: int) -> bool:
    """Run `copy_range(local, remote, chunk_nbytes, keep_writing)` on `threads` even slices of the
    chunks at once; returns only after every slice has ended, True if all copied everything."""
    if threads <= 1 or len(local) < 2:
        return copy_range(local, remote, chunk_nbytes, keep_writing)
    edges = [len(local) * i // threads for i in range(threads + 1)]
    futures = [_pool(threads).submit(copy_range, local[lo:hi], remote[lo:hi], chunk_nbytes, keep_writing)
               for lo, hi in zip(edges, edges[1:]) if hi > lo]
    wait(futures)  # every slice has stopped writing before this returns or raises
    return all([future.result() for future in futures])


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """One process-wide pool per size; its threads are daemons that idle between copies."""
    with _POOLS_LOCK:
        if threads not in _POOLS:
            _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="kvtransfer-cma")
        return _POOLS[threads]


def _read_range(pid: int, local: np.ndarray, remote: np.ndarray, chunk_nbytes: int,
                keep_writing: Callable[[], bool]) -> bool:
    local_table, remote_table = _iovecs(local, chunk_nbytes), _iovecs(remote, chunk_nbytes)
    iovec_pointer = ctypes.POINTER(_IoVec)
    for start in range(0, len(local), _BATCH):
        if not keep_writing():
            return False
        count = min(_BATCH, len(local) - start)
        local_batch = local_table[start:start + count]
        remote_batch = remote_table[start:start + count]
        expected = count * chunk_nbytes
        copied = _PROCESS_VM_READV(pid, local_batch.ctypes.data_as(iovec_pointer), count,
                                   remote_batch.ctypes.data_as(iovec_pointer), count, 0)
        if copied < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"process_vm_readv from pid {pid}: {os.strerror(error)}")
        if copied != expected:
            raise OSError(f"process_vm_readv from pid {pid} copied {copied} of {expected} bytes")
    return True


def copy_local(local: np.ndarray, remote: np.ndarray, chunk_nbytes: int,
               keep_writing: Callable[[], bool], threads: int = 1) -> bool:
    """Like `read_chunks`, but `remote[i]` are addresses in this process (a peer's memory mapped
    here): `copy_chunks` per batch, split over `threads` (it releases the GIL)."""
    return _split(_copy_range, local, remote, chunk_nbytes, keep_writing, threads)


def _copy_range(local: np.ndarray, remote: np.ndarray, chunk_nbytes: int,
                keep_writing: Callable[[], bool]) -> bool:
    for start in range(0, len(local), _BATCH):
        if not keep_writing():
            return False
        copy_chunks(local[start:start + _BATCH], remote[start:start + _BATCH], chunk_nbytes)
    return True


def probe(pid: int, address: int, expected: bytes) -> bool:
    """Whether this process may read `expected` at `address` in process `pid`."""
    if _PROCESS_VM_READV is None:
        return False
    buffer = np.zeros(len(expected), dtype=np.uint8)
    try:
        read_chunks(pid, np.array([buffer.ctypes.data], dtype=np.uint64),
                    np.array([address], dtype=np.uint64), len(expected), lambda: True)
    except OSError:
        return False
    return buffer.tobytes() == expected
