"""When each request of a session is due: pure code over an injected clock (no I/O, no asyncio).

A session is a set of agent timelines (``kvpool.workload.timelines``). With
``time_scale`` s (the replay's ``--think-scale``) and the session started at S:

- a timeline's first request is due at ``S + first.t * s`` (``first.t`` is
  absolute in the session: a subagent's is its entry's ``t`` plus its own
  ``t``), but never before its parent has answered the turn that spawned it
  (the first ``spawn_after`` parent turns completed);
- every later request of a timeline is due ``think_time * s`` after the
  previous request of the SAME timeline completed (a closed loop per agent);
- timelines run concurrently: a subagent's requests go out beside its
  parent's later turns, each at its own times.

At ``s = 1`` and a server as fast as the recorded one this issues every request
at its recorded time; at ``s = 0`` a subagent starts as soon as its spawning
turn is answered and every turn follows its predecessor at once. A request is
issued once; ``done`` when every request has completed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.workload.timelines import AgentTimeline


@dataclass(slots=True, frozen=True)
class PlannedTurn:
    """What the schedule needs of a turn: its absolute trace time and the pause before it."""

    t: float
    think_time: float


@dataclass(slots=True, frozen=True)
class TurnRef:
    """One request: its timeline, its position in that timeline, its index in the session's turns."""

    timeline: int
    position: int
    turn: int


@dataclass(slots=True)
class _Track:
    spec: AgentTimeline
    next_position: int = 0
    in_flight: bool = False
    completed: int = 0
    ready_at: float | None = None  # due time of the next request once it is known


@dataclass(slots=True)
class SessionSchedule:
    """The due times of one session's requests as completions arrive (see the module doc)."""

    turns: Sequence[PlannedTurn]
    timelines: Sequence[AgentTimeline]
    start: float
    time_scale: float = 1.0
    _tracks: list[_Track] = field(init=False)
    _completion: dict[tuple[int, int], float] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        self._tracks = [_Track(spec) for spec in self.timelines]
        for track in self._tracks:
            if track.spec.turns:
                track.ready_at = self._first_due(track)

    def _first_due(self, track: _Track) -> float | None:
        """Due time of a timeline's first request; None while its parent has not answered the spawning turn."""
        spec = track.spec
        due = self.start + self.turns[spec.turns[0]].t * self.time_scale
        if spec.parent is None or spec.spawn_after == 0:
            return due
        gate = self._completion.get((spec.parent, spec.spawn_after - 1))
        return None if gate is None else max(due, gate)

    def pop_due(self, now: float) -> list[TurnRef]:
        """Requests due at or before ``now``, marked issued (timeline order)."""
        due: list[TurnRef] = []
        for index, track in enumerate(self._tracks):
            if track.in_flight or track.ready_at is None or track.ready_at > now:
                continue
            position = track.next_position
            due.append(TurnRef(index, position, track.spec.turns[position]))
            track.in_flight = True
            track.ready_at = None
            track.next_position += 1
        return due

    def complete(self, ref: TurnRef, now: float) -> None:
        """The request ``ref`` answered (or failed) at ``now``: its timeline's next request gets its due time."""
        track = self._tracks[ref.timeline]
        if not track.in_flight or ref.position != track.next_position - 1:
            raise ValueError(f"{ref} is not in flight")
        track.in_flight = False
        track.completed += 1
        self._completion[(ref.timeline, ref.position)] = now
        if track.next_position < len(track.spec.turns):
            think = self.turns[track.spec.turns[track.next_position]].think_time
            track.ready_at = now + think * self.time_scale
        # children waiting on this turn
        for child in self._tracks:
            spec = child.spec
            if spec.parent == ref.timeline and spec.spawn_after == ref.position + 1 and child.next_position == 0:
                child.ready_at = self._first_due(child)

    def next_due(self) -> float | None:
        """The earliest known due time of a request not yet issued; None if none is known now."""
        times = [t.ready_at for t in self._tracks if t.ready_at is not None and not t.in_flight]
        return min(times) if times else None

    @property
    def in_flight(self) -> int:
        return sum(t.in_flight for t in self._tracks)

    @property
    def done(self) -> bool:
        return all(t.completed == len(t.spec.turns) for t in self._tracks)


def simulate(schedule: SessionSchedule, service_time: Callable[[TurnRef], float]) -> list[tuple[float, TurnRef]]:
    """Virtual time: issue every request when due, each taking ``service_time(ref)``; (issue time, ref) in issue order.

    The same loop the replay engine runs, with a clock that jumps to the next
    event instead of waiting for it.
    """
    issued: list[tuple[float, TurnRef]] = []
    running: list[tuple[float, TurnRef]] = []  # (completion time, ref)
    now = schedule.start
    while not schedule.done:
        for ref in schedule.pop_due(now):
            issued.append((now, ref))
            running.append((now + service_time(ref), ref))
        next_due = schedule.next_due()
        next_end = min(running, key=lambda item: (item[0], item[1].timeline))[0] if running else None
        if next_end is not None and (next_due is None or next_end <= next_due):
            now = next_end
            for item in sorted((r for r in running if r[0] == now), key=lambda r: r[1].timeline):
                running.remove(item)
                schedule.complete(item[1], now)
        elif next_due is not None:
            now = next_due
        else:
            raise RuntimeError("schedule stalled: nothing due and nothing running")
    return issued
