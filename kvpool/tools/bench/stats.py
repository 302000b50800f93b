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


def throughput_gbps(verified_bytes: int, seconds: Sequence[float]) -> float:
    """The one throughput formula of ``kvpool bench pool``, for every system it compares.

    Bytes that arrived and verified, over the seconds the measured batches
    took in all (GB = 1e9): a batch that moved fewer bytes, or wrong ones,
    cannot count as a full one.
    """
    return gbps(verified_bytes, math.fsum(seconds))
