"""Several Ray nodes on this one machine, for tests of the multi-node path (`pdserve serve
--ray-address`): each node has its own custom resources, temp dir and node id, and everything
listens on 127.0.0.1 only.

Why not two `ray start` commands: on Linux, Ray (2.60) replaces a `--node-ip-address` or
`--address` of 127.0.0.1 with the host's routable IP and then listens on every interface; with
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (loopback) it keeps 127.0.0.1 but refuses `ray start
--address` ("Multi-node Ray clusters are not supported"). So the nodes are started the way Ray
tests its own multi-node code, `ray.cluster_utils.Cluster`, in loopback mode, in a helper process
(`python -m tests.deploy.ray_nodes SPEC`): it prints one JSON line (the GCS address and each
node's id, IP and resources, from Ray's node table), then holds the nodes until its stdin closes
or it gets SIGTERM, and stops them. Every process of the nodes (Ray's daemons, their workers and
actors) inherits `NODES_MARKER`, so `RayNodes.stop()` finds and kills whatever is left, even after
the helper itself was killed, and only the processes of these nodes.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

NODES_MARKER = "PDSERVE_TEST_RAY_NODES"
START_TIMEOUT_S = 300


class RayNodes:
    """`resources` per node (the first is the head): `RayNodes([{"node_a": 1}, {"node_b": 1}])`.
    `address` (the GCS), `nodes` (one dict per node, in that order: node_id, node_ip,
    resources, temp_dir), `ray_tmpdir` (with `RAY_TMPDIR` set to it, `ray.init("auto")` finds
    these nodes, as it finds a `ray start --head`); `stop()` is idempotent and leaves no process
    of the nodes."""

    def __init__(self, resources: list[dict[str, float]], num_cpus: int = 1) -> None:
        from tests.deploy.harness import REPO
        self.marker = uuid.uuid4().hex
        self.ray_tmpdir = tempfile.mkdtemp(prefix="pdn-", dir="/tmp")  # short: Ray's socket paths live below it
        os.mkdir(f"{self.ray_tmpdir}/ray")  # RAY_TMPDIR's ray/ray_current_cluster
        spec = {"num_cpus": num_cpus, "nodes": [{"resources": r, "temp_dir": f"{self.ray_tmpdir}/{index}"}
                                                 for index, r in enumerate(resources)]}
        env = {**os.environ, NODES_MARKER: self.marker, "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback: Ray binds 127.0.0.1 only
               "RAY_TMPDIR": self.ray_tmpdir,  # Ray's default temp dir (ray_current_cluster): ours, not /tmp/ray
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)
        self.log: list[str] = []
        self._helper = subprocess.Popen([sys.executable, "-m", "tests.deploy.ray_nodes", json.dumps(spec)],
                                        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self._ready = threading.Event()
        self._info: dict | None = None
        threading.Thread(target=self._read, daemon=True).start()
        try:
            if not self._ready.wait(START_TIMEOUT_S) or self._info is None:
                raise RuntimeError("the Ray nodes did not start:\n" + "".join(self.log[-40:]))
        except BaseException:
            self.stop()
            raise
        self.address: str = self._info["address"]
        self.nodes: list[dict] = self._info["nodes"]

    def _read(self) -> None:
        for line in self._helper.stdout:
            self.log.append(line)
            if line.startswith("{") and self._info is None:
                self._info = json.loads(line)
                self._ready.set()
        self._ready.set()

    def node_with(self, resource: str) -> dict:
        [node] = [n for n in self.nodes if resource in n["resources"]]
        return node

    def processes(self) -> list[str]:
        from tests.deploy.harness import processes_inheriting
        return processes_inheriting(NODES_MARKER, self.marker)

    def stop(self) -> None:
        """Ask the helper to stop the nodes (stdin closed), then kill what is left, by marker."""
        if self._helper.poll() is None:
            try:
                self._helper.stdin.close()
                self._helper.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self._helper.kill()
                self._helper.wait()
        deadline = time.monotonic() + 30
        while (pids := _pids(self.processes())) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        shutil.rmtree(self.ray_tmpdir, ignore_errors=True)


def _pids(lines: list[str]) -> list[int]:
    """The pids of `processes_inheriting` lines, live processes only (a zombie cannot be killed)."""
    from tests.deploy.harness import running
    return [pid for pid in (int(line.split(":", 1)[0]) for line in lines) if running(pid)]


def _serve_nodes(spec: dict) -> None:
    """The helper process: start the nodes, print their JSON line, hold them until stdin closes."""
    from ray.cluster_utils import Cluster

    def node_args(node: dict) -> dict:
        return {"num_cpus": spec["num_cpus"], "resources": node["resources"], "temp_dir": node["temp_dir"],
                "node_ip_address": "127.0.0.1", "object_store_memory": 100 * 2**20, "include_dashboard": False}

    [head, *others] = spec["nodes"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the atexit hook stops the nodes
    cluster = Cluster(initialize_head=True, head_node_args=node_args(head), shutdown_at_exit=True)
    try:
        started = [cluster.head_node] + [cluster.add_node(**node_args(node)) for node in others]
        cluster.wait_for_nodes()
        table = {n["NodeID"]: n for n in cluster.global_state.node_table() if n["Alive"]}
        nodes = [{"node_id": node.node_id, "node_ip": table[node.node_id]["NodeManagerAddress"],
                  "resources": table[node.node_id]["Resources"], "temp_dir": wanted["temp_dir"]}
                 for node, wanted in zip(started, spec["nodes"])]
        print(json.dumps({"address": cluster.address, "nodes": nodes}), flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()
        print("ray nodes stopped", flush=True)


if __name__ == "__main__":
    _serve_nodes(json.loads(sys.argv[1]))
