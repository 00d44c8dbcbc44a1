"""Native CPU kernels (C++ in `engine/csrc/`), compiled once per machine and cached.

One library: paged decode attention, bf16 flash prefill (both with the attention variants:
sliding window, logit soft-cap, sinks) and the KV store (used by the "cpu" attention backend),
the Llama block's fused bf16 elementwise ops and small-batch linear (RMSNorm, residual add +
RMSNorm, SiLU-and-mul, RoPE; used by `engine.model.fused_ops`), the structured-output logits
mask (`engine.structured_output.apply_bitmask`), and a mixture of experts' routed experts for a
decode-sized batch in one call (`moe_experts`, used by `engine.model.moe.run_experts`).
DeepSeek's latent attention (MLA) for decodes over the paged latent cache, float or 8-bit, read in
place (`latent_decode_attention`, used by the "cpu" backend's `latent_attention`).
Those two are on in AVX2 builds; AVX-512 builds report them absent (`has_moe_experts`,
`has_latent_decode`) until their 16-lane paths have run on an AVX-512 machine.

`load()` returns the compiled module, or None when it cannot be built here (no C++ compiler or
ninja, `PDSERVE_CPU_KERNELS=0`); callers then use the plain torch path, which gives the same
results more slowly. `make install` builds it (`python -m engine.cpu_kernels`); later processes
load the cached library from torch's extension directory (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), with a file lock so concurrent workers build it only once.

The build is content-addressed: the sources are copied into the build folder, whose name hashes
their bytes, this CPU's flags (`-march=native`), the compiler flags and torch's version. So the
compile commands ninja records never depend on the checkout's path, the working directory or the
environment of the process that loads it, and every checkout of the same sources on a machine
shares one build.
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
            for name in ("bindings.cpp", "paged_decode_cpu.cpp", "kv_store_cpu.cpp",
                         "flash_prefill_cpu.cpp", "fused_ops_cpu.cpp", "small_linear_cpu.cpp", "token_mask_cpu.cpp",
                         "moe_cpu.cpp", "latent_decode_cpu.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("simd_math.h", "parallel.h", "row_ops.h")]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor()


ISA_ENV = "PDSERVE_CPU_ISA"
ISAS = ("auto", "native", "avx2")
# native: this CPU's own instruction set (its AVX-512 / AVX512-BF16 code paths where it has them);
# avx2: any AVX2 + FMA CPU (x86-64-v3), the portable path, the one AVX2-only machines get anyway.
# Both tuned generically: GCC's -march=native also tunes for the CPU, and its Zen 4 tuning made the
# fp32 small-batch linear 1.6x slower (64 rows: 4.76 vs 3.03 ms per SmolLM2-135M layer, measured
# interleaved in one process; a batch-64 decode step 268 -> 184-194 ms).
_MARCH = {"native": ("-march=native", "-mtune=generic"), "avx2": ("-march=x86-64-v3",)}
# -ffp-contract=off: a product followed by a sum stays two roundings (GCC would otherwise fuse the
# intrinsics' vector mul and add into an FMA), so the float32 fused ops round as torch does.
_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
_LDFLAGS = ("-fopenmp",)  # torch's parallel_for is OpenMP here; linking libgomp by soname reuses torch's copy


def isa() -> str:
    """The instruction set the kernels are built for: $PDSERVE_CPU_ISA, or (auto) avx2 on an AVX2
    CPU without AVX-512, else native. `PDSERVE_CPU_ISA=avx2` forces the portable path on any AVX2
    CPU (an AVX-512 machine then runs what AVX2-only machines run)."""
    wanted = os.environ.get(ISA_ENV, "auto")
    if wanted not in ISAS:
        raise ValueError(f"${ISA_ENV} must be one of {', '.join(ISAS)}, got {wanted!r}")
    flags = set(_cpu_flags().split())
    has_avx2 = {"avx2", "fma"} <= flags
    if wanted == "auto":
        return "avx2" if has_avx2 and "avx512f" not in flags else "native"
    if wanted == "avx2" and not has_avx2:
        raise ValueError(f"${ISA_ENV}=avx2, but this CPU has no AVX2 + FMA")
    return wanted


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16); elsewhere bf16 weights
    and activations go through conversions and run slower than float32."""
    flags = set(_cpu_flags().split())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_features() -> list[str]:
    """The SIMD features of this CPU that the kernels care about (for benchmark reports)."""
    flags = set(_cpu_flags().split())
    return [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16")
            if f in flags]


def cpu_model() -> str:
    """This CPU's model name (for benchmark reports), with the widest of its vector ISAs."""
    name = None
    try:
        name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), None)
    except OSError:
        pass
    if name is None:
        import platform
        name = platform.processor() or platform.machine()
    features = cpu_features()
    widest = ("AMX" if "amx_bf16" in features else "AVX512-BF16" if "avx512_bf16" in features
              else "AVX-512" if "avx512f" in features else "AVX2")
    return f"{name} ({widest})"


def _compile_flags() -> list[str]:
    return [*_CFLAGS, *_MARCH[isa()]]


def build_name() -> str:
    """The library's cache name: a hash of everything that decides what is compiled."""
    import torch
    key = b"".join(source.read_bytes() + b"\0" for source in [*_SOURCES, *_HEADERS])
    key += "\0".join([_cpu_flags(), torch.__version__, *_compile_flags(), *_LDFLAGS]).encode()
    return f"pdserve_cpu_kernels_{hashlib.sha256(key).hexdigest()[:12]}"


@functools.lru_cache(maxsize=1)
def load():
    """The compiled kernels module, or None (logged once) when they cannot be built."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root
        from torch.utils.cpp_extension import load as load_extension
        name = build_name()
        build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
        sources = _copy_sources(build_dir / "src")
        _remove_stale_lock(build_dir / "lock")
        library = next(build_dir.glob(f"{name}*.so"), None)
        if library is None:
            log.info("compiling pdserve's CPU kernels (%s) into %s (once per machine and source version; about a "
                     "minute)", isa(), build_dir)
        started = time.monotonic()
        module = load_extension(name=name, sources=[str(source) for source in sources],
                                build_directory=str(build_dir), extra_cflags=_compile_flags(),
                                extra_ldflags=list(_LDFLAGS), verbose=False)
        if library is None:
            log.info("compiled pdserve's CPU kernels in %.0f s", time.monotonic() - started)
        return module
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        log.warning("pdserve CPU kernels unavailable (%s); attention and elementwise ops use the slower torch path",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def _copy_sources(folder: Path) -> list[Path]:
    """The sources and headers, copied into `folder` unless already there. Never rewritten: ninja
    would see a newer source and rebuild. The folder's name already says what is in it."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in [*_SOURCES, *_HEADERS]:
        target = folder / source.name
        if not target.exists():
            temporary = folder / f".{source.name}.{os.getpid()}.tmp"
            temporary.write_bytes(source.read_bytes())
            try:
                os.link(temporary, target)  # atomic, and fails if another process got there first
            except FileExistsError:
                pass
            finally:
                temporary.unlink()
    return [folder / source.name for source in _SOURCES]


_STALE_LOCK_S = 900.0  # a build takes ~70 s on 2 vCPUs; a lock this old belongs to a builder that died


def _remove_stale_lock(lock: Path) -> None:
    """torch waits forever on the build lock; a process killed mid-build (a worker stopped while
    starting) would leave every later worker hanging at start-up. Drop such a lock."""
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
            log.warning("removed a stale CPU-kernel build lock %s", lock)
    except FileNotFoundError:
        pass


if __name__ == "__main__":  # `make install`: build now, not in the first worker
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"native CPU kernels ({isa()}; CPU features: {' '.join(cpu_features())}):",
          "ready" if load() is not None else "unavailable, using the torch path")
