"""The serving benchmark: `pdserve bench`, runnable from a checkout as this script.

Its code is deploy/bench.py (installed with pdserve; workloads in deploy/bench_workloads.py):
this module runs it and re-exports it, so `python benchmarks/serve.py ARGS` and
`from benchmarks.serve import ...` keep working.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --workload chat --request-rate 2 \\
        --num-requests 64 --slo ttft:1000 tpot:100 --json out.json
    pdserve bench --base-url http://127.0.0.1:8000 ...        (the same command)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.bench import *  # noqa: E402,F401,F403
from deploy.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
