"""Copy lists of equal-sized chunks between host addresses: the CPU copy every transport shares
(shm's mapped reads, its ring's gather and scatter, the staging of ucx and nccl).

`copy_chunks` runs `csrc/chunk_copy.c` (streaming stores, prefetch; one call per batch) when a C
compiler was found, else a `ctypes.memmove` per chunk. The library is plain C with no Python or
torch headers, so it builds in well under a second on first use and is cached in `native/` of
pdserve's cache root (`$PDSERVE_CACHE_DIR/native`, default `~/.cache/pdserve/native`) under a hash
of its source and compiler. The
build writes a private file and renames it into place, so processes starting together need no
lock. `PDSERVE_NATIVE_COPY=0` turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "chunk_copy.c"
_U64_POINTER = ctypes.POINTER(ctypes.c_uint64)


def _compiler() -> str | None:
    configured = (sysconfig.get_config_var("CC") or "").split()
    for candidate in (os.environ.get("CC"), configured[0] if configured else None, "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _cache_dir() -> Path:
    """`native/` of pdserve's cache root. The root is defined in engine/paths.py, which kvtransfer
    may not import (it imports no other project package): this is the same read of the same
    variable with the same default (tests/test_wheel_install.py checks that they agree)."""
    root = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join("~", ".cache", "pdserve")
    return Path(os.path.abspath(os.path.expanduser(root))) / "native"


@functools.lru_cache(maxsize=1)
def _library():
    """The compiled `pdkv_copy_chunks`, or None (logged once) when it cannot be built here."""
    if os.environ.get("PDSERVE_NATIVE_COPY", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("kvtransfer: no C compiler found; chunk copies use ctypes.memmove (slower)")
        return None
    digest = hashlib.sha256(_SOURCE.read_bytes() + compiler.encode()).hexdigest()[:12]
    target = _cache_dir() / f"kvtransfer_chunk_copy_{digest}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            handle, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
            os.close(handle)
            try:
                subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", partial, str(_SOURCE)],
                               check=True, capture_output=True, text=True, timeout=120)
                os.replace(partial, target)
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        log.warning("kvtransfer: cannot build %s (%s); chunk copies use ctypes.memmove (slower)",
                    _SOURCE.name, detail.strip().splitlines()[0] if detail.strip() else type(exc).__name__)
        return None
    function = library.pdkv_copy_chunks
    function.argtypes = [_U64_POINTER, _U64_POINTER, ctypes.c_size_t, ctypes.c_size_t]
    function.restype = None
    return function


def native() -> bool:
    """Whether copies run in the compiled routine."""
    return _library() is not None


def copy_chunks(dst: np.ndarray, src: np.ndarray, nbytes: int) -> None:
    """Copy `nbytes` from address `src[i]` to address `dst[i]` for every i (uint64 arrays of
    equal length; chunks must not overlap). Releases the GIL while it copies."""
    if len(dst) != len(src):
        raise ValueError(f"{len(dst)} destinations for {len(src)} sources")
    function = _library()
    if function is None:
        memmove = ctypes.memmove
        for to, of in zip(dst.tolist(), src.tolist()):
            memmove(to, of, nbytes)
        return
    dst = np.ascontiguousarray(dst, dtype=np.uint64)
    src = np.ascontiguousarray(src, dtype=np.uint64)
    function(dst.ctypes.data_as(_U64_POINTER), src.ctypes.data_as(_U64_POINTER), len(dst), nbytes)
