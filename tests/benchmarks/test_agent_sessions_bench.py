"""The agent-sessions benchmark (host cache tier) in its CI-sized form: it runs end to end, the
outputs with and without the tier are identical, and the tier saves prompt computation."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_agent_sessions_benchmark_smoke(tmp_path):
    out = tmp_path / "agent.json"
    proc = subprocess.run([sys.executable, "benchmarks/agent_sessions.py", "--smoke", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    device_only, tiered = results["device_only"], results["host_tier"]
    assert results["outputs_identical"] is True
    assert device_only["preemptions"] == tiered["preemptions"] == 0  # so every prompt token is counted once
    assert device_only["prompt_tokens"] == tiered["prompt_tokens"] > 0
    assert device_only["host_cache_hit_tokens"] == 0 and device_only["offloaded_blocks"] == 0
    assert tiered["host_cache_hit_tokens"] > 0 and tiered["reloaded_blocks"] > 0
    assert tiered["prompt_tokens_computed"] == tiered["prompt_tokens"] - tiered["cached_tokens"]
    assert tiered["prompt_tokens_computed"] < device_only["prompt_tokens_computed"]
    assert "speedup" in proc.stdout
