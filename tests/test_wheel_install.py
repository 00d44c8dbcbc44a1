"""pdserve installed from a wheel works outside the checkout (issue 51, item 6 "Installable"): the
wire schema is package data of `wire`, `pdserve bench` runs from the package, and the cache root
is one definition (engine/paths.py) that kvtransfer's chunk copier agrees with."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_one_cache_root(monkeypatch, tmp_path):
    """engine/paths.py defines the root; kvtransfer (which may not import engine) reads the same
    variable with the same default, so its compiled copier lands in the same native/ folder."""
    from deploy.cluster import STATE_FILE_ENV, default_state_file
    from engine import cpu_kernels, paths
    from engine.model import gguf_loader
    from kvtransfer import _chunk_copy

    monkeypatch.delenv(paths.CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv(STATE_FILE_ENV, raising=False)
    home = Path.home() / ".cache" / "pdserve"
    assert paths.cache_root() == home
    assert gguf_loader.cache_root() == str(home / "models")  # the models' default, unchanged
    assert _chunk_copy._cache_dir() == paths.native_dir() == home / "native"
    assert default_state_file() == home / "serve.json"
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path / "root"))
    assert paths.cache_root() == tmp_path / "root"
    assert gguf_loader.cache_root() == str(tmp_path / "root" / "models")
    assert gguf_loader.cache_root(str(tmp_path / "mine")) == str(tmp_path / "mine")  # cache_dir= wins
    assert _chunk_copy._cache_dir() == paths.native_dir() == tmp_path / "root" / "native"
    assert default_state_file() == tmp_path / "root" / "serve.json"
    monkeypatch.setenv(STATE_FILE_ENV, str(tmp_path / "elsewhere.json"))
    assert default_state_file() == tmp_path / "elsewhere.json"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpu_kernels, "built_library", lambda build_dir: seen.append(build_dir))
    monkeypatch.setattr(cpu_kernels, "_build", lambda name, build_dir: "built")
    monkeypatch.delenv("PDSERVE_CPU_KERNELS", raising=False)
    seen: list[Path] = []
    assert cpu_kernels.load.__wrapped__() == "built"  # not the cached load(): the real kernels stay loaded
    assert seen == [tmp_path / "root" / "native" / cpu_kernels.build_name()]


def _packages() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [pattern.rstrip("*") for pattern in config["tool"]["setuptools"]["packages"]["find"]["include"]]


VENV_SCRIPT = r"""
import json, sys
from engine import LLM, SamplingParams, cpu_kernels, paths
from wire import schema
import deploy.bench, kvtransfer

wired = schema.sampling_to_wire(SamplingParams(max_tokens=5))  # compiles the packaged .proto
with LLM("default", num_blocks=64, block_size=16) as llm:
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0),
                       use_tqdm=False)[0]
print(json.dumps({
    "files": {name: sys.modules[name].__file__ for name in ("engine", "wire", "deploy", "kvtransfer", "deploy.bench")},
    "proto_dir": str(schema.proto_dir()), "wired_max_tokens": wired.max_tokens,
    "token_ids": out.token_ids, "text": out.text, "build_name": cpu_kernels.build_name()}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_wheel_installed_outside_the_checkout_serves_a_completion(tmp_path_factory):
    from engine import cpu_kernels
    from engine.paths import native_dir

    base = tmp_path_factory.mktemp("wheel-install").resolve()
    assert not base.is_relative_to(REPO), base
    # Build from a copy of what the wheel is made of, so the build writes nothing into the checkout.
    source = base / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for package in _packages():
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PYTHONNOUSERSITE="1")

    def run(*command, **kwargs) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(c) for c in command], cwd=base, env=env, capture_output=True, text=True,
                              timeout=300, **kwargs)
        assert proc.returncode == 0, f"{command}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    dist = base / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source)
    (wheel,) = dist.glob("pdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"wire/proto/pdserve.proto", "kvtransfer/csrc/chunk_copy.c", "engine/csrc/bindings.cpp",
            "engine/paths.py", "deploy/bench.py", "deploy/bench_workloads.py"} <= names
    assert not any(name.startswith(("tests/", "benchmarks/", "proto/")) for name in names)

    # torch and the other dependencies come from this interpreter's site-packages, where an
    # editable install of the checkout also is: the venv's own copy must be the one imported.
    venv = base / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv)
    python, pdserve = venv / "bin" / "python", venv / "bin" / "pdserve"
    run(python, "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", wheel)
    assert pdserve.is_file()

    if cpu_kernels.built_library(native_dir() / cpu_kernels.build_name()) is None:
        env["PDSERVE_CPU_KERNELS"] = "0"  # not built on this machine yet: skip a minute's compile
    proc = run(python, "-c", VENV_SCRIPT)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    site = venv.resolve()
    for name, file in result["files"].items():
        assert Path(file).resolve().is_relative_to(site), f"{name} imported from {file}, not the venv"
    assert Path(result["proto_dir"]).resolve().is_relative_to(site)
    assert result["wired_max_tokens"] == 5
    assert len(result["token_ids"]) == 4 and result["text"].strip(), result
    assert result["build_name"] == cpu_kernels.build_name()  # the same kernel sources shipped, the same build

    help_text = run(pdserve, "bench", "--help").stdout
    assert help_text.startswith("usage: pdserve bench") and "--workload" in help_text
