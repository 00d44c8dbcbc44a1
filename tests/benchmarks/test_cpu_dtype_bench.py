"""The per-dtype CPU benchmark in its CI-sized form: both dtypes run through the default model and
report every figure."""
import math

import pytest

from tests.benchmarks.smoke import run_smoke

pytestmark = pytest.mark.slow


def test_cpu_dtype_benchmark_smoke(tmp_path):
    results, stdout = run_smoke("cpu_dtype.py", tmp_path)
    assert set(results["dtypes"]) == {"float32", "bfloat16"}
    for figures in results["dtypes"].values():
        assert set(figures) == {"weight_bytes", "prefill_64_ms", "decode_step_batch1_ms", "decode_step_batch16_ms"}
        assert all(isinstance(value, float) and math.isfinite(value) for value in figures.values())  # no timing bounds
    assert results["threads"] == 2
    assert "CPU features" in stdout
