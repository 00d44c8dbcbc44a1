"""SIGTERM while the pools are still loading: `pdserve serve` unwinds like Ctrl-C (workers
stopped, controller killed, its Ray instance stopped) and leaves no process behind."""
import signal
import tempfile
from pathlib import Path

import pytest

from tests.deploy.harness import Serve, descendants, processes_inheriting, processes_mentioning, start_time
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


def test_sigterm_during_startup_leaves_no_process():
    with tempfile.TemporaryDirectory(prefix="pdsv-", dir="/tmp") as ray_temp_dir, \
            tempfile.TemporaryDirectory(prefix="pdserve-state-") as state_dir:
        state_file = Path(state_dir) / "serve.json"
        serve = Serve(state_file, ray_temp_dir, "--device", "cpu", "--prefill", "1", "--decode", "1",
                      "--kv-cache-blocks", "64")
        try:
            serve.wait_for("decode-2 starting")  # the controller has launched the worker actors
            tree = descendants(serve.popen.pid)
            # Ray's daemons and the controller at least, with the marker: else the checks below prove nothing
            assert len(tree) >= 2 and len(processes_inheriting("PDSERVE_STATE_FILE", str(state_file))) >= 2
            serve.popen.send_signal(signal.SIGTERM)
            assert serve.popen.wait(180) == 0, serve.tail()
        finally:
            serve.stop(signal.SIGKILL)
        assert serve.log[-1].strip() == "pdserve stopped"
        assert "pdserve ready" not in "".join(serve.log)
        wait_until(lambda: all(start_time(pid) != started for pid, started in tree.items()), 60,
                   "every process of the cluster to exit", interval=0.5)
        wait_until(lambda: not processes_inheriting("PDSERVE_STATE_FILE", str(state_file)), 60,
                   "the worker processes to exit", interval=0.5)
        assert processes_mentioning(ray_temp_dir) == []
        assert not state_file.exists()
