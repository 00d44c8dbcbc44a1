"""benchmarks/peer_compare.py: the per-process CPU accounting and the table it writes (the full
comparison is a benchmark, run by hand; see benchmarks/README.md)."""
import subprocess
import sys
import time

from benchmarks.peer_compare import cpu_seconds_by_kind, markdown

SPIN = "import time, sys\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\ntime.sleep(30)"


def test_cpu_time_is_counted_per_kind_over_the_process_tree():
    # a root that spawns a busy "router_process" child and an idle one, then waits
    root_code = ("import subprocess, sys, time\n"
                 f"subprocess.Popen([sys.executable, '-c', {SPIN!r}, '0.6', 'router_process'])\n"
                 f"subprocess.Popen([sys.executable, '-c', {SPIN!r}, '0.0'])\n"
                 "time.sleep(30)")
    root = subprocess.Popen([sys.executable, "-c", root_code])
    try:
        deadline = time.monotonic() + 20
        seconds = {}
        while time.monotonic() < deadline and seconds.get("router", 0.0) < 0.6:
            time.sleep(0.2)
            seconds = cpu_seconds_by_kind(root.pid)
        assert seconds["router"] >= 0.6  # the busy child, found through its cmdline
        assert set(seconds) == {"serve", "router", "other"}  # the root itself, and the idle child
        assert seconds["other"] < seconds["router"]
    finally:
        subprocess.run(["pkill", "-P", str(root.pid)], check=False)
        root.kill()
        root.wait()


def test_the_table_carries_the_cpu_split():
    machine = {"cpu": "x", "cores": 2, "cpu_features": ["avx2"], "kernel_isa": "avx2", "torch": "t",
               "fp32_matmul_peak_gflops": 100.0}
    row = {"system": "pdserve colocated", "load": "concurrency 64", "total_tok_s": 200.0, "ttft_p50_ms": 1.0,
           "ttft_p99_ms": 2.0, "itl_p50_ms": 3.0, "itl_p99_ms": 4.0, "errors": 0,
           "cpu_s": {"workers": 100.0, "router": 10.0, "ray": 2.0, "serve": 1.0}}
    table = markdown({"machine": machine, "input_len": 256, "output_len": 64, "client": "builtin",
                      "rows": [row, dict(row, system="peer", cpu_s=None)]})
    assert "| 100 / 10 / 3 |" in table and table.rstrip().endswith("| - |")
