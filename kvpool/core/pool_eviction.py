"""The pool index's eviction and failed-group rules, as a mixin of ``PoolIndex``.

Eviction: when a put would pass ``high_watermark × capacity``, least recently
used groups go until ``low_watermark``; then, while the object still does not
fit, one more at a time. Never a leased group, one being written, or the
group the put itself joins. ``eviction="object"`` (for comparisons) removes
one member at a time, as upstream's best-effort groups allow.

Failed groups: a member that failed to save (no space, revoked, timed out)
fails its group: dropped now, or as soon as no member is in flight, and its
later members refused for ``failed_group_hold_s`` (a one-member group may be
saved again at once).

The state these rules act on (groups in LRU order, objects, segments,
counters) lives in ``PoolIndex``; this module holds only behaviour.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpool.core.pool_records import (
    Group,
    PutOutcome,
    PutRequestItem,
    PutStatus,
    Segment,
)

if TYPE_CHECKING:
    from kvpool.core.pool_index import PoolIndex

    _Base = PoolIndex
else:
    _Base = object


class Eviction(_Base):
    __slots__ = ()

    def _reserve(
        self, order: list[Segment], size: int, high: float, low: float, keep: str = ""
    ) -> tuple[Segment, int] | None:
        """Place ``size`` bytes: evict to ``low`` used bytes past ``high``, then allocate.

        The group ``keep`` (the one this member joins) is never evicted for it:
        that would only leave the group incomplete.
        """
        if not order:
            return None
        if self.used_bytes + size > high:
            self._evict_until(lambda: self.used_bytes + size <= low, keep)
        while True:
            placed = self._allocate(order, size)
            if placed is not None:
                return placed
            if not self._evict_one(keep):
                return None

    @staticmethod
    def _allocate(order: list[Segment], size: int) -> tuple[Segment, int] | None:
        for segment in order:
            if segment.allocator.largest_free >= size:
                offset = segment.allocator.allocate(size)
                if offset is not None:
                    return segment, offset
        return None

    def _evict_until(self, done: Callable[[], bool], keep: str = "") -> None:
        while not done() and self._evict_one(keep):
            pass

    def _evict_one(self, keep: str = "") -> bool:
        for group_id, group in self.groups.items():
            if not group.busy and group_id != keep:
                if self.settings.eviction == "object":
                    self._evict_member(group)
                    return True
                self.counters.evicted_groups += 1
                self.counters.evicted_bytes += sum(m.size for m in group.members.values())
                self._drop_group(group_id)
                return True
        return False

    def _evict_member(self, group: Group) -> None:
        """``eviction="object"``: the group's oldest member alone (all are committed: the group is not busy).

        The rest stay, a partial group that lookups never count, until evicted
        in turn or made whole again by a put of the missing member.
        """
        key, obj = next(iter(group.members.items()))
        del group.members[key]
        group.num_committed -= 1
        self.counters.evicted_bytes += obj.size
        self._free(obj)
        if not group.members:
            self.counters.evicted_groups += 1
            del self.groups[group.group_id]
            self._incomplete.pop(group.group_id, None)


class GroupFailures(_Base):
    __slots__ = ()

    def _fail_group(self, group_id: str, group_size: int) -> None:
        """A member failed to save: drop the group now, or once no member is in flight; refuse it for a while.

        A one-member group has no other members to refuse: it may be saved again at once.
        """
        if group_size > 1:
            self._failed[group_id] = self.clock() + self.settings.failed_group_hold_s
            self._failed.move_to_end(group_id)
        group = self.groups.get(group_id)
        if group is None:
            return
        group.failed = True
        if not group.busy:
            self._drop_failed(group)

    def _drop_failed(self, group: Group) -> None:
        self.counters.failed_groups += 1
        self._drop_group(group.group_id)

    def _give_back_failed(self, items: Sequence[PutRequestItem], outcomes: list[PutOutcome], failed: set[str]) -> None:
        """Undo this batch's reservations for groups that failed in it (their writer never sees the space)."""
        for i, item in enumerate(items):
            if item.group_id in failed and outcomes[i].status is PutStatus.RESERVED:
                outcomes[i] = PutOutcome(PutStatus.GROUP_FAILED)
                obj = self.objects[item.key]
                group = self.groups[item.group_id]
                del self._in_flight[item.key]
                del group.members[item.key]
                group.num_in_flight -= 1
                self._free(obj)
        for group_id in failed:
            group = self.groups.get(group_id)
            if group is not None and not group.members:
                del self.groups[group_id]
            elif group is not None and not group.busy:
                self._drop_failed(group)

    def _prune_failed(self) -> None:
        now = self.clock()
        while self._failed and next(iter(self._failed.values())) <= now:
            self._failed.popitem(last=False)
