"""The speculative-decoding benchmark in its CI-sized form: it runs end to end, the outputs of
both engines are identical, and a copying workload gains tokens per step."""
import pytest

from tests.benchmarks.smoke import run_smoke

pytestmark = pytest.mark.slow


def test_speculative_benchmark_smoke(tmp_path):
    results, stdout = run_smoke("speculative.py", tmp_path)
    assert set(results["results"]) == {f"{w}@2" for w in ("code_edit", "json_echo", "chat")} | {
        f"{w}@1" for w in ("code_edit", "json_echo", "chat")}
    for row in results["results"].values():
        assert row["identical_outputs"]
        plain, spec = row["plain"], row["speculative"]
        assert plain["output_tokens"] == spec["output_tokens"] > 0
        assert plain["tokens_per_step"] == 1.0 and plain["draft_tokens"] == 0
        assert row["tpot_speedup"] == pytest.approx(plain["tpot_ms_mean"] / spec["tpot_ms_mean"])
    assert results["results"]["json_echo@1"]["speculative"]["tokens_per_step"] > 1.5  # the answer copies the prompt
    assert "identical" in stdout
