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
