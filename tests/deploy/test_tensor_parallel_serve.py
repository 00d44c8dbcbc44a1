"""A tensor-parallel worker in the Ray cluster: `pdserve serve --prefill 0 --decode 0 --colocated 1
--tensor-parallel-size 3` on the default model (SmolLM2-135M: 9 query heads, 3 KV heads, so 3
ranks, never 2), CPU, one thread per rank (`--omp-num-threads 1`). One cluster for the module:

- the worker is one Ray actor (rank 0) with two follower processes (`python -m engine.tp_worker`)
  as its children, on its node: the actor holds the thread share of its 3 ranks
  (OMP_NUM_THREADS=3), each follower 1; `pdserve status` shows the worker's TP degree;
- greedy chat completions through the `openai` client, plain and streamed, are token-identical to
  the offline engine at TP 1 (`engine.LLM`);
- SIGINT stops everything: no process of the cluster is left, the followers included.
"""
from pathlib import Path

import pytest

from tests.deploy.harness import (assert_chats_match_offline, cluster_fixtures, descendants, ready_workers, running,
                                  stop_and_check_nothing_is_left)

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
TP = 3
MAX_TOKENS = 12
CHATS = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]]

serve, offline, client = cluster_fixtures(NUM_BLOCKS, "--prefill", "0", "--decode", "0", "--colocated", "1",
                                          "--tensor-parallel-size", str(TP))


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").partition("=")[::2] for entry in entries if b"=" in entry)


def followers_of(pid: int) -> list[int]:
    """The tensor-parallel followers below a worker process."""
    found = []
    for child in descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine.tp_worker" in cmdline:
            found.append(child)
    return sorted(found)


@pytest.fixture(scope="module")
def worker(serve):
    [worker] = ready_workers(serve.status(), "both")
    return worker


def test_the_worker_runs_its_ranks_as_child_processes_with_a_thread_each(serve, worker):
    assert f"1 colocated worker(s) (tensor parallel {TP}) on cpu" in "".join(serve.log)
    assert worker["tensor_parallel_size"] == TP
    followers = followers_of(worker["pid"])
    assert len(followers) == TP - 1
    assert environ(worker["pid"])["OMP_NUM_THREADS"] == str(TP)  # the worker's share: 1 per rank
    assert [environ(pid)["OMP_NUM_THREADS"] for pid in followers] == ["1"] * (TP - 1)
    [row] = [line.split() for line in serve.cli("status").stdout.splitlines() if line.startswith(worker["worker_id"])]
    assert row[1:3] == ["colocated", str(TP)]  # ROLE, TP


def test_chat_completions_match_the_offline_engine_at_tp_1(client, offline):
    assert_chats_match_offline(client, offline, CHATS, MAX_TOKENS)


def test_sigint_leaves_no_process_and_no_follower(serve, worker):
    followers = followers_of(worker["pid"])
    assert len(followers) == TP - 1
    stop_and_check_nothing_is_left(serve)  # waits until every process below serve exited
    assert not any(running(pid) for pid in followers)
