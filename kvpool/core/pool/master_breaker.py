"""When a pool client stops waiting on its master: a circuit breaker.

Pure: no grpc, no I/O; the caller passes the time. A master outage must cost
reuse (a lookup is a miss, a save is not stored: the request computes), never
waiting. The breaker turns "the master is known down" into an immediate
answer.

States:
- ``CLOSED``: calls go to the master.
- ``OPEN``: a call failed because the master could not be reached; every call
  is refused at once (``allow`` is False) until ``retry_at``.
- ``HALF_OPEN``: ``retry_at`` passed; exactly one call (the probe) goes to the
  master. Its success closes the breaker; its failure opens it again with the
  wait doubled, up to ``max_wait_s``.

Invariants:
- In ``OPEN`` no call is allowed; in ``HALF_OPEN`` at most one call is in
  flight (the probe), every other call is refused.
- ``success`` from any state closes the breaker and resets the wait to
  ``min_wait_s`` (the channel saw the master come back: the next call goes
  through at once, so no save made after the master returns is lost).
- The wait after the n-th consecutive failure is
  ``min(min_wait_s * 2**(n-1), max_wait_s)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class MasterBreaker:
    min_wait_s: float = 0.25
    max_wait_s: float = 4.0
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    retry_at: float = 0.0
    probe_in_flight: bool = False
    num_refused: int = 0  # calls answered without asking the master

    def __post_init__(self) -> None:
        if not 0 < self.min_wait_s <= self.max_wait_s:
            raise ValueError(f"need 0 < min_wait_s <= max_wait_s, got {self.min_wait_s}, {self.max_wait_s}")

    def allow(self, now: float) -> bool:
        """May a call go to the master now? A True in HALF_OPEN makes that call the probe."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and now >= self.retry_at:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN and not self.probe_in_flight:
            self.probe_in_flight = True
            return True
        self.num_refused += 1
        return False

    def success(self) -> None:
        """A call reached the master (whatever it answered), or the channel is ready again."""
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.probe_in_flight = False

    def failure(self, now: float) -> None:
        """A call could not reach the master (unavailable, or its deadline passed)."""
        self.consecutive_failures += 1
        wait = min(self.min_wait_s * 2 ** (self.consecutive_failures - 1), self.max_wait_s)
        self.state = BreakerState.OPEN
        self.retry_at = now + wait
        self.probe_in_flight = False

    def abandoned(self) -> None:
        """An allowed call ended without an answer (cancelled): a probe may go again."""
        self.probe_in_flight = False

    @property
    def known_down(self) -> bool:
        return self.state is not BreakerState.CLOSED
