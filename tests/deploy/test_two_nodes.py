"""The multi-node path on one machine: two Ray nodes (node A with the custom resource `node_a`,
node B with `node_b`; tests/deploy/ray_nodes.py), and `pdserve serve --ray-address auto` joining
them with `--prefill-resources '{"node_a": 1}' --decode-resources '{"node_b": 1}'` and workers that
listen on their node's IP (`--worker-host node-ip`). One cluster for the module:

- the prefill worker runs on node A and the decode worker on node B: by the node ids that
  `pdserve status --json` reports, matched against Ray's node table, and by the worker
  processes' parents (each node's raylet); the addresses they advertise are their node's IP;
- greedy chat completions through the `openai` client equal the offline engine's
  (`engine.LLM`), and the decode worker received their KV over the transport (kv_bytes_received
  in the status) from the prefill worker on the other node;
- SIGINT stops `pdserve serve` and its workers and leaves the nodes it joined running; then the
  nodes stop and no process of theirs is left.
"""
import json
import signal
import tempfile
from pathlib import Path

import pytest

from tests.deploy.harness import Serve, assert_chats_match_offline, ready_workers, running
from tests.deploy.ray_nodes import RayNodes, _pids
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

KV_CACHE_GB = "0.05"  # ~70 blocks of the default model per worker: plenty for short chats
MAX_TOKENS = 16
CHATS = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
         [{"role": "user", "content": "Name three colours."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}]]


@pytest.fixture(scope="module")
def nodes():
    ray_nodes = RayNodes([{"node_a": 1}, {"node_b": 1}])
    try:
        yield ray_nodes
    finally:
        ray_nodes.stop()


@pytest.fixture(scope="module")
def serve(nodes):
    with tempfile.TemporaryDirectory(prefix="pdserve-state-") as state_dir:
        server = Serve(Path(state_dir) / "serve.json", None,
                       "--ray-address", "auto", "--model", "default", "--device", "cpu",
                       "--kv-cache-memory-gb", KV_CACHE_GB, "--local-prefill-threshold", "0",
                       "--worker-host", "node-ip",
                       "--prefill-resources", '{"node_a": 1}', "--decode-resources", '{"node_b": 1}',
                       env={"RAY_TMPDIR": nodes.ray_tmpdir, "RAY_ADDRESS": ""})  # `auto`: these nodes
        try:
            server.url = server.wait_ready()
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def offline():
    from engine import LLM
    return LLM("default", kv_cache_memory_gb=float(KV_CACHE_GB))


@pytest.fixture(scope="module")
def client(serve):
    import openai
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def raylet_of(pid: int) -> str:
    """The command line of the process's parent: a Ray worker's is its node's raylet."""
    parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    return Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_each_pool_runs_on_its_node_and_advertises_the_nodes_ip(serve, nodes):
    assert f"Ray at {nodes.address};" in "".join(serve.log)  # `auto` found the head on 127.0.0.1
    status = json.loads(serve.cli("status", "--json").stdout)
    assert status["settled"]
    table = serve.cli("status").stdout
    for role, resource in (("prefill", "node_a"), ("decode", "node_b")):
        node = nodes.node_with(resource)
        [worker] = ready_workers(status, role)
        assert (worker["node_id"], worker["node_ip"]) == (node["node_id"], node["node_ip"])
        assert worker["address"].rpartition(":")[0] == node["node_ip"]
        command = raylet_of(worker["pid"])
        assert "raylet" in command and f"{node['temp_dir']}/" in command
        assert f"{node['node_id'][:8]}@{node['node_ip']}" in table
    [decode] = ready_workers(status, "decode")
    assert f"tcp://{nodes.node_with('node_b')['node_ip']}:" in decode["transport_address"]
    assert nodes.node_with("node_a")["node_id"] != nodes.node_with("node_b")["node_id"]


def test_chat_completions_cross_the_nodes_and_match_the_offline_engine(serve, client, offline):
    before = {w["role"]: w for w in serve.status()["workers"]}
    assert_chats_match_offline(client, offline, CHATS, MAX_TOKENS)

    def kv_moved():  # Stats are polled every second: wait for a poll after the requests
        workers = {w["role"]: w for w in serve.status()["workers"]}
        grown = (workers["decode"]["kv_bytes_received"] > before["decode"]["kv_bytes_received"]
                 and workers["prefill"]["kv_bytes_sent"] > before["prefill"]["kv_bytes_sent"])
        return workers if grown else None
    workers = wait_until(kv_moved, 60, "the decode worker to report the KV it received", interval=0.5)
    assert workers["decode"]["kv_bytes_received"] > 0 and workers["prefill"]["kv_bytes_sent"] > 0


def test_sigint_stops_serve_and_its_workers_and_leaves_the_nodes(serve, nodes):
    pids = [w["pid"] for w in serve.status()["workers"]]
    serve.popen.send_signal(signal.SIGINT)
    assert serve.popen.wait(180) == 0, serve.tail()
    assert serve.log[-1].strip() == "pdserve stopped"
    assert "Traceback" not in "".join(serve.log), serve.tail(200)
    wait_until(lambda: not any(running(pid) for pid in pids), 60, "the worker processes to exit", interval=0.5)
    assert nodes.processes(), "the nodes pdserve joined were stopped with it"


def test_the_nodes_stop_and_leave_no_process(nodes):
    """The nodes shut down by themselves (the helper's stdin closed): checked before `stop()`,
    whose kill-by-marker would leave nothing behind either way."""
    assert nodes.processes(), "no process carries the nodes' marker: the check below would prove nothing"
    nodes._helper.stdin.close()
    assert nodes._helper.wait(60) == 0
    assert any("ray nodes stopped" in line for line in nodes.log)
    wait_until(lambda: not _pids(nodes.processes()), 60, "the nodes' processes to exit", interval=0.5)
    nodes.stop()


