"""The native CPU kernels are compiled once per machine: a fresh process elsewhere (another
working directory, another environment, lower priority, imported from another copy of the
sources) loads the cached library without running the compiler."""
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine import cpu_kernels

REPO = Path(__file__).resolve().parents[2]


def fake_compilers(folder: Path, marker: Path) -> None:
    """`c++`, `g++`, `cc`, `gcc` that record a compile or link (and fail it); queries such as
    `-dumpversion` go to the real compiler."""
    real = shutil.which("c++") or shutil.which("g++")
    folder.mkdir()
    for name in ("c++", "g++", "cc", "gcc"):
        script = folder / name
        script.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -c|-shared) echo "$0 $*" >> {marker}; '
                          f'exit 1;; esac; done\nexec {real} "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_a_fresh_process_elsewhere_loads_the_built_kernels_without_compiling(tmp_path):
    if cpu_kernels.load() is None:
        pytest.skip("the native kernels cannot be built on this machine (no compiler or ninja)")
    copy = tmp_path / "another-checkout"  # the same sources at another path
    shutil.copytree(REPO / "engine", copy / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    marker = tmp_path / "compiler-ran"
    fake_compilers(tmp_path / "bin", marker)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(copy),
           "OMP_NUM_THREADS": "1", "PDSERVE_SOMETHING_ELSE": "1", "MAX_JOBS": "1"}
    code = ("import engine.cpu_kernels as k; assert k.__file__.startswith(%r), k.__file__; "
            "print('loaded' if k.load() is not None else 'unavailable')" % str(copy))
    result = subprocess.run(["nice", "-n", "5", sys.executable, "-c", code], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), f"the compiler ran:\n{marker.read_text()}"
    assert result.stdout.strip() == "loaded", result.stderr


def failing_build_tools(folder: Path, marker: Path) -> None:
    """`ninja`, `c++`, `g++`, `cc`, `gcc` that record any call, queries included, and fail it."""
    folder.mkdir()
    for name in ("ninja", "c++", "g++", "cc", "gcc"):
        script = folder / name
        script.write_text(f'#!/bin/sh\necho "$0 $*" >> {marker}\nexit 1\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_a_built_library_is_imported_without_running_the_build_tool(tmp_path):
    """After `make install`, a process started elsewhere with `PATH=/usr/bin:/bin` (a distribution's
    ninja first, or none) loads the kernels without asking ninja or the compiler anything."""
    if cpu_kernels.load() is None:
        pytest.skip("the native kernels cannot be built on this machine (no compiler or ninja)")
    marker = tmp_path / "build-tool-ran"
    failing_build_tools(tmp_path / "bin", marker)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**os.environ, "PATH": os.pathsep.join([str(tmp_path / "bin"), "/usr/bin", "/bin"]),
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    code = ("import torch; import engine.cpu_kernels as k; m = k.load(); assert m is not None, 'unavailable'\n"
            "if m.has_fused_ops():\n"
            "    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)\n"
            "    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.float()\n"
            "    torch.testing.assert_close(m.rms_norm(x, w, 1e-6).float(), ref, atol=0.1, rtol=0.02)\n"
            "print('loaded', m.__file__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=600)
    assert not marker.exists(), f"the build tool or compiler ran:\n{marker.read_text()}"
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("loaded "), result.stderr
    library = Path(result.stdout.split(" ", 1)[1].strip())  # the one `make install` built, from its stamp
    assert library.parent.name == cpu_kernels.build_name() and cpu_kernels.built_library(library.parent) == library


def test_only_a_missing_library_is_built(tmp_path, monkeypatch):
    """The stamp of a finished build decides: with it the library it names is imported, without it
    (or with that library gone, or under another key) torch's build runs. (The real import, in a
    fresh process, is the test above.)"""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_CPU_KERNELS", raising=False)
    name = cpu_kernels.build_name()
    calls = []

    def fake_build(name_, build_dir):
        calls.append(("build", name_))
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / f"{name_}.so").write_bytes(b"")
        (build_dir / cpu_kernels._STAMP).write_text(f"{name_}.so\n")
        return "built"

    def fake_import(library):
        calls.append(("import", library))
        return "imported"

    monkeypatch.setattr(cpu_kernels, "_build", fake_build)
    monkeypatch.setattr(cpu_kernels, "_import_library", fake_import)
    load = cpu_kernels.load.__wrapped__  # past the per-process cache
    assert load() == "built" and calls == [("build", name)]  # nothing there
    library = tmp_path / name / f"{name}.so"
    assert cpu_kernels.built_library(library.parent) == library
    assert load() == "imported" and calls[1:] == [("import", library)]  # stamped: imported, not built
    library.unlink()  # the stamp names a library that is gone
    assert cpu_kernels.built_library(library.parent) is None
    assert load() == "built" and calls[2:] == [("build", name)]
    (library.parent / cpu_kernels._STAMP).write_text("../elsewhere.so\n")  # only a library of this folder
    assert cpu_kernels.built_library(library.parent) is None
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "native" if cpu_kernels.isa() == "avx2" else "avx2")
    try:
        other = cpu_kernels.build_name()  # another instruction set: another key, another folder
    except ValueError:  # this CPU has no AVX2
        return
    assert other != name
    assert load() == "built" and calls[3:] == [("build", other)]


def test_the_build_name_hashes_the_sources_not_their_path(tmp_path, monkeypatch):
    name = cpu_kernels.build_name()
    copies = []
    for source in [*cpu_kernels._SOURCES, *cpu_kernels._HEADERS]:
        copy = tmp_path / source.name
        copy.write_bytes(source.read_bytes())
        copies.append(copy)
    count = len(cpu_kernels._SOURCES)
    monkeypatch.setattr(cpu_kernels, "_SOURCES", copies[:count])
    monkeypatch.setattr(cpu_kernels, "_HEADERS", copies[count:])
    assert cpu_kernels.build_name() == name
    copies[0].write_bytes(copies[0].read_bytes() + b"\n// changed\n")
    assert cpu_kernels.build_name() != name


AVX512_FLAGS = "flags : fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16"
AVX2_FLAGS = "flags : fpu sse2 avx avx2 fma f16c"


@pytest.mark.parametrize("flags, wanted, expected", [
    (AVX512_FLAGS, None, "native"), (AVX512_FLAGS, "avx2", "avx2"), (AVX2_FLAGS, None, "avx2"),
    (AVX2_FLAGS, "native", "native"), ("flags : fpu sse2", None, "native")])
def test_the_instruction_set_is_chosen_from_the_cpu_or_forced(monkeypatch, flags, wanted, expected):
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    if wanted is None:
        monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_kernels.ISA_ENV, wanted)
    assert cpu_kernels.isa() == expected
    assert ("-march=x86-64-v3" if expected == "avx2" else "-march=native") in cpu_kernels._compile_flags()


def test_a_forced_instruction_set_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : fpu sse2")
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    with pytest.raises(ValueError, match="no AVX2"):
        cpu_kernels.isa()
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match="must be one of auto, native, avx2"):
        cpu_kernels.isa()
