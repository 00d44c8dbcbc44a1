"""Native CPU kernels (C++ in `engine/csrc/`), compiled once per machine and cached.

One library: paged decode attention, bf16 flash prefill (both with the attention variants:
sliding window, logit soft-cap, sinks) and the KV store (used by the "cpu" attention backend),
the Llama block's fused bf16 elementwise ops and small-batch linear (RMSNorm, residual add +
RMSNorm, SiLU-and-mul, RoPE; used by `engine.model.fused_ops`), the structured-output logits
mask (`engine.structured_output.apply_bitmask`), and a mixture of experts' routed experts for a
decode-sized batch in one call (`moe_experts`, used by `engine.model.moe.run_experts`).
DeepSeek's latent attention (MLA) for decodes over the paged latent cache, float or 8-bit, read in
place (`latent_decode_attention`, used by the "cpu" backend's `latent_attention`). Linear layers
whose weights stay in a GGUF block format (`gguf_linear`, `gguf_dequantize`, used by
`engine.model.quant_linear`).
Those two are on in AVX2 builds; AVX-512 builds report them absent (`has_moe_experts`,
`has_latent_decode`) until their 16-lane paths have run on an AVX-512 machine.

`load()` returns the compiled module, or None when it cannot be built here (no C++ compiler or
ninja, `PDSERVE_CPU_KERNELS=0`); callers then use the plain torch path, which gives the same
results more slowly. `make install` builds it (`python -m engine.cpu_kernels`) in `native/` of pdserve's
cache root (`$PDSERVE_CACHE_DIR/native`, default `~/.cache/pdserve/native`; engine/paths.py), or in
`$TORCH_EXTENSIONS_DIR` when that is set, with torch's file lock so concurrent workers build it only once.

The build is content-addressed: the sources are copied into the build folder, whose name hashes
their bytes, this CPU's flags, the instruction set chosen (`PDSERVE_CPU_ISA`) and the compiler
flags, torch's version and Python's extension ABI. So a folder's name says everything that decides
its library, and every checkout of the same sources on a machine shares one build. A finished
build leaves a stamp naming its library (`built`); a later process that finds it imports that
library directly, running neither ninja nor the compiler, so neither its PATH, its working directory
nor its environment can make it rebuild. Only a missing stamp (a new key, or an unfinished build)
goes through torch's build.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sysconfig
import time
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("bindings.cpp", "paged_decode_cpu.cpp", "kv_store_cpu.cpp",
                         "flash_prefill_cpu.cpp", "fused_ops_cpu.cpp", "small_linear_cpu.cpp", "token_mask_cpu.cpp",
                         "moe_cpu.cpp", "latent_decode_cpu.cpp", "gguf_linear_cpu.cpp")]
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
    # EXT_SUFFIX: the library is a CPython extension module, tied to this Python's ABI (torch's
    # version string is the same for every Python it is built for).
    key += "\0".join([_cpu_flags(), torch.__version__, sysconfig.get_config_var("EXT_SUFFIX") or "",
                      *_compile_flags(), *_LDFLAGS]).encode()
    return f"pdserve_cpu_kernels_{hashlib.sha256(key).hexdigest()[:12]}"


_STAMP = "built"  # in a build folder: the file name of the library a finished build produced


@functools.lru_cache(maxsize=1)
def load():
    """The compiled kernels module, or None (logged once) when they cannot be built. A library
    already built for this key is imported directly; only a missing one is built."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from engine.paths import native_dir
        name = build_name()
        build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or native_dir()) / name
        library = built_library(build_dir)
        if library is not None:
            try:
                return _import_library(library)
            except ImportError as exc:  # a damaged library: let the build have a go
                log.warning("could not load the built CPU kernels %s (%s); building them", library, exc)
        return _build(name, build_dir)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        log.warning("pdserve CPU kernels unavailable (%s); attention and elementwise ops use the slower torch path",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def built_library(build_dir: Path) -> Path | None:
    """The library a finished build left in `build_dir` (its stamp names it), or None."""
    try:
        library = build_dir / (build_dir / _STAMP).read_text().strip()
    except FileNotFoundError:
        return None
    return library if library.is_file() and library.parent == build_dir else None


def _import_library(library: Path):
    """Import a built extension module by its path, as torch's loader does once ninja is done."""
    import torch  # noqa: F401 - the library links libtorch by soname: torch must be loaded first
    spec = importlib.util.spec_from_file_location(library.name.split(".")[0], library)
    if spec is None or spec.loader is None:
        raise ImportError(f"not an extension module: {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, build_dir: Path):
    """Build (or, when ninja finds it up to date, just load) the library through torch, then stamp
    the folder so later processes import it directly."""
    from torch.utils.cpp_extension import load as load_extension
    sources = _copy_sources(build_dir / "src")
    _remove_stale_lock(build_dir / "lock")
    compiling = next(build_dir.glob(f"{name}*.so"), None) is None
    if compiling:
        log.info("compiling pdserve's CPU kernels (%s) into %s (once per machine and source version; about a "
                 "minute)", isa(), build_dir)
    started = time.monotonic()
    module = load_extension(name=name, sources=[str(source) for source in sources],
                            build_directory=str(build_dir), extra_cflags=_compile_flags(),
                            extra_ldflags=list(_LDFLAGS), verbose=False)
    if compiling:
        log.info("compiled pdserve's CPU kernels in %.0f s", time.monotonic() - started)
    stamp = build_dir / f".{_STAMP}.{os.getpid()}.tmp"
    stamp.write_text(Path(module.__file__).name + "\n")
    os.replace(stamp, build_dir / _STAMP)  # atomic: a reader sees no stamp or a whole one
    return module


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
