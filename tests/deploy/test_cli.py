"""The `pdserve` command line without a cluster: options, validation messages, worker placement,
the status table, the state file."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli import build_parser, format_status, main, serve_options
from deploy.cluster import (RaySettings, ServeState, check_state_file_free, process_started, read_state, remove_state,
                            write_state)
from kvtransfer import available_transports

REPO = Path(__file__).resolve().parents[2]


def options(*argv):
    return serve_options(build_parser().parse_args(["serve", *argv]))


def test_serve_defaults_are_the_embedded_default():
    opts = options()
    assert (opts.model, opts.prefill, opts.decode, opts.colocated) == ("default", 1, 1, 0)
    assert (opts.host, opts.port, opts.device, opts.kv.transport) == ("127.0.0.1", 8000, "auto", "auto")
    assert opts.ray.address is None and opts.ray.include_dashboard is False
    assert opts.ray.object_store_memory_mb == 150 and opts.engine_options == {}
    assert opts.max_migrations == 2 and options("--max-migrations", "0").max_migrations == 0
    assert opts.routers == 1 and options("--routers", "3").routers == 3
    assert opts.router_config(port=8000).local_prefill_weight == 1.0
    assert options("--local-prefill-weight", "inf").router_config(port=8000).local_prefill_weight == float("inf")
    assert opts.router_config(port=8000).max_inflight_requests == 1024
    assert options("--max-inflight-requests", "8").router_config(port=8000).max_inflight_requests == 8
    assert options("--batch-share", "0.5").router_config(port=8000).batch_share == 0.5
    shared = options("--engagement-window-s", "30", "--engagement-min-requests", "4",
                     "--engagement-min-prompt-tokens", "64", "--max-stored-responses", "5").router_config(port=8000)
    assert (shared.engagement_window_s, shared.engagement_min_requests, shared.engagement_min_prompt_tokens,
            shared.max_stored_responses) == (30.0, 4, 64, 5)
    with pytest.raises(ValueError, match=r"--batch-share must be in \(0, 1\], got 0.0"):
        options("--batch-share", "0").router_config(port=8000)


def test_every_packaged_model_name_is_a_serve_model(monkeypatch):
    """`--model gemma-3-270m` (any name in the registry) is accepted like `default`; a packaged model
    whose package is missing fails before Ray starts, with the registry's message (the pip command)."""
    import importlib.util

    from engine.model.packaged_models import GEMMA3_270M_INSTALL, GEMMA3_270M_PACKAGE, PACKAGED_MODELS
    real_find_spec = importlib.util.find_spec
    for name, model in PACKAGED_MODELS.items():
        if real_find_spec(model.package) is not None:
            assert options("--model", name).router_config(port=8000).model == name
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda package, *a: None if package == GEMMA3_270M_PACKAGE else real_find_spec(package, *a))
    with pytest.raises(ValueError, match="which is not installed") as failure:
        options("--model", "gemma-3-270m")
    assert GEMMA3_270M_INSTALL in str(failure.value)


def test_serve_flags_default_to_serve_options():
    from deploy.serve import ServeOptions
    opts, defaults = options(), ServeOptions()
    for name in ("model", "prefill", "decode", "colocated", "host", "port", "device", "kv", "routers"):
        assert getattr(opts, name) == getattr(defaults, name), name
    assert opts.ray.object_store_memory_mb == RaySettings().object_store_memory_mb


def test_planner_flags_reach_the_controller():
    from deploy.planner import PlannerConfig
    worker = options().worker_spec({"CPU": 2.0}, started_ray=True)
    assert options().controller_config(worker).planner is None
    planned = options("--planner", "--slo-ttft-ms", "900", "--slo-tpot-ms", "50", "--max-workers", "5",
                      "--planner-interval", "2", "--planner-cooldown", "5").controller_config(worker).planner
    assert planned == PlannerConfig(slo_ttft_ms=900, slo_tpot_ms=50, max_workers=5, interval_s=2, cooldown_s=5)
    assert options("--planner-dry-run").controller_config(worker).planner.dry_run
    with pytest.raises(ValueError, match="max_workers must be >= 2"):
        options("--planner", "--max-workers", "1")


def test_engine_flags_reach_every_worker():
    opts = options("--block-size", "32", "--max-num-batched-tokens", "512", "--max-num-seqs", "8",
                   "--kv-cache-blocks", "300", "--max-model-len", "1024", "--no-prefix-caching", "--no-cuda-graphs",
                   "--preemption-mode", "swap", "--swap-space-gb", "2", "--host-cache-gb", "8",
                   "--speculative", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "1",
                   "--prompt-lookup-max", "5", "--speculative-disable-by-batch-size", "16",
                   "--quantization", "gguf")
    assert opts.engine_options == {"quantization": "gguf", "block_size": 32, "max_num_batched_tokens": 512, "max_num_seqs": 8,
                                   "num_blocks": 300, "max_model_len": 1024, "enable_prefix_caching": False,
                                   "cuda_graphs": False, "preemption_mode": "swap", "swap_space_gb": 2.0,
                                   "host_cache_gb": 8.0, "speculative_method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 5,
                                   "speculative_disable_by_batch_size": 16}
    spec = opts.worker_spec({"CPU": 2.0}, started_ray=True)
    assert spec.engine_options == opts.engine_options and spec.model == "default"


@pytest.mark.parametrize("argv, message", [
    (["--prefill", "2", "--decode", "0"], "2 prefill worker(s) but no decode worker"),
    (["--prefill", "0", "--decode", "0"], "no worker could answer requests"),
    (["--prefill", "0", "--decode", "1"], "1 decode worker(s) but no prefill worker"),
    (["--decode", "-1"], "the decode pool size must be an integer >= 0, got -1"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-migrations", "-1"], "--max-migrations must be >= 0"),
    (["--local-prefill-weight", "-1"], "--local-prefill-weight must be >= 0"),
    (["--engagement-window-s", "0"], "--engagement-window-s must be > 0"),
    (["--routers", "0"], "--routers must be in 1..64, got 0"),
    (["--controller-name", "a:b"], "the controller name must not contain ':'"),
    (["--planner", "--max-workers", "4", "--prefill", "2", "--decode", "3"],
     "--prefill 2 + --decode 3 is more than --max-workers 4"),
    (["--model", "/no/such/model.gguf"], "no such file or folder"),
    (["--block-size", "24"], "block_size must be a power of two"),
    (["--worker-cpus", "0"], "--worker-cpus must be > 0"),
    (["--worker-gpus", "2"], "--worker-gpus must be in (0, 1]"),
    (["--object-store-mb", "10"], "at least 75 MB"),
    (["--api-key", ""], "--api-key must be non-empty"),  # `--api-key "$KEY"` with KEY unset: not "no key"
    (["--kv-timeout-s", "0"], "--kv-timeout-s must be > 0, got 0.0"),
    (["--export-lease-s", "0"], "--export-lease-s must be > 0, got 0.0"),
    (["--transfer-timeout-s", "-1"], "--transfer-timeout-s must be > 0, got -1.0"),
    (["--local-prefill-threshold", "-1"], "--local-prefill-threshold must be >= 0, got -1"),
])
def test_bad_serve_options_fail_before_anything_starts(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert options().api_key == "from-env" and options("--api-key", "flag").api_key == "flag"
    monkeypatch.setenv("PDSERVE_API_KEY", "")  # an empty variable: no key
    assert options().api_key is None


def test_workers_on_cpu_get_fractional_cpus_and_a_thread_share():
    spec = options("--prefill", "1", "--decode", "1").worker_spec({"CPU": 2.0}, started_ray=True)
    assert spec.device == "cpu" and spec.num_gpus == 0 and spec.num_cpus == 0.5
    assert spec.omp_num_threads == max(1, (os.cpu_count() or 1) // 2)
    assert spec.host == "127.0.0.1" and spec.advertise_node_ip is False
    spec = options("--omp-num-threads", "3", "--worker-cpus", "2").worker_spec({"CPU": 8.0}, started_ray=True)
    assert (spec.omp_num_threads, spec.num_cpus) == (3, 2.0)


def test_auto_device_takes_one_gpu_per_worker_when_the_cluster_has_gpus():
    spec = options().worker_spec({"CPU": 16.0, "GPU": 4.0}, started_ray=False)
    assert (spec.device, spec.num_gpus, spec.num_cpus) == ("cuda", 1.0, 1.0)
    assert spec.host == "0.0.0.0" and spec.advertise_node_ip is True  # joined cluster: reachable from other nodes
    spec = options("--worker-gpus", "0.5").worker_spec({"CPU": 4.0, "GPU": 1.0}, started_ray=True)
    assert (spec.device, spec.num_gpus, spec.host) == ("cuda", 0.5, "127.0.0.1")
    # sharing a GPU: each worker's KV cache from its share of the memory, and not over nccl (which
    # cannot join two ranks on one GPU)
    assert spec.engine_options["gpu_memory_utilization"] == pytest.approx(0.425)
    assert spec.kv.transport == ("ucx" if "ucx" in available_transports() else "tcp")
    spec = options("--worker-gpus", "0.5", "--kv-cache-blocks", "900", "--transport", "nccl").worker_spec(
        {"CPU": 4.0, "GPU": 1.0}, started_ray=True)
    assert "gpu_memory_utilization" not in spec.engine_options and spec.kv.transport == "nccl"  # asked for
    whole = options().worker_spec({"CPU": 4.0, "GPU": 1.0}, started_ray=True)
    assert "gpu_memory_utilization" not in whole.engine_options and whole.kv.transport == "auto"
    with pytest.raises(ValueError, match="--device cuda, but the Ray cluster has no GPU"):
        options("--device", "cuda").worker_spec({"CPU": 2.0}, started_ray=True)


def test_status_table():
    status = {"targets": {"prefill": 1, "decode": 2, "both": 0}, "settled": False, "routers": 1,
              "workers": [
                  {"worker_id": "prefill-1", "role": "prefill", "tensor_parallel_size": 1, "state": "ready",
                   "address": "127.0.0.1:4001", "pid": 11, "node_id": "0123456789abcdef" * 3 + "01234567",
                   "node_ip": "10.0.0.7", "healthy": True,
                   "running": 1, "waiting": 0, "kv_usage": 0.25, "prefix_cache_hit_rate": 0.5,
                   "rss_bytes": 3 * 2**29, "weight_bytes": 2**29},
                  {"worker_id": "decode-3", "role": "decode", "state": "starting", "address": "", "pid": None,
                   "healthy": False, "running": 0, "waiting": 0, "kv_usage": None, "prefix_cache_hit_rate": None}],
              "events": [{"time": 0.0, "message": "decode-3 starting"}]}
    lines = format_status(status).splitlines()
    assert lines[0].split() == ["ID", "ROLE", "TP", "STATE", "ADDRESS", "PID", "NODE", "HEALTH", "RUNNING",
                                "WAITING", "KV", "USE", "PREFIX", "HIT", "RSS", "WEIGHTS"]
    assert lines[1].split() == ["prefill-1", "prefill", "1", "ready", "127.0.0.1:4001", "11", "01234567@10.0.0.7",
                                "ok", "1", "0", "25.0%", "50.0%", "1.50", "GiB", "0.50", "GiB"]
    assert lines[2].split() == ["decode-3", "decode", "-", "starting", "-", "-", "-", "down", "0", "0", "-", "-",
                                "-", "-"]
    assert lines[3] == "targets: 1 prefill, 2 decode, 0 colocated (changing); routers: 1"
    assert lines[4].endswith("decode-3 starting")


def test_pool_resources_pin_each_pool_and_reach_its_workers():
    opts = options("--prefill-resources", '{"node_a": 1}', "--decode-resources", '{"node_b": 0.5, "fast_net": 2}')
    assert opts.pool_resources == {"prefill": {"node_a": 1.0}, "decode": {"node_b": 0.5, "fast_net": 2.0}}
    spec = opts.worker_spec({"CPU": 2.0, "node_a": 1.0, "node_b": 1.0}, started_ray=False)
    assert spec.resources == opts.pool_resources and spec.resources.get("both") is None
    assert options("--colocated", "1", "--prefill", "0", "--decode", "0", "--colocated-resources",
                   '{"big_node": 1}').pool_resources == {"both": {"big_node": 1.0}}
    assert options().pool_resources == {} and options("--prefill-resources", "{}").pool_resources == {}


@pytest.mark.parametrize("flag, value, message", [
    ("--prefill-resources", "node_a", "argument --prefill-resources: not valid JSON"),
    ("--decode-resources", '["node_b"]', 'must be a JSON object of resource name -> quantity'),
    ("--prefill-resources", '{"CPU": 2}', "'CPU' is not a custom resource: use --worker-cpus"),
    ("--colocated-resources", '{"GPU": 1}', "'GPU' is not a custom resource: use --worker-gpus"),
    ("--decode-resources", '{"node_b": 0}', "resource 'node_b' needs a number > 0, got 0"),
    ("--decode-resources", '{"node_b": "one"}', 'resource \'node_b\' needs a number > 0, got "one"'),
    ("--prefill-resources", '{"node_a": 0.00001}', "Ray counts fractions down to 0.0001"),
])
def test_bad_pool_resources_fail_when_the_command_line_is_parsed(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", flag, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_worker_spec_checks_resources_by_role():
    from deploy.config import WorkerSpec
    with pytest.raises(ValueError, match=r"resources are by role \(prefill, decode, both\), got 'router'"):
        WorkerSpec(resources={"router": {"node_a": 1}})
    with pytest.raises(ValueError, match="--colocated-resources: 'memory' is not a custom resource"):
        WorkerSpec(resources={"both": {"memory": 1}})
    assert WorkerSpec(resources={"decode": {"node_b": 1}}).resources == {"decode": {"node_b": 1.0}}


def test_workers_can_listen_on_their_nodes_ip():
    spec = options("--worker-host", "node-ip").worker_spec({"CPU": 2.0}, started_ray=False)
    assert spec.host == "node-ip" and spec.advertise_node_ip is True
    worker = spec.worker_options("decode", "10.0.0.7")  # what its actor starts it with on that node
    assert (worker.host, worker.advertise_host, worker.port) == ("10.0.0.7", "10.0.0.7", 0)
    local = options().worker_spec({"CPU": 2.0}, started_ray=True).worker_options("prefill", "10.0.0.7")
    assert (local.host, local.advertise_host) == ("127.0.0.1", "127.0.0.1")


def test_kv_flags_reach_every_worker():
    """The KV connector's flags (serving.add_worker_arguments, shared with the worker mains) go to
    every worker the controller starts, whatever its role (each side reads its own)."""
    from serving.bringup import KVOptions
    opts = options("--on-transfer-failure", "fail", "--transfer-timeout-s", "90", "--kv-timeout-s", "9",
                   "--export-lease-s", "120", "--no-layerwise-push", "--local-prefill-threshold", "0")
    assert opts.kv == KVOptions(on_transfer_failure="fail", transfer_timeout_s=90.0, kv_timeout_s=9.0, lease_s=120.0,
                                layerwise=False, local_prefill_threshold=0)
    spec = opts.worker_spec({"CPU": 2.0}, started_ray=True)
    for role in ("prefill", "decode", "both"):
        worker = spec.worker_options(role, "10.0.0.7")
        assert worker.kv == opts.kv and worker.engine_options == {"device": "cpu"}
        assert (worker.model, worker.threads, worker.log_level) == ("default", spec.omp_num_threads, "WARNING")
    assert options().kv == KVOptions()


def test_state_file_round_trip_and_staleness(tmp_path):
    path = tmp_path / "serve.json"
    state = ServeState(pid=os.getpid(), ray_address="127.0.0.1:1234", namespace="pdserve",
                       controller="pdserve-controller", url="http://127.0.0.1:8000", started_ray=True)
    write_state(path, state)
    assert read_state(path) == state
    check_state_file_free(path)  # our own: fine
    remove_state(path)
    assert not path.exists()
    with pytest.raises(ValueError, match="no running `pdserve serve` found"):
        read_state(path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(json.dumps({**state.__dict__, "pid": int(dead.stdout)}))
    with pytest.raises(ValueError, match=r"is no longer running"):
        read_state(path)
    check_state_file_free(path)  # a stale file does not block a new serve
    path.write_text(json.dumps({**state.__dict__, "pid": os.getppid()}))
    with pytest.raises(ValueError, match="another `pdserve serve`"):
        check_state_file_free(path)
    remove_state(path)
    assert path.exists()  # not ours: left alone
    # the pid is alive but is another process than the one that wrote the file (a pid reused after
    # serve died): stale
    started = process_started(os.getppid())
    assert started is not None and started <= process_started(os.getpid())
    path.write_text(json.dumps({**state.__dict__, "pid": os.getppid(), "pid_started": started}))
    assert read_state(path).pid == os.getppid()
    path.write_text(json.dumps({**state.__dict__, "pid": os.getppid(), "pid_started": started + 1}))
    with pytest.raises(ValueError, match=r"is no longer running"):
        read_state(path)
    check_state_file_free(path)


def test_scale_and_status_without_a_server_say_so(tmp_path):
    env = {**os.environ, "PDSERVE_STATE_FILE": str(tmp_path / "none.json")}
    for argv in (["status"], ["scale", "--decode", "2"]):
        result = subprocess.run([sys.executable, "-m", "deploy.cli", *argv], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2
        assert "no running `pdserve serve` found" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "scale"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "nothing to scale" in result.stderr


def test_ray_settings_validation():
    with pytest.raises(ValueError, match="too long"):
        RaySettings(temp_dir="/tmp/" + "x" * 60)
    with pytest.raises(ValueError, match="ray address must be non-empty"):
        RaySettings(address="")


def test_the_example_cluster_config_passes_rays_validation():
    yaml = pytest.importorskip("yaml")
    from ray.autoscaler._private.util import prepare_config, validate_config
    config = yaml.safe_load((REPO / "deploy" / "cluster.example.yaml").read_text())
    validate_config(prepare_config(config))
    assert config["provider"]["type"] == "local"
    assert any("ray start --head" in command for command in config["head_start_ray_commands"])


def test_capacity_shortfall_names_what_is_missing():
    from deploy.config import PoolTargets, WorkerSpec, capacity_shortfall
    cpu = WorkerSpec(num_cpus=0.5)
    assert capacity_shortfall(PoolTargets(1, 3), cpu, {"CPU": 2.0}) is None
    assert capacity_shortfall(PoolTargets(2, 3), cpu, {"CPU": 2.0}) == (
        "5 worker(s) need 2.5 CPUs (the cluster has 2); lower the pool sizes, --worker-cpus / --worker-gpus / "
        "--<pool>-resources, or add nodes")
    gpu = WorkerSpec(device="cuda", num_cpus=1, num_gpus=1)
    assert "2 GPUs (the cluster has 1)" in capacity_shortfall(PoolTargets(1, 1), gpu, {"CPU": 16.0, "GPU": 1.0})
    pinned = WorkerSpec(num_cpus=0.5, resources={"prefill": {"node_a": 1}, "decode": {"node_b": 0.5}})
    two_nodes = {"CPU": 2.0, "node_a": 1.0, "node_b": 1.0}
    assert capacity_shortfall(PoolTargets(1, 2), pinned, two_nodes) is None
    assert capacity_shortfall(PoolTargets(2, 2), pinned, two_nodes) == (
        "4 worker(s) need 2 'node_a' (the cluster has 1); lower the pool sizes, --worker-cpus / --worker-gpus / "
        "--<pool>-resources, or add nodes")
    assert "2 'node_a' (the cluster has 0)" in capacity_shortfall(PoolTargets(2, 1), pinned, {"CPU": 8.0})


def test_auto_is_resolved_as_ray_does_so_that_a_loopback_head_is_joined_in_loopback_mode(tmp_path, monkeypatch):
    from deploy.cluster import is_loopback_address, resolve_address
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where Ray records the latest `ray start --head`
    assert resolve_address("auto") == "auto"  # nothing recorded: Ray's own search decides
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6380")
    assert resolve_address("auto") == "127.0.0.1:6380" and is_loopback_address(resolve_address("auto"))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert resolve_address("auto") == "10.0.0.5:6379"
    assert resolve_address("10.0.0.9:6379") == "10.0.0.9:6379"


def test_a_cluster_at_a_loopback_address_is_joined_in_loopback_mode():
    from deploy.cluster import is_loopback_address
    assert is_loopback_address("127.0.0.1:6379") and is_loopback_address("localhost:6379")
    assert is_loopback_address("[::1]:6379")
    assert not is_loopback_address("10.0.0.10:6379") and not is_loopback_address("auto")


# ---- tensor parallelism ----------------------------------------------------------------------------

def test_tensor_parallel_colocated_workers_hold_the_resources_of_all_their_ranks():
    opts = options("--prefill", "0", "--decode", "0", "--colocated", "2", "--tensor-parallel-size", "3",
                   "--omp-num-threads", "2")
    assert opts.tensor_parallel_size == {"prefill": 3, "decode": 3, "both": 3}  # every pool's
    spec = opts.worker_spec({"CPU": 8.0}, started_ray=True)
    assert (spec.tp("both"), spec.tp("prefill"), spec.tp("decode")) == (3, 3, 3)
    # --worker-cpus and --omp-num-threads are per rank: the actor holds them for its 3 ranks (the engine
    # then gives each rank a third of the threads: engine/tp_worker.py)
    assert spec.actor_options("both") == {"num_cpus": 1.5, "num_gpus": 0.0, "resources": {}}
    assert (spec.omp_num_threads, spec.threads("both")) == (2, 6)
    assert options("--colocated-tp", "3", "--prefill", "0", "--decode", "0",
                   "--colocated", "1").tensor_parallel_size == {"both": 3}
    assert options("--tensor-parallel-size", "3", "--prefill-tp", "1", "--decode-tp", "3").tensor_parallel_size \
        == {"decode": 3, "both": 3}  # a pool's own flag wins
    assert options().tensor_parallel_size == {} and options().worker_spec({"CPU": 2.0}, True).tp("both") == 1


def test_the_default_thread_share_counts_every_rank():
    cores = os.cpu_count() or 1
    spec = options("--prefill", "0", "--decode", "0", "--colocated", "1", "--tensor-parallel-size", "3").worker_spec(
        {"CPU": 2.0}, started_ray=True)
    assert spec.omp_num_threads == max(1, cores // 3) and spec.threads("both") == 3 * max(1, cores // 3)
    mixed = options("--colocated", "1", "--colocated-tp", "2").worker_spec({"CPU": 8.0}, started_ray=True)
    assert mixed.omp_num_threads == max(1, cores // 4)  # 1 prefill + 1 decode + 2 ranks
    assert (mixed.threads("prefill"), mixed.threads("both")) == (mixed.omp_num_threads, 2 * mixed.omp_num_threads)


def test_a_tensor_parallel_cuda_worker_takes_one_whole_gpu_per_rank():
    opts = options("--prefill", "0", "--decode", "0", "--colocated", "1", "--tensor-parallel-size", "2")
    spec = opts.worker_spec({"CPU": 16.0, "GPU": 4.0}, started_ray=False)
    assert spec.device == "cuda" and spec.actor_options("both") == {"num_cpus": 2.0, "num_gpus": 2.0, "resources": {}}
    pinned = options("--prefill", "0", "--decode", "0", "--colocated", "1", "--tensor-parallel-size", "4",
                     "--colocated-resources", '{"big_node": 1}').worker_spec({"GPU": 8.0, "big_node": 1.0}, False)
    assert pinned.actor_options("both")["resources"] == {"big_node": 1.0}  # custom resources: per worker
    with pytest.raises(ValueError, match=r"--colocated-tp 2 on cuda takes one whole GPU per rank .*"
                                         r"--worker-gpus must be 1 with tensor parallelism, got 0.5"):
        options("--prefill", "0", "--decode", "0", "--colocated", "1", "--colocated-tp", "2",
                "--worker-gpus", "0.5").worker_spec({"CPU": 4.0, "GPU": 1.0}, started_ray=True)


@pytest.mark.parametrize("argv, message", [
    (["--prefill", "0", "--decode", "0", "--colocated", "1", "--tensor-parallel-size", "0"],
     "--tensor-parallel-size must be an integer >= 1, got 0"),
    (["--prefill-tp", "0"], "--prefill-tp must be an integer >= 1, got 0"),
    (["--prefill", "0", "--decode", "0", "--colocated", "1", "--tensor-parallel-size", "2", "--device", "cuda",
      "--worker-gpus", "0.5"], "--worker-gpus must be 1 with tensor parallelism, got 0.5"),
])
def test_tensor_parallelism_the_cluster_cannot_run_is_refused_before_anything_starts(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_worker_spec_checks_tensor_parallel_sizes_by_role():
    from deploy.config import WorkerSpec
    assert WorkerSpec(tensor_parallel_size={"both": 2}).tp("both") == 2
    assert WorkerSpec(tensor_parallel_size={"prefill": 1, "decode": 1}).actor_options("decode")["num_cpus"] == 0.5
    with pytest.raises(ValueError, match=r"tensor_parallel_size is by role \(prefill, decode, both\), got 'router'"):
        WorkerSpec(tensor_parallel_size={"router": 2})
    assert WorkerSpec(tensor_parallel_size={"prefill": 2}).actor_options("prefill")["num_cpus"] == 1.0
    with pytest.raises(ValueError, match="--colocated-tp must be an integer >= 1, got True"):
        WorkerSpec(tensor_parallel_size={"both": True})
    with pytest.raises(ValueError, match="must not set device, role or tensor_parallel_size"):
        WorkerSpec(engine_options={"tensor_parallel_size": 2})


def test_capacity_counts_every_rank_and_a_worker_must_fit_on_one_node():
    from deploy.config import PoolTargets, WorkerSpec, capacity_shortfall
    cpu = WorkerSpec(num_cpus=0.5, tensor_parallel_size={"both": 3})
    assert capacity_shortfall(PoolTargets(0, 0, 1), cpu, {"CPU": 2.0}, [{"CPU": 2.0}]) is None
    assert capacity_shortfall(PoolTargets(0, 0, 2), cpu, {"CPU": 2.0}) == (
        "2 worker(s) need 3 CPUs (the cluster has 2); lower the pool sizes, --worker-cpus / --worker-gpus / "
        "--<pool>-resources / --tensor-parallel-size, or add nodes")
    # 1 prefill + 1 decode at 0.5 CPU each and one colocated worker of 3 ranks: 2.5 CPUs
    assert "2.5 CPUs (the cluster has 2)" in capacity_shortfall(PoolTargets(1, 1, 1), cpu, {"CPU": 2.0})
    gpu = WorkerSpec(device="cuda", num_cpus=1, num_gpus=1, tensor_parallel_size={"both": 4})
    two_nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    assert capacity_shortfall(PoolTargets(0, 0, 1), gpu, {"CPU": 16.0, "GPU": 4.0}) is None  # totals only
    assert capacity_shortfall(PoolTargets(0, 0, 1), gpu, {"CPU": 16.0, "GPU": 4.0}, two_nodes) == (
        "a colocated worker needs 4 CPU and 4 GPU on one node (tensor parallel 4: all its ranks run on its node), "
        "and no node of the cluster has them; lower --worker-cpus / --worker-gpus / --colocated-tp, or "
        "add a bigger node")
    assert capacity_shortfall(PoolTargets(0, 0, 1), gpu, {"CPU": 16.0, "GPU": 6.0},
                              two_nodes + [{"CPU": 4.0, "GPU": 2.0, "accelerator_type:H200": 1.0}]) is not None
    assert capacity_shortfall(PoolTargets(0, 0, 1), gpu, {"CPU": 24.0, "GPU": 6.0},
                              two_nodes + [{"CPU": 8.0, "GPU": 4.0}]) is None


def test_serve_refuses_a_tensor_parallel_size_that_cannot_split_the_model(monkeypatch):
    """Checked once the model is prepared, before any worker loads it (SmolLM2-135M's shape: 9
    query heads, 3 KV heads: TP 3, never 2)."""
    import engine.model.loader
    from deploy.config import WorkerSpec
    from deploy.serve import _check_model_splits
    from engine.model.arch import ModelArchConfig
    arch = ModelArchConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    resolved = []
    monkeypatch.setattr(engine.model.loader, "resolve_model",
                        lambda model: resolved.append(model) or type("Loaded", (), {"arch": arch})())
    _check_model_splits("default", WorkerSpec())  # no TP: the model is not even looked at
    assert resolved == []
    _check_model_splits("default", WorkerSpec(tensor_parallel_size={"both": 3}))
    with pytest.raises(ValueError, match=r"^--colocated-tp 2: tensor_parallel_size 2 cannot split "
                                         r"LlamaForCausalLM: num_attention_heads \(9\) .*\(sizes that can: 1, 3\)"):
        _check_model_splits("default", WorkerSpec(tensor_parallel_size={"both": 2}))


def test_serve_gives_up_with_the_routers_answer_when_they_never_become_ready():
    """Workers up, routers never routing (e.g. they cannot reach the workers): an error that says
    what the routers answered, not a silent wait."""
    import asyncio

    from deploy.serve import ServeError, _wait_healthy

    async def scenario():
        async def answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"error": "not ready: no healthy prefill + decode pair"}'
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            with pytest.raises(ServeError, match=r"within 0.5 s \(their /health answered: 503 .*no healthy "
                                                 r"prefill \+ decode pair"):
                await _wait_healthy(f"http://127.0.0.1:{port}", timeout_s=0.5)
    asyncio.run(scenario())


def test_serve_starts_a_ray_instance_of_its_own_even_where_one_runs(monkeypatch):
    """Without --ray-address: a new local instance ("local"), not the one $RAY_ADDRESS or the
    latest `ray start --head` names (ray.init joins that one by default, then refuses num_cpus)."""
    import ray

    from deploy.cluster import RaySettings, start_or_join
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr("deploy.cluster.quiet_ray_environment", lambda **kwargs: None)  # this process's env
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    with pytest.raises(RuntimeError, match="stop here"):
        start_or_join(RaySettings())
    assert calls[0]["address"] == "local"


def test_a_ray_cluster_that_cannot_be_joined_is_an_error_naming_the_flag(monkeypatch):
    import ray

    from deploy.cluster import RaySettings, start_or_join

    def init(**kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr("deploy.cluster.quiet_ray_environment", lambda **kwargs: None)
    with pytest.raises(ValueError, match=r"cannot join the Ray cluster at --ray-address 10.0.0.9:6379: Could not "
                                         r"find any running Ray instance.; start one \(`ray start --head`\)"):
        start_or_join(RaySettings(address="10.0.0.9:6379"))


@pytest.mark.parametrize("command", ["status", "scale"])
def test_a_controller_that_does_not_answer_is_an_error_not_a_traceback(command, monkeypatch, capsys):
    """The controller restarting (or dead): `pdserve status` / `scale` say so and how to go on."""
    import types

    import ray
    import ray.exceptions

    import deploy.cli as cli
    controller = types.SimpleNamespace(status=types.SimpleNamespace(remote=lambda: "ref"),
                                       scale=types.SimpleNamespace(remote=lambda *args: "ref"))
    monkeypatch.setattr(cli, "_controller", lambda args: controller)

    def get(ref, timeout=None):
        assert timeout is not None  # never an unbounded wait on an actor that may be gone
        raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr(ray, "get", get)
    argv = ["status"] if command == "status" else ["scale", "--decode", "2"]
    assert main(argv) == 1
    assert "the controller did not answer in time (it may be restarting" in capsys.readouterr().err


def test_a_busy_port_is_reported_before_ray_or_the_model_start(monkeypatch, tmp_path, capsys):
    import socket

    import deploy.serve as serve_module

    def start_or_join(settings):
        raise AssertionError("Ray must not start for a port that is taken")

    monkeypatch.setattr(serve_module, "start_or_join", start_or_join)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        opts = options("--port", str(port), "--state-file", str(tmp_path / "state.json"))
        assert serve_module.serve(opts) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_an_old_state_file_without_ready_still_reads(tmp_path):
    import json
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"pid": os.getpid(), "ray_address": "127.0.0.1:1", "namespace": "pdserve",
                                "controller": "pdserve-controller", "url": "http://127.0.0.1:8000",
                                "started_ray": True}))
    assert read_state(path).ready is False


def test_the_state_file_is_written_while_the_workers_start(monkeypatch, tmp_path):
    """`pdserve status` and `scale` work during a long startup (the workers' events say why one
    fails to start); the file says it is not ready yet."""
    import deploy.serve as serve_module
    session = {"address": "127.0.0.1:1", "started": True, "resources": {"CPU": 2.0}, "nodes": [{"CPU": 2.0}],
               "token_auth": False, "node_ip": "127.0.0.1"}
    monkeypatch.setattr(serve_module, "start_or_join", lambda settings: session)
    monkeypatch.setattr(serve_module, "_prepare_model", lambda model: None)
    monkeypatch.setattr(serve_module, "_check_model_splits", lambda model, spec: None)
    monkeypatch.setattr(serve_module, "_create_controller", lambda config: "controller")
    monkeypatch.setattr(serve_module, "_teardown", lambda *args: None)
    seen = []

    async def serve_async(options, spec, session, controller, state_file, state, worker_pids, sock):
        seen.append(read_state(state_file))
        return 0

    monkeypatch.setattr(serve_module, "_serve_async", serve_async)
    state_file = tmp_path / "serve.json"
    assert serve_module.serve(options("--port", "0", "--state-file", str(state_file))) == 0
    [state] = seen
    assert state.pid == os.getpid() and not state.ready and state.controller == "pdserve-controller"
    assert state.url.startswith("http://127.0.0.1:") and not state_file.exists()  # removed at the end
