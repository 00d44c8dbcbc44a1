"""Native CPU kernels (C++ in `engine/csrc/`), compiled on first use and cached per machine.

One library: paged decode attention, bf16 flash prefill and the KV store (used by the "cpu"
attention backend), the Llama block's fused bf16 elementwise ops and small-batch linear (RMSNorm,
residual add + RMSNorm, SiLU-and-mul, RoPE; used by `engine.model.fused_ops`), and the
structured-output logits mask (`engine.structured_output.apply_bitmask`).

`load()` returns the compiled module, or None when it cannot be built here (no C++ compiler or
ninja, `PDSERVE_CPU_KERNELS=0`); callers then use the plain torch path, which gives the same
results more slowly. The build takes ~30 s once; later processes load the cached library from
torch's extension directory (`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), with a
file lock so concurrent workers build it only once. The library is compiled for this CPU
(`-march=native`), so its cache name includes a hash of the source, its path and the CPU's flags.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("bindings.cpp", "paged_decode_cpu.cpp", "kv_store_cpu.cpp", "flash_prefill_cpu.cpp",
                         "fused_ops_cpu.cpp", "small_linear_cpu.cpp", "token_mask_cpu.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("simd_math.h", "parallel.h")]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor()


@functools.lru_cache(maxsize=1)
def load():
    """The compiled kernels module, or None (logged once) when they cannot be built."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    # The source's path is in the name too: ninja rebuilds when its command line changes, so two
    # checkouts sharing one name would keep rebuilding over each other.
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in [*_SOURCES, *_HEADERS]) + _cpu_flags().encode()
                            + str(_SOURCES[0].resolve()).encode()).hexdigest()[:12]
    name = f"pdserve_cpu_kernels_{digest}"
    try:
        from torch.utils.cpp_extension import get_default_build_root
        from torch.utils.cpp_extension import load as load_extension
        build_dir = Path(get_default_build_root()) / name
        build_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(build_dir / "lock")
        return load_extension(
            name=name, sources=[str(source) for source in _SOURCES], build_directory=str(build_dir),
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            # torch's parallel_for is OpenMP here; linking libgomp by soname reuses torch's copy.
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        log.warning("pdserve CPU kernels unavailable (%s); attention and elementwise ops use the slower torch path",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


_STALE_LOCK_S = 600.0  # a build takes ~30 s; a lock this old belongs to a builder that died


def _remove_stale_lock(lock: Path) -> None:
    """torch waits forever on the build lock; a process killed mid-build (a worker stopped while
    starting) would leave every later worker hanging at start-up. Drop such a lock."""
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
            log.warning("removed a stale CPU-kernel build lock %s", lock)
    except FileNotFoundError:
        pass
