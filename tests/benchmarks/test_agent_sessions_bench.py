"""The agent-sessions benchmark (host cache tier) in its CI-sized form: it runs end to end, the
outputs with and without the tier are identical, and the tier saves prompt computation."""
import pytest

from tests.benchmarks.smoke import run_smoke

pytestmark = pytest.mark.slow


def test_agent_sessions_benchmark_smoke(tmp_path):
    results, stdout = run_smoke("agent_sessions.py", tmp_path)
    device_only, tiered = results["device_only"], results["host_tier"]
    assert results["outputs_identical"] is True
    assert device_only["preemptions"] == tiered["preemptions"] == 0  # so every prompt token is counted once
    assert device_only["prompt_tokens"] == tiered["prompt_tokens"] > 0
    assert device_only["host_cache_hit_tokens"] == 0 and device_only["offloaded_blocks"] == 0
    assert tiered["host_cache_hit_tokens"] > 0 and tiered["reloaded_blocks"] > 0
    assert tiered["prompt_tokens_computed"] == tiered["prompt_tokens"] - tiered["cached_tokens"]
    assert tiered["prompt_tokens_computed"] < device_only["prompt_tokens_computed"]
    assert "speedup" in stdout
