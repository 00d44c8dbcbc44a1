"""What the benchmark scripts share: percentiles, and the record of what was run.

Their code is in deploy/bench_record.py (installed with pdserve); this module
re-exports them for the scripts here. Torch-free and cheap to import; `run_metadata()` loads
`engine.cpu_kernels` only when called, for the CPU's model name.
"""
from __future__ import annotations

import subprocess  # noqa: F401 - tests replace subprocess.run through this module

from deploy.bench_record import REPO, percentile, run_metadata  # noqa: F401
