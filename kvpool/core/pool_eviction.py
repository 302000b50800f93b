"""The pool index's eviction and failed-group rules, each an object the index holds.

``Eviction`` frees space for a put; it sees the index only through
``Evictable`` (groups in LRU order, used bytes, and two ways to free).
``GroupFailures`` remembers which groups are refused for a while after a
member failed to save; it knows nothing of the index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.core.pool_records import Group, IndexCounters, Segment


class Evictable(Protocol):
    """What eviction needs of the index."""

    @property
    def lru_groups(self) -> OrderedDict[str, Group]:
        """Every group, least recently used first."""
        ...

    @property
    def used_bytes(self) -> int: ...

    def drop_group(self, group_id: str) -> int:
        """Free every member of a group and forget it; returns members dropped."""
        ...

    def drop_member(self, group: Group, key: str) -> None:
        """Free one committed member; a group left with no member is forgotten."""
        ...

    def allocate(self, order: list[Segment], size: int) -> tuple[Segment, int] | None:
        """Place ``size`` bytes in the first segment of ``order`` with room, or nowhere."""
        ...


@dataclass(slots=True)
class Eviction:
    """Frees space for a put, least recently used group first.

    Invariants:
    - when a put would pass ``high`` used bytes, groups go until ``low``; then,
      while the object still does not fit, one more at a time;
    - never a busy group (leased, or a put in flight), nor the group ``keep``
      that the put itself joins (evicting it would only leave it incomplete);
    - ``mode="group"`` removes whole groups; ``mode="object"`` (for
      comparisons) removes one member at a time, as upstream's best-effort
      groups allow, and may leave partial groups (lookups never count them);
    - ``counters.evicted_groups``/``evicted_bytes`` count every group and
      byte it removed.
    """

    index: Evictable
    counters: IndexCounters
    mode: str = "group"

    def reserve(
        self, order: list[Segment], size: int, high: float, low: float, keep: str = ""
    ) -> tuple[Segment, int] | None:
        """Place ``size`` bytes: evict to ``low`` used bytes past ``high``, then allocate."""
        if not order:
            return None
        index = self.index
        if index.used_bytes + size > high:
            while index.used_bytes + size > low and self.evict_one(keep):
                pass
        while True:
            placed = index.allocate(order, size)
            if placed is not None:
                return placed
            if not self.evict_one(keep):
                return None

    def evict_one(self, keep: str = "") -> bool:
        """Evict the least recently used idle group (or, by object, its oldest member); False if none may go."""
        groups = self.index.lru_groups
        for group_id, group in groups.items():
            if group.busy or group_id == keep:
                continue
            if self.mode == "object":
                # all members are committed: the group is not busy
                key, obj = next(iter(group.members.items()))
                self.counters.evicted_bytes += obj.size
                self.index.drop_member(group, key)
                if group_id not in groups:
                    self.counters.evicted_groups += 1
                return True
            self.counters.evicted_groups += 1
            self.counters.evicted_bytes += sum(m.size for m in group.members.values())
            self.index.drop_group(group_id)
            return True
        return False


@dataclass(slots=True)
class GroupFailures:
    """Groups whose members are refused for ``hold_s`` after one of them failed to save.

    A member that failed (no space, revoked, timed out) fails its group: its
    other members would only make an incomplete group. A one-member group has
    no other members to refuse: it may be saved again at once.

    Invariant: entries are in expiry order (one ``hold_s`` for all, and a group
    failed again moves to the end), so ``prune`` stops at the first live one.
    """

    hold_s: float
    clock: Callable[[], float]
    _until: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def hold(self, group_id: str, group_size: int) -> None:
        if group_size > 1:
            self._until[group_id] = self.clock() + self.hold_s
            self._until.move_to_end(group_id)

    def prune(self) -> None:
        """Forget holds that have run out."""
        now = self.clock()
        until = self._until
        while until and next(iter(until.values())) <= now:
            until.popitem(last=False)

    def __contains__(self, group_id: object) -> bool:
        """Held (as of the last ``prune``)."""
        return group_id in self._until
