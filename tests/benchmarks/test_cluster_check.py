"""benchmarks/cluster_check.py (the `cluster` step of benchmarks/gpu_check.sh): its verdict logic,
and (slow) the whole script on CPU at its smoke size, the same path the GPU step runs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cluster_check import (Plan, build_systems, check_prompts, compare_outputs, markdown,
                                      parse_metrics, token_ids_of, verdicts)

ROOT = Path(__file__).resolve().parents[2]


def output(ids, logprobs=None):
    tokens = [f"t{i}" for i in ids]
    return {"tokens": tokens, "token_ids": token_ids_of(tokens), "text": " ".join(tokens),
            "logprobs": logprobs or [-1.0] * len(ids), "finish_reason": "length"}


def test_token_strings_of_the_random_tokenizer_are_its_ids():
    assert token_ids_of(["t3", "t49151", "<unk>", "<s>", "</s>"]) == [3, 49151, 0, 1, 2]
    assert token_ids_of(["t3", "Ġthe"]) is None  # another tokenizer: compared as strings


def test_identical_ids_pass_and_a_differing_token_is_located():
    reference = [output([5, 6, 7]), output([8, 9, 10])]
    same = compare_outputs(reference, [output([5, 6, 7], [-1.5] * 3), output([8, 9, 10])], 3)
    assert same["mismatches"] == [] and same["identical_prompts"] == 2 and same["compared"] == "token ids"
    assert same["max_abs_logprob_difference"] == pytest.approx(0.5)
    differ = compare_outputs(reference, [output([5, 6, 7]), output([8, 11, 10])], 3)
    assert differ["identical_prompts"] == 1
    assert differ["mismatches"] == [{"prompt": 1, "first_difference_at": 1, "colocated": [9, 10],
                                     "disaggregated": [11, 10]}]
    short = compare_outputs(reference[:1], [output([5, 6])], 3)  # fewer tokens than asked: not identical
    assert short["mismatches"][0]["first_difference_at"] == 2


def test_the_router_counters_are_read_from_prometheus_text():
    text = "\n".join([
        "# HELP pdserve:kv_transfer_seconds KV transfer time.",
        'pdserve:kv_transfer_seconds_bucket{le="0.01"} 2.0',
        "pdserve:kv_transfer_seconds_count 3.0",
        "pdserve:kv_transfer_seconds_sum 0.02",
        "pdserve:kv_transfer_bytes_total 114688.0",
        'pdserve:kv_transfer_failures_total{worker="127.0.0.1:5001",role="decode",reason="timeout"} 1.0',
        'pdserve:kv_transfer_failures_total{worker="127.0.0.1:5001",role="decode",reason="checksum"} 0.0',
        'pdserve:routing_decisions_total{role="prefill",reason="local_queue"} 2.0',
        'pdserve:routing_decisions_total{role="prefill",reason="load"} 1.0',
    ])
    assert parse_metrics(text) == {"kv_transfers": 3.0, "kv_bytes": 114688.0, "kv_failures": 1.0,
                                   "local_prefills": 2.0}


def test_systems_colocated_first_then_one_disaggregated_per_transport():
    plan = Plan()
    systems = build_systems("cuda", ["ucx", "tcp"], Path("/m"), plan, None, 0.5)
    assert [s.name for s in systems] == ["colocated", "disaggregated-ucx", "disaggregated-tcp"]
    assert systems[0].args[:6] == ["--colocated", "1", "--prefill", "0", "--decode", "0"]
    ucx = " ".join(systems[1].args)
    for part in ("--prefill 1 --decode 1", "--transport ucx", "--local-prefill-threshold 0", "--worker-gpus 0.5",
                 "--device cuda", f"--kv-cache-blocks {plan.kv_cache_blocks}"):
        assert part in ucx
    cpu = build_systems("cpu", ["tcp"], Path("/m"), plan, 1, 0.5)
    assert "--worker-gpus" not in cpu[1].args and "--omp-num-threads 1" in " ".join(cpu[1].args)


def test_prompts_are_fixed_and_verdicts_cover_every_transport():
    plan = Plan.smoke()
    assert check_prompts(plan) == check_prompts(Plan.smoke())
    assert [len(p) for p in check_prompts(plan)] == plan.check_prompt_lens
    assert all(3 <= t < plan.vocab_size for p in check_prompts(plan) for t in p)
    results = [{"system": "colocated", "transport": None, "check": {}},
               {"system": "disaggregated-tcp", "transport": "tcp", "check": {"verdict": {"verdict": "PASS"}}},
               {"system": "disaggregated-shm", "transport": "shm", "error": "RuntimeError: not ready"}]
    assert verdicts(results, {"ucx": "ucxx is not installed"}) == {"ucx": "SKIP", "tcp": "PASS", "shm": "FAIL"}


@pytest.mark.slow  # two `pdserve serve` runs, one after the other: ~45 s on 2 cores
@pytest.mark.timeout(900)
def test_cluster_check_smoke_on_cpu(tmp_path):
    # one transport: the script runs each the same way (the GPU step runs them all); every
    # transport between real workers is tested in tests/workers/test_disaggregated.py
    transports = ["tcp"]
    out_json, out_md = tmp_path / "cluster.json", tmp_path / "cluster.md"
    proc = subprocess.run([sys.executable, "benchmarks/cluster_check.py", "--device", "cpu", "--smoke",
                           "--omp-num-threads", "1", "--transports", ",".join(transports), "--start-timeout", "600",
                           "--json", str(out_json), "--markdown", str(out_md)],
                          cwd=ROOT, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    run = json.loads(out_json.read_text())
    assert run["verdicts"] == {t: "PASS" for t in transports}
    for transport in transports:
        assert f"cluster check PASS: {transport}:" in proc.stdout
    plan = Plan.smoke()
    systems = {r["system"]: r for r in run["systems"]}
    assert list(systems) == ["colocated"] + [f"disaggregated-{t}" for t in transports]
    reference = systems["colocated"]["check"]["outputs"]
    assert [len(o["token_ids"]) for o in reference] == [plan.check_max_tokens] * len(plan.check_prompt_lens)
    assert len({t for o in reference for t in o["token_ids"]}) > plan.check_max_tokens  # not one repeated token
    for name, result in systems.items():
        assert "error" not in result
        summary = result["bench"]["summary"]
        assert summary["completed"] == plan.num_requests and summary["errors"] == 0
        assert summary["output_tokens"] == plan.num_requests * plan.output_len
        assert summary["input_tokens"] >= plan.num_requests * plan.input_len
        assert summary["cached_tokens"] < summary["input_tokens"] / 2  # distinct prompts, not one cached prefix
        if result["transport"] is not None:
            verdict = result["check"]["verdict"]
            assert verdict["identical_prompts"] == len(plan.check_prompt_lens) and verdict["compared"] == "token ids"
            assert [o["token_ids"] for o in result["check"]["outputs"]] == [o["token_ids"] for o in reference]
            moved = result["check"]["router_metrics"]
            assert moved["kv_transfers"] == len(plan.check_prompt_lens) and moved["kv_bytes"] > 0
            assert moved["kv_failures"] == 0 and moved["local_prefills"] == 0
    table = out_md.read_text()
    assert table == markdown(run)
    for transport in transports:
        assert (f"| disaggregated-{transport} | PASS ({len(plan.check_prompt_lens)}/{len(plan.check_prompt_lens)}) "
                f"| {plan.num_requests}/0/0 |") in table


def test_the_table_shows_a_failed_start_and_a_skipped_transport():
    run = {"device": "cuda", "device_name": "H200", "model_shape": "SmolLM2-135M", "plan": vars(Plan()),
           "systems": [{"system": "colocated", "transport": None, "error": "RuntimeError: not ready within 300 s"}],
           "skipped": {"ucx": "ucxx cannot be imported"}}
    table = markdown(run)
    assert "| colocated | FAIL | error: RuntimeError: not ready within 300 s |" in table
    assert "| disaggregated-ucx | SKIP: ucxx cannot be imported |" in table
    assert "256 requests, 1024 in / 128 out, concurrency 64" in table
