"""A backend's health from its health checks: a late answer is not a dead backend.

The router checks every pipeline and shard each ``health_interval_s``. A
backend that answers "not serving", or whose connection is refused, is out of
rotation at once: it is stopping, restarting or gone, and requests sent to it
would fail. One that does not answer within the check's deadline may only be
slow (a busy host); taking it out then turns requests that would have queued
into 503s. So a backend goes out only after ``misses`` late checks in a row,
and keeps its standing until then.

Invariants: one answer on time decides (serving → healthy, else unhealthy)
and clears the count of late ones; a backend never checked is unhealthy.
"""

from __future__ import annotations

import enum


class Check(enum.Enum):
    """What one health check of a backend found."""

    SERVING = "serving"
    DOWN = "down"  # answered "not serving", or refused, or failed otherwise: at once
    LATE = "late"  # no answer within the check's deadline


class HealthVerdicts:
    """Each backend's standing from its checks, by name."""

    def __init__(self, misses: int = 2) -> None:
        if misses < 1:
            raise ValueError(f"misses: must be at least 1, got {misses}")
        self.misses = misses
        self._healthy: dict[str, bool] = {}
        self._late: dict[str, int] = {}

    def record(self, name: str, check: Check) -> bool:
        """The backend's standing after this check: True when it is in rotation."""
        if check is Check.LATE:
            self._late[name] = self._late.get(name, 0) + 1
            if self._late[name] >= self.misses:
                self._healthy[name] = False
        else:
            self._late[name] = 0
            self._healthy[name] = check is Check.SERVING
        return self._healthy.get(name, False)

    def late_in_a_row(self, name: str) -> int:
        return self._late.get(name, 0)
