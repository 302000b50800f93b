"""When a supervisor restarts a dead process, and when it gives up.

Pure: no processes, no clock of its own (the caller passes the time). The
same policy as the systemd units (``Restart=on-failure`` with a pause, and a
start limit), for ``kvpool up``:

- A death schedules a restart after ``min(base_s * 2**(n-1), max_s)``, where
  ``n`` counts this service's deaths within the last ``window_s`` seconds.
- More than ``burst`` deaths within ``window_s`` and the supervisor gives up
  on that service for good (it stays dead and says so).
- When several services are due at once, they restart in ``rank`` order
  (lower first): the master before the stores that mount on it, later prefill
  stages before stage 0 (which checks them), the router last.

Invariants: a service is never both due and given up; ``restarts`` counts
restarts actually begun (``restarting``), never deaths.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class RestartPolicy:
    base_s: float = 0.5
    max_s: float = 8.0
    burst: int = 5
    window_s: float = 120.0

    def __post_init__(self) -> None:
        if not (0 < self.base_s <= self.max_s and self.burst >= 1 and self.window_s > 0):
            raise ValueError("restart policy: need 0 < base_s <= max_s, burst >= 1, window_s > 0")


@dataclass(slots=True)
class ServiceRestarts:
    rank: int
    deaths: deque[float] = field(default_factory=deque)
    restarts: int = 0
    due_at: float | None = None
    gave_up: bool = False


class Supervision:
    """Deaths in, restart decisions out, for a fixed set of named services."""

    def __init__(self, policy: RestartPolicy, ranks: Mapping[str, int]) -> None:
        self.policy = policy
        self.services = {name: ServiceRestarts(rank) for name, rank in ranks.items()}

    def died(self, name: str, now: float) -> float | None:
        """Record a death; the time its restart is due, or None when giving up."""
        service = self.services[name]
        if service.gave_up:
            return None
        service.deaths.append(now)
        while service.deaths and service.deaths[0] < now - self.policy.window_s:
            service.deaths.popleft()
        n = len(service.deaths)
        if n > self.policy.burst:
            service.gave_up = True
            service.due_at = None
            return None
        service.due_at = now + min(self.policy.base_s * 2 ** (n - 1), self.policy.max_s)
        return service.due_at

    def due(self, now: float) -> list[str]:
        """Services whose restart is due, in rank order (then name)."""
        ready = [(s.rank, name) for name, s in self.services.items() if s.due_at is not None and s.due_at <= now]
        return [name for _, name in sorted(ready)]

    def restarting(self, name: str) -> None:
        service = self.services[name]
        service.due_at = None
        service.restarts += 1

    def summary(self) -> dict[str, dict[str, object]]:
        return {name: {"restarts": s.restarts, "gave_up": s.gave_up, "restart_due": s.due_at is not None}
                for name, s in self.services.items()}
