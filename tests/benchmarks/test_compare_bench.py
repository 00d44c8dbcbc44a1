"""benchmarks/compare.py: the headline table and the record of the run (the comparison itself
starts pdserve twice and runs for minutes: `python benchmarks/compare.py --smoke`)."""
from benchmarks.compare import headline_table


def _summary(completed: int, errors: int, incomplete: int) -> dict:
    latency = {"median": 10.0, "p99": 20.0}
    return {"completed": completed, "errors": errors, "incomplete": incomplete, "output_token_throughput": 1.0,
            "goodput": 0.5, "ttft_ms": latency, "tpot_ms": latency, "itl_ms": latency,
            "prefix_cache_hit_rate": None}


def test_headline_counts_unfinished_and_unsent_requests_as_not_ok():
    system = {"chat": {"1": {"summary": _summary(5, 1, 2)}},
              "interference": {"summary": _summary(8, 0, 0), "by_tag": {}}}
    table = headline_table({"systems": {"disaggregated": system}})
    assert "| chat @ 1 req/s | disaggregated | 5/3 |" in table
    assert "| interference (all) | disaggregated | 8/0 |" in table and "| - |" in table  # no hit rate: "-"
