"""What the benchmark scripts share: percentiles.

Torch-free and cheap to import (the serving client imports it).
"""
from __future__ import annotations

import math


def percentile(sorted_values: list[float], p: float) -> float:
    """The p-th percentile (0-100) of a non-empty ascending list: linear interpolation between the
    closest ranks (numpy's default), so p99 of 50 values lies between the 49th and the 50th."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    rank = (len(sorted_values) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)
