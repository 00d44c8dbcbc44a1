"""benchmarks/common.py: the record of what was run that every result file carries
(run_metadata), in pdserve bench's report, itl_under_prefill.py's JSON and compare.py's."""
import argparse
import datetime
import os
import platform
import subprocess
import sys

import pytest

from benchmarks import common
from benchmarks.common import run_metadata

KEYS = {"git_commit", "git_dirty", "cpu_model", "argv", "utc_time", "python"}


def test_run_metadata_names_the_commit_cpu_command_and_time():
    from engine.cpu_kernels import cpu_model
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    meta = run_metadata(["bench", "--seed", "3"])
    assert set(meta) == KEYS
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=common.REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert meta["git_commit"] == head.stdout.strip() and isinstance(meta["git_dirty"], bool)
    assert meta["cpu_model"] == cpu_model() and meta["cpu_model"] not in ("", "x86_64")
    assert meta["argv"] == ["bench", "--seed", "3"] and run_metadata()["argv"] == sys.argv
    when = datetime.datetime.fromisoformat(meta["utc_time"])
    assert when.utcoffset() == datetime.timedelta(0) and before <= when
    assert meta["python"] == platform.python_version()


def test_run_metadata_without_git(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")
    monkeypatch.setattr(common.subprocess, "run", no_git)
    meta = run_metadata([])
    assert meta["git_commit"] is None and meta["git_dirty"] is None and meta["cpu_model"]


def test_bench_report_records_the_run_and_its_sampling_settings():
    from benchmarks.serve import BenchConfig, RunOutcome, build_report
    from benchmarks.workloads import Conversation, Turn, Workload
    config = BenchConfig(base_url="http://h:1", temperature=0.5, ignore_eos=False, use_logprobs=False,
                         timeout_s=30.0, request_timeout_s=12.0)
    workload = Workload("random", [Conversation(0, [Turn("hi", 2, 1)])], "one request")
    report = build_report(config, workload, RunOutcome([], 1.0, "m", None))
    assert set(report["run"]) == KEYS and report["run"]["argv"] == sys.argv
    assert report["sampling"] == {"temperature": 0.5, "ignore_eos": False, "logprobs": False}
    assert (report["timeout_s"], report["request_timeout_s"]) == (30.0, 12.0)


def test_itl_under_prefill_records_the_cpu_model_and_the_run():
    from benchmarks.itl_under_prefill import results_document
    from engine.cpu_kernels import cpu_model
    document = results_document(argparse.Namespace(decodes=8), [{"itl_n": 3}])
    assert document["cpu"] == cpu_model() == document["run"]["cpu_model"]  # not platform.processor()
    assert set(document["run"]) == KEYS and document["args"] == {"decodes": 8} and document["rows"] == [{"itl_n": 3}]


@pytest.mark.skipif(not hasattr(os, "getloadavg"), reason="no load average here")
def test_compare_machine_info_records_the_run():
    from benchmarks.compare import machine_info
    info = machine_info()
    assert KEYS <= set(info) and {"cpus", "platform", "load_average"} <= set(info)
