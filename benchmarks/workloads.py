"""The serving workloads (`random`, `chat`, `interference`, `agent`, `code_edit`, `json_echo`).

Their code is deploy/bench_workloads.py (installed with pdserve, for `pdserve bench`); this
module re-exports it for the benchmark scripts and tests (`from benchmarks.workloads import ...`).
"""
from deploy.bench_workloads import *  # noqa: F401,F403
