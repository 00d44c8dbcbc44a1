"""The offline benchmark in its CI-sized form: it runs end to end and reports sane numbers."""
import pytest

from tests.benchmarks.smoke import run_smoke

pytestmark = pytest.mark.slow


def test_offline_benchmark_smoke(tmp_path):
    results, stdout = run_smoke("offline.py", tmp_path)
    for name in ("fixed", "mixed"):
        row = results["workloads"][name]
        assert row["output_tokens"] > 0 and row["engine_output_tps"] > 0 and row["transformers_output_tps"] > 0
        assert row["speedup"] == pytest.approx(row["transformers_seconds"] / row["engine_seconds"])
        assert 0 < row["fraction_of_matmul_peak"] < 2
    assert 0 < results["decode_batch1"]["fraction_of_bound"] and results["decode_batch1"]["copy_bandwidth_gbs"] > 0
    assert 0 < results["prefill"]["fraction_of_peak"]
    assert "speedup" in stdout
