"""The simulator's event queue: a heap of timed callbacks.

Invariants: events run in nondecreasing time; events at the same time run in
the order they were scheduled (a sequence number breaks ties), so a run is a
pure function of its inputs; ``now`` never goes backwards.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    """Discrete-event loop; ``now`` is the simulated clock the core modules are given."""

    __slots__ = ("now", "_heap", "_seq", "num_events", "_stopped", "housekeeping")

    # events between two calls of ``housekeeping``
    HOUSEKEEPING_EVERY = 1 << 12

    def __init__(self, housekeeping: Callable[[], None] | None = None) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.num_events = 0
        self._stopped = False
        # called every HOUSEKEEPING_EVERY events, outside simulated time (the runner keeps the heap with it)
        self.housekeeping = housekeeping

    def stop(self) -> None:
        """End ``run`` after the event in progress (the work is done; periodic events would go on forever)."""
        self._stopped = True

    def clock(self) -> float:
        return self.now

    def at(self, time: float, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` at ``time`` (never before ``now``)."""
        heapq.heappush(self._heap, (max(time, self.now), next(self._seq), callback, args))

    def after(self, delay: float, callback: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, callback, *args)

    def run(self, until: float) -> None:
        """Run every event at or before ``until`` (or until ``stop``); ``now`` ends at ``until`` unless stopped."""
        heap, housekeeping, every = self._heap, self.housekeeping, self.HOUSEKEEPING_EVERY - 1
        while heap and heap[0][0] <= until and not self._stopped:
            time, _, callback, args = heapq.heappop(heap)
            self.now = time
            self.num_events += 1
            callback(*args)
            if housekeeping is not None and not self.num_events & every:
                housekeeping()
        if not self._stopped:
            self.now = max(self.now, until)
