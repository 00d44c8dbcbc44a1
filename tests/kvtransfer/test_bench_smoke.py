"""The benchmark's CI-sized run: every available transport moves real blocks between two
processes, checks them byte for byte, and reports rates next to the ceilings."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtransfer import available_transports

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # starts processes


def test_benchmark_smoke_reports_every_transport(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kvtransfer_bench.py"),
                          "--smoke", "--json", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["sizes_mib"] == [1.0, 4.0] and report["layout"]["num_layers"] == 30
    rows = {(row["transport"], row["size_mib"]): row for row in report["results"]}
    # shm: cross-memory reads, mapped caches; ucx-tcp: ucx without its same-host fast path
    variants = available_transports() + ["shm-cma", "shm-mapped"]
    if "ucx" in variants:
        variants.append("ucx-tcp")
    assert set(rows) == {(name, size) for name in variants for size in (1.0, 4.0)}
    for (transport, _), row in rows.items():
        assert row["verified_byte_exact"] is True
        assert row["ceiling"] == ("memcpy" if transport.startswith("shm") else "socket")
        assert row["gbps_median"] > 0 and row["ceiling_gbps_median"] > 0
        assert row["bytes"] == row["blocks"] * 30 * 2 * 16 * 3 * 64 * 4
    assert "| transport |" in run.stdout and "% of ceiling" in run.stdout


def test_benchmark_rows_per_kv_dtype_move_the_same_tokens_in_fewer_bytes(tmp_path):
    """`--kv-dtypes`: a row per dtype at each size, the same tokens, bytes as the cache holds them
    (8-bit: values plus the block scales and K references), checked byte for byte."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kvtransfer_bench.py"), "--smoke",
                          "--transports", "tcp", "--kv-dtypes", "float32,bfloat16,int8,fp8_e4m3", "--json", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {(row["kv_dtype"], row["size_mib"]): row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {(dtype, size) for dtype in ("float32", "bfloat16", "int8", "fp8_e4m3") for size in (1.0, 4.0)}
    block_values = 2 * 16 * 3 * 64  # K and V of one block, one layer
    for (dtype, size), row in rows.items():
        assert row["verified_byte_exact"] is True
        assert row["tokens"] == rows[("float32", size)]["tokens"] == 16 * row["blocks"]
        per_value = {"float32": 4 * block_values, "bfloat16": 2 * block_values}.get(dtype, block_values + 3 * (8 + 128))
        assert row["bytes"] == row["blocks"] * 30 * per_value
    assert rows[("int8", 4.0)]["bytes"] < 0.27 * rows[("float32", 4.0)]["bytes"]
    assert "| tcp | int8 |" in run.stdout


def test_benchmark_options_reach_the_transfer_config():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kvtransfer_bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    name, config = kvtransfer_bench.variant("ucx", 3.0, max_message_mib=2)
    assert (name, config.max_message_bytes, config.timeout_s) == ("ucx", 2 << 20, 3.0)
    assert config.ucx_same_host_fast_path
    name, config = kvtransfer_bench.variant("ucx-tcp", 3.0)
    assert name == "ucx" and not config.ucx_same_host_fast_path
    name, config = kvtransfer_bench.variant("shm-cma", 3.0)
    assert name == "shm" and config.shm_cross_memory_attach
    assert config.max_message_bytes == kvtransfer_bench.TransferConfig().max_message_bytes
    assert kvtransfer_bench.ceiling_for("tcp", "cuda") == "cuda-ipc copy"
    assert kvtransfer_bench.ceiling_for("shm", "cpu") == "memcpy"
