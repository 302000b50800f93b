"""Read leases on groups: a leased group is never evicted or removed.

Pure; the index holds one ``LeaseTable``.

Invariant: each group's ``num_leases`` equals the number of live leases that
hold it. A lease holds the group objects themselves: a group dropped and
re-created under the same id is a new object with its own count.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.core.pool import fields
from kvpool.core.pool.records import Group


@dataclass(slots=True)
class LeaseTable:
    """Live leases by id, with a heap of expiry times (stale entries skipped)."""

    clock: Callable[[], float]
    # each lease's groups, and the groups found before them that it does not hold (its release touches them)
    _leases: dict[int, tuple[list[Group], list[Group]]] = field(default_factory=dict)
    _expiry: list[tuple[float, int]] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    # what the caller noted of a lease when it granted it (the group table's version after its touch)
    _marks: dict[int, int] = field(default_factory=dict)
    # live leases whose read already counted as a use (``PoolIndex.use_lease``): their release touches nothing
    _read: set[int] = field(default_factory=set)

    def grant(self, groups: list[Group], duration_s: float, held: list[Group] | None = None) -> int:
        """Lease ``groups``; ``held``: the groups found before them, unleased (the caller holds them)."""
        lease_id = next(self._ids)
        self._leases[lease_id] = (groups, held or [])
        heapq.heappush(self._expiry, (self.clock() + duration_s, lease_id))
        fields.add(groups, Group, "num_leases", 1)
        return lease_id

    def mark(self, lease_id: int, value: int) -> None:
        """Note ``value`` with a live lease (gone when it ends)."""
        self._marks[lease_id] = value

    def get(self, lease_id: int) -> tuple[list[Group], list[Group]] | None:
        """A live lease's groups and those found before them (as ``release`` returns them), or None."""
        return self._leases.get(lease_id)

    def mark_of(self, lease_id: int) -> int | None:
        return self._marks.get(lease_id)

    def note_read(self, lease_id: int) -> None:
        """A live lease's read counted as a use (forgotten when it ends)."""
        self._read.add(lease_id)

    def was_read(self, lease_id: int) -> bool:
        return lease_id in self._read

    def release(self, lease_id: int) -> tuple[list[Group], list[Group]] | None:
        """End a lease; returns the groups it held and those found before them, or None if it is unknown
        (ended or expired)."""
        released = self._leases.pop(lease_id, None)
        if released is not None:
            self._marks.pop(lease_id, None)
            self._read.discard(lease_id)
            _unlease(released[0])
        return released

    def expire(self) -> list[Group]:
        """End every lease past its time; returns the groups they held (a group once per lease)."""
        now = self.clock()
        ended: list[Group] = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            released = self.release(lease_id)
            if released is not None:
                ended.extend(released[0])
        return ended

    def leased(self) -> list[Group]:
        """Every group each live lease holds, once per lease (the invariant's left side)."""
        return [group for groups, _ in self._leases.values() for group in groups]

    def __len__(self) -> int:
        return len(self._leases)


def _unlease(groups: list[Group]) -> None:
    fields.add(groups, Group, "num_leases", -1)
