"""benchmarks/itl_under_prefill.py: its ITL percentiles and table (the run itself loads the
default model twice: `python benchmarks/itl_under_prefill.py`)."""
import pytest

from benchmarks.common import percentile
from benchmarks.itl_under_prefill import format_table, itl_summary


def test_itl_p99_is_interpolated_like_the_serving_benchmark():
    """50 intervals of 1..50 ms: p99 is 49.51 ms (between ranks, numpy's default and serve.py's),
    not the floor rank's 49 ms that the script reported before; n is reported with it."""
    itl_s = [(51 - i) / 1000 for i in range(1, 51)]  # any order in
    summary = itl_summary(itl_s)
    assert summary["itl_p99_ms"] == pytest.approx(49.51) and summary["itl_p99_ms"] != pytest.approx(49.0)
    assert summary["itl_p50_ms"] == pytest.approx(25.5) and summary["itl_max_ms"] == pytest.approx(50.0)
    assert summary["itl_n"] == 50
    assert summary["itl_p99_ms"] == percentile(sorted(1000 * t for t in itl_s), 99)
    assert itl_summary([0.2]) == {"itl_p50_ms": 200.0, "itl_p99_ms": 200.0, "itl_max_ms": 200.0, "itl_n": 1}


def test_the_table_shows_n_next_to_the_percentiles():
    row = {"max_step_ms": 80.0, **itl_summary([0.1, 0.3]), "decode_only_step_ms": 50.0,
           "long_prompt_ttft_s": None, "steps_with_prefill": 2}
    header, line = format_table([row]).splitlines()
    assert header.split() == ["max_step_ms", "ITL", "p50", "ITL", "p99", "ITL", "max", "n", "decode-only", "TTFT",
                              "long"]
    assert line.split() == ["80.0", "200.0ms", "298.0ms", "300.0ms", "2", "50.0ms", "-"]
