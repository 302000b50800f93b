"""What sharing costs in time: each server's NIC shared by the transfers in flight, and each master's queue.

``Network``: a transfer between servers crosses the sending and the receiving
server's NIC. Each NIC's bandwidth is shared equally among the transfers in
flight on it, and a transfer moves at the smallest of its NICs' shares; the
shares are recomputed whenever a transfer starts or ends (no transfer ever
moves faster than a NIC allows, and a NIC's transfers never sum past its
bandwidth). A transfer's callback runs when its last byte lands.

``MasterQueue``: one pool master serves its operations one at a time, first
come first served; an operation's decision (the core's call) is made when its
service ends, so a busy master delays every restore and save behind it.
Its busy seconds over the run are its utilization; those of the operations
queued after warm-up, over the turns prefilled after it, are what a turn
costs the masters at the run's steady mix.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool.tools.sim.events import EventLoop


@dataclass(slots=True)
class Transfer:
    nics: tuple[str, ...]
    remaining: float
    callback: Callable[..., Any] | None
    args: tuple[Any, ...]
    rate: float = 0.0


@dataclass(slots=True)
class Network:
    """Servers' NICs of ``nic_bytes_per_s`` each (see the module doc for the sharing rule)."""

    loop: EventLoop
    nic_bytes_per_s: float
    transfers: dict[int, Transfer] = field(default_factory=dict)
    nic_bytes: dict[str, float] = field(default_factory=dict)  # bytes each NIC carried (sent + received)
    _ids: Any = field(default_factory=itertools.count)
    _last: float = 0.0
    _epoch: int = 0

    def send(self, src: str, dst: str, nbytes: float, callback: Callable[..., Any] | None = None,
             *args: Any) -> None:
        """Move ``nbytes`` from server ``src`` to server ``dst``; then ``callback(*args)``."""
        if src == dst or nbytes <= 0:
            if callback is not None:
                self.loop.after(0.0, callback, *args)
            return
        self._advance()
        for nic in (src, dst):
            self.nic_bytes[nic] = self.nic_bytes.get(nic, 0.0) + nbytes
        self.transfers[next(self._ids)] = Transfer((src, dst), float(nbytes), callback, args)
        self._reschedule()

    def in_flight(self, nic: str) -> int:
        return sum(nic in t.nics for t in self.transfers.values())

    def _advance(self) -> None:
        elapsed = self.loop.now - self._last
        self._last = self.loop.now
        if elapsed > 0:
            for t in self.transfers.values():
                t.remaining -= t.rate * elapsed

    def _reschedule(self) -> None:
        counts: dict[str, int] = {}
        for t in self.transfers.values():
            for nic in t.nics:
                counts[nic] = counts.get(nic, 0) + 1
        soonest = None
        for t in self.transfers.values():
            t.rate = min(self.nic_bytes_per_s / counts[nic] for nic in t.nics)
            eta = max(0.0, t.remaining) / t.rate
            soonest = eta if soonest is None else min(soonest, eta)
        self._epoch += 1
        if soonest is not None:
            self.loop.after(soonest, self._land, self._epoch)

    def _land(self, epoch: int) -> None:
        if epoch != self._epoch:
            return  # a start or an end since replaced this wake-up
        self._advance()
        done = [k for k, t in self.transfers.items() if t.remaining <= t.rate * 1e-9]
        landed = [self.transfers.pop(k) for k in done]
        self._reschedule()
        for t in landed:
            if t.callback is not None:
                t.callback(*t.args)


@dataclass(slots=True)
class MasterQueue:
    """One master's operations, served one at a time in arrival order (see the module doc)."""

    loop: EventLoop
    counted_from_s: float = 0.0  # operations queued from then on are also counted apart (after warm-up)
    busy_s: float = 0.0
    num_ops: int = 0
    counted_busy_s: float = 0.0
    counted_ops: int = 0
    _free_at: float = 0.0

    def call(self, service_s: float, callback: Callable[..., Any], *args: Any) -> None:
        """Queue an operation taking ``service_s``; ``callback(*args)`` runs when its service ends."""
        start = max(self.loop.now, self._free_at)
        self._free_at = start + service_s
        self.busy_s += service_s
        self.num_ops += 1
        if self.loop.now >= self.counted_from_s:
            self.counted_busy_s += service_s
            self.counted_ops += 1
        self.loop.at(self._free_at, callback, *args)

    def wait_s(self) -> float:
        """How long an operation queued now would wait before its service starts."""
        return max(0.0, self._free_at - self.loop.now)
