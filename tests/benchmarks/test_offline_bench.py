"""The offline benchmark in its CI-sized form: it runs end to end and reports sane numbers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_offline_benchmark_smoke(tmp_path):
    out = tmp_path / "offline.json"
    proc = subprocess.run([sys.executable, "benchmarks/offline.py", "--smoke", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for name in ("fixed", "mixed"):
        row = results["workloads"][name]
        assert row["output_tokens"] > 0 and row["engine_output_tps"] > 0 and row["transformers_output_tps"] > 0
        assert row["speedup"] == pytest.approx(row["transformers_seconds"] / row["engine_seconds"])
    assert 0 < results["decode_batch1"]["fraction_of_bound"] and results["decode_batch1"]["copy_bandwidth_gbs"] > 0
    assert 0 < results["prefill"]["fraction_of_peak"]
    assert "speedup" in proc.stdout
