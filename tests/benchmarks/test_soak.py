"""The soak benchmark's pure parts (benchmarks/soak.py): the fault schedule, the mixed workload,
the RSS slope fit, and the request accounting (what is lost, what failed and why). No process
is started here: the soak itself is run by hand (benchmarks/README.md, "Soak")."""
import random

import pytest

from benchmarks.soak import (FAULT_KINDS, account, classify, fault_schedule, linear_slope,
                             migrations_in_log, mixed_requests, process_role, rss_slope_mb_per_hour)
from deploy.bench import arrival_offsets


def test_the_fault_schedule_is_seeded_spaced_and_cycles_through_every_kind():
    schedule = fault_schedule(1800, 240, seed=0)
    assert schedule == fault_schedule(1800, 240, seed=0)
    assert schedule != fault_schedule(1800, 240, seed=1)
    assert len(schedule) == 7
    times = [f["at_s"] for f in schedule]
    assert times == sorted(times)
    for slot, at in enumerate(times, start=1):
        assert abs(at - 240 * slot) <= 0.2 * 240 + 1e-9
    assert times[-1] <= 1800 - 90  # the recovery from the last one is seen
    kinds = [f["kind"] for f in schedule]
    assert sorted(kinds[:5]) == sorted(FAULT_KINDS)  # every kind once before any repeats


def test_a_short_run_has_no_fault_and_none_means_none():
    assert fault_schedule(60, 240, seed=0) == []
    assert fault_schedule(1800, 0, seed=0) == []


def test_the_mixed_workload_is_seeded_and_mixes_every_kind():
    requests = mixed_requests(40, seed=3)
    assert [r["messages"] for r in requests[:10]] == [r["messages"] for r in mixed_requests(10, seed=3)]
    kinds = {r["kind"] for r in requests}
    assert kinds == {"chat", "short", "long", "code_edit", "json_echo"}
    assert all(r["max_tokens"] >= 1 and r["messages"][-1]["role"] == "user" for r in requests)
    assert all(r["max_tokens"] == 8 for r in requests if r["kind"] == "long")
    arrivals = arrival_offsets(50, 0.5, random.Random(0))
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals == arrival_offsets(50, 0.5, random.Random(0))


def test_linear_slope():
    assert linear_slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert linear_slope([5], [1]) is None
    assert linear_slope([2, 2], [1, 3]) is None


def test_rss_slope_fits_the_second_half_of_the_life_while_the_load_ran():
    # flat at 100 MB for the first half (warm-up growth there is ignored), then +1 MB per 10 s
    samples = [(t, 50_000_000 + t * 1_000_000 // 10) for t in range(0, 600, 10)]  # growing during warm-up
    samples += [(t, 200_000_000 + (t - 600) * 100_000) for t in range(600, 1200, 10)]  # 0.1 MB/s
    samples += [(t, 1_000_000_000) for t in range(1200, 1400, 10)]  # after the load: ignored
    fit = rss_slope_mb_per_hour(samples, end_s=1190)
    assert fit["fit_from_s"] >= 595
    assert fit["mb_per_hour"] == pytest.approx(360.0, rel=0.01)  # 0.1 MB/s
    assert fit["rss_mb_end"] == pytest.approx(259.0)
    assert rss_slope_mb_per_hour([(0, 1), (10, 2)]) is None  # too few points
    assert rss_slope_mb_per_hour([(t, 5_000_000) for t in range(0, 100, 10)])["mb_per_hour"] == 0


def _record(index, **fields):
    return {"index": index, "kind": "chat", "max_tokens": 16, "sent": True, **fields}


def test_classify_tells_completed_failed_and_lost_apart():
    assert classify({"sent": False}) == ("not_sent", "")
    assert classify(_record(0, status=200, done=True, finish_reason="length")) == ("completed", "")
    assert classify(_record(0, status=503, error_body="no decode worker")) == ("failed", "HTTP 503: no decode worker")
    assert classify(_record(0, exception="ConnectError: refused"))[0] == "failed"  # never accepted
    outcome, reason = classify(_record(0, status=200, error_event="the decode worker failed", done=True))
    assert outcome == "failed" and "error event" in reason  # accepted, but the client was told
    assert classify(_record(0, status=200, exception="RemoteProtocolError: cut"))[0] == "lost"
    assert classify(_record(0, status=200, open_at_end=True))[0] == "lost"
    assert classify(_record(0, status=200))[0] == "lost"  # ended without [DONE]
    assert classify(_record(0, status=200, done=True))[0] == "lost"  # [DONE] without a finish reason


def test_account_counts_groups_reasons_and_names_the_lost_and_migrated():
    records = [
        _record(0, status=200, done=True, finish_reason="length", completion_tokens=16, response_id="chatcmpl-a"),
        _record(1, status=200, done=True, finish_reason="length", completion_tokens=16, response_id="chatcmpl-b"),
        _record(2, status=200, done=True, finish_reason="length", completion_tokens=9, response_id="chatcmpl-c"),
        _record(3, status=503, error_body="no decode worker could take the request (last error: 127.0.0.1:4001: x)"),
        _record(4, status=503, error_body="no decode worker could take the request (last error: 127.0.0.1:4002: x)"),
        _record(5, status=200, response_id="chatcmpl-d", tokens_streamed=3, exception="ReadError: reset"),
        _record(6, status=200, error_event="the decode worker failed the request", done=True),
        {"index": 7, "kind": "long", "max_tokens": 8, "sent": False},
    ]
    table = account(records, migrated_ids={"chatcmpl-b", "chatcmpl-d"})
    assert (table["sent"], table["completed"], table["failed"], table["lost"], table["not_sent"]) == (7, 3, 3, 1, 1)
    assert table["accepted"] == 5 and table["accepted_then_failed"] == 1
    assert table["migrated"] == 2 and table["migrated_completed"] == 1
    # the two 503s differ only by an address: one reason
    assert list(table["failed_by_reason"].values()) == [2, 1]
    assert table["lost_requests"] == [{"index": 5, "response_id": "chatcmpl-d", "kind": "chat", "sent_at_s": None,
                                       "tokens": 3, "reason": "HTTP 200, then the stream broke: ReadError: reset"}]
    assert [s["index"] for s in table["short_completions"]] == [2]


def test_migrations_are_read_from_the_router_log():
    lines = ["(router) WARNING router.dispatch: request chatcmpl-abc: decode worker 127.0.0.1:5000 failed after 12 "
             "tokens (UNAVAILABLE: Socket closed); resuming on another worker",
             "INFO something else"]
    assert migrations_in_log(lines) == {"chatcmpl-abc": [{"worker": "127.0.0.1:5000", "after_tokens": 12,
                                                          "reason": "UNAVAILABLE: Socket closed"}]}


def test_process_roles():
    workers = {42: {"role": "decode", "worker_id": "decode-2"}}
    assert process_role(1, 1, "python -m deploy.cli serve", workers) == "serve"
    assert process_role(42, 1, "ray::WorkerActor.run_until_stopped", workers) == "decode"
    assert process_role(43, 1, "ray::WorkerActor.start", workers) == "worker"
    assert process_role(44, 1, "ray::ControllerActor", workers) == "controller"
    assert process_role(45, 1, "/usr/bin/python -m deploy.router_process 3 4", workers) == "router"
    assert process_role(46, 1, "/x/ray/core/src/ray/gcs/gcs_server --x", workers) == "ray:gcs_server"
    assert process_role(47, 1, "ray::IDLE", workers) is None
