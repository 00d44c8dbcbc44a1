"""What every benchmark's record shares: percentiles, and what was run where (`run_metadata`).

`pdserve bench` (deploy/bench.py) uses it, and benchmarks/common.py re-exports it for the scripts
in benchmarks/. Torch-free and cheap to import; `run_metadata()` loads `engine.cpu_kernels` only
when called, for the CPU's model name.
"""
from __future__ import annotations

import datetime
import math
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

# The checkout this module runs from, if it is one (`run_metadata` names its commit); an installed
# package is in no checkout, and its reports carry no commit.
REPO = Path(__file__).resolve().parents[1]


def percentile(sorted_values: list[float], p: float) -> float:
    """The p-th percentile (0-100) of a non-empty ascending list: linear interpolation between the
    closest ranks (numpy's default), so p99 of 50 values lies between the 49th and the 50th."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    rank = (len(sorted_values) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def run_metadata(argv: list[str] | None = None) -> dict[str, Any]:
    """What a result file needs to say what produced it: the checkout's commit (`git_commit`, None
    outside a git checkout or without git) and whether tracked files differed from it (`git_dirty`,
    None when unknown), this machine's CPU model (`cpu_model`, None if unknown), the command line
    (`argv`, default sys.argv), the time (`utc_time`, ISO 8601 with +00:00) and the Python version.
    Never raises for a missing git or CPU description."""
    commit = _git("rev-parse", "HEAD")
    status = _git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status),
            "cpu_model": _cpu_model(), "argv": list(sys.argv if argv is None else argv),
            "utc_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version()}


def _git(*args: str) -> str | None:
    """`git ARGS` in the checkout, its stripped output; None outside one (an installed package,
    even one inside another repository's folder) or when git fails or is missing."""
    if not (REPO / ".git").exists():
        return None
    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        from engine.cpu_kernels import cpu_model
        return cpu_model()
    except Exception:  # a benchmark's record must not fail over a CPU description
        return platform.processor() or platform.machine() or None
