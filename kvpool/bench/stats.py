"""Small statistics for benchmark reports: percentiles and throughput."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def gbps(num_bytes: float, seconds: float) -> float:
    """Gigabytes (1e9) per second; NaN when the time is not positive."""
    return num_bytes / seconds / 1e9 if seconds > 0 else math.nan
