"""The pool index's writes: puts from start to commit or revoke, the groups they leave incomplete, failed groups.

Pure. The index holds one ``PutTable``; the table sees the index's objects
only through ``PutHost`` (and frees or drops them only through it), and its
groups, segments and eviction through the parts the index gives it.

Invariants:
- ``in_flight`` holds every put started and not yet committed or revoked,
  with when it started, oldest first;
- a group with a member that failed to save (no space, revoked, timed out) is
  dropped at once, or as soon as no member is in flight, and its other
  members are refused for ``failed_group_hold_s``;
- a group still incomplete ``incomplete_group_s`` after its last member
  arrived, with nothing in flight, is dropped (its other writers died, or the
  stores with its other members never re-reported after a master restart);
  ``incomplete`` holds each such group's deadline, soonest first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from kvpool.core.pool.placement import batch_orders, group_first
from kvpool.core.pool.eviction import Eviction, GroupFailures
from kvpool.core.pool.groups import GroupTable
from kvpool.core.pool.put_checks import check_put_batch, check_put_end
from kvpool.core.pool.records import (
    Group,
    IndexCounters,
    ObjectRecord,
    PutOutcome,
    PutRequestItem,
    PutStatus,
    Segment,
    StoredObject,
)
from kvpool.core.pool.segments import SegmentTable
from kvpool.core.pool.settings import IndexSettings
from kvpool.core.tenancy.shares import tenant_name

_GROUP_ID = attrgetter("group_id")


class PutHost(Protocol):
    """What the put table needs of the index."""

    @property
    def objects(self) -> dict[str, StoredObject]: ...

    def drop_group(self, group_id: str) -> int:
        """Free every member of a group and forget it; returns members dropped."""
        ...

    def free(self, obj: StoredObject) -> None:
        """Forget one object and give its bytes back (its group is the caller's to update)."""
        ...


@dataclass(slots=True)
class PutTable:
    """Puts in flight and the groups they leave incomplete (invariants above)."""

    index: PutHost
    settings: IndexSettings
    clock: Callable[[], float]
    counters: IndexCounters
    failures: GroupFailures
    group_table: GroupTable
    segment_table: SegmentTable
    eviction: Eviction
    # puts in flight, with when they started (in that order)
    in_flight: OrderedDict[str, float] = field(default_factory=OrderedDict)
    # incomplete groups, with when they are dropped unless a member arrives (in that order)
    incomplete: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def put_start(self, client_host: str, items: Sequence[PutRequestItem]) -> list[PutOutcome]:
        """Reserve space for each item, evicting LRU groups when needed.

        The whole batch is validated before anything changes, so a bad item
        leaves the index untouched. A member with no space fails its group:
        members of it reserved earlier in this batch are given back at once
        (``GROUP_FAILED``), later ones are refused.
        """
        segments = self.segment_table.segments
        check_put_batch(items, segments, self.group_table.groups, self.index.objects)
        self.failures.prune()
        outcomes: list[PutOutcome] = []
        rotations = batch_orders(
            segments.values(), client_host, sum(item.size for item in items), self.settings.stripe_min_bytes
        )
        num_placed = 0
        capacity = self.segment_table.capacity
        high = self.settings.high_watermark * capacity
        low = self.settings.low_watermark * capacity
        started = self.clock()
        objects, groups, in_flight, failed = self.index.objects, self.group_table.groups, self.in_flight, self.failures
        failed_here: set[str] = set()
        # group_first's answers in this batch: a pure function of the rotation and the group's segments, which
        # repeat from item to item (a save's groups each lie in one store), and a sort of every segment each
        firsts: dict[tuple[int, frozenset[str]], list[Segment]] = {}
        # new groups whose members all come in this batch, by their first member's place, where nothing in the
        # batch evicts (``_runs``): each is placed at once at that place, its other members' outcomes kept
        runs = self._runs(items, rotations, high)
        kept: dict[int, PutOutcome] = {}
        for position, item in enumerate(items):
            if kept:
                outcome = kept.pop(position, None)
                if outcome is not None:
                    outcomes.append(outcome)
                    num_placed += 1
                    self.mark_incomplete(item.group_id)  # at each member's place, as one at a time
                    continue
            run = runs.get(position)
            if run is not None:
                placed_run = self._place_run([items[p] for p in run], rotations[num_placed % len(rotations)][0],
                                             started)
                if placed_run is not None:  # else (no one hole for them there) its members go one at a time
                    outcomes.append(placed_run[0])
                    num_placed += 1
                    kept.update(zip(run[1:], placed_run[1:]))
                    continue
            key = item.key
            if key in objects:
                outcomes.append(PutOutcome(PutStatus.ALREADY_EXISTS))
                continue
            if item.group_id in failed:
                outcomes.append(PutOutcome(PutStatus.GROUP_FAILED))
                continue
            group = groups.get(item.group_id)
            rotation = num_placed % len(rotations)
            order = rotations[rotation]
            if group is not None and group.members:
                # keep a group in one store where room allows
                held = frozenset([m.segment_id for m in group.members.values()])
                first = firsts.get((rotation, held))
                if first is None:
                    first = firsts[rotation, held] = group_first(order, held, client_host)
                order = first
            # a group is its first writer's
            tenant = group.tenant if group is not None else tenant_name(item.tenant)
            placed = self.eviction.reserve(order, item.size, high, low, keep=item.group_id, tenant=tenant)
            if placed is None:
                outcomes.append(PutOutcome(PutStatus.NO_SPACE))
                failed_here.add(item.group_id)
                self._fail_group(item.group_id, item.group_size)
                continue
            num_placed += 1
            segment, offset = placed
            group = groups.get(item.group_id)  # eviction may have dropped it meanwhile
            if group is None:
                group = self.group_table.add(Group(item.group_id, item.group_size, tenant=tenant))
            # the group's own id string: a group's members name it once in memory, not once per member
            obj = StoredObject(key, group.group_id, segment.segment_id, offset, item.size, tenant=group.tenant)
            objects[key] = obj
            self.group_table.add_object(obj)
            segment.keys.add(key)
            group.members[key] = obj
            group.num_in_flight += 1
            self.mark_incomplete(item.group_id)
            in_flight[key] = started
            outcomes.append(PutOutcome(PutStatus.RESERVED, segment, offset))
        if failed_here:
            self._give_back_failed(items, outcomes, failed_here)
        self.group_table.touch(dict.fromkeys(item.group_id for item in items if item.group_id in groups))
        return outcomes

    def _runs(self, items: Sequence[PutRequestItem], rotations: list[list[Segment]], high: float
              ) -> dict[int, list[int]]:
        """The places in ``items`` of each group the index does not hold, whose every member is in the batch
        (a save's chunk: its stages, in whatever order), keyed by its first member's place; none unless the
        whole batch fits below ``high`` and in the largest free extent of each segment a member would go to
        first. One at a time, each member would then go to its group's first member's segment, and nothing
        would evict: placing a group at once decides the same."""
        positions: dict[str, list[int]] = {}
        for position, group_id in enumerate(map(_GROUP_ID, items)):
            positions.setdefault(group_id, []).append(position)
        groups, objects, failed = self.group_table.groups, self.index.objects, self.failures
        runs = {places[0]: places for group_id, places in positions.items()
                if len(places) == items[places[0]].group_size > 1 and group_id not in groups
                and group_id not in failed and not any(items[p].key in objects for p in places)}
        if not runs or not rotations[0]:
            return {}
        rounded = rotations[0][0].allocator.rounded_size  # one alignment for every segment (the index's settings)
        total = sum(rounded(item.size) for item in items)
        if self.segment_table.used_bytes + total > high or \
                any(order[0].allocator.largest_free < total for order in rotations):
            return {}
        return runs

    def _place_run(self, run: list[PutRequestItem], segment: Segment, started: float) -> list[PutOutcome] | None:
        """Every member of a new group at once, back to back in ``segment``: one hole, one run of space to give
        back when the group goes. None, with nothing changed, when the segment has no one hole for them all."""
        first = run[0]
        offsets = self.segment_table.allocate_run(segment, [item.size for item in run])
        if offsets is None:
            return None
        group = self.group_table.add(Group(first.group_id, first.group_size, tenant=tenant_name(first.tenant)))
        group_id, tenant = group.group_id, group.tenant
        segment_id, keys, members = segment.segment_id, segment.keys, group.members
        objects, in_flight, add_object = self.index.objects, self.in_flight, self.group_table.add_object
        outcomes = []
        for item, offset in zip(run, offsets):
            key = item.key
            obj = StoredObject(key, group_id, segment_id, offset, item.size, tenant=tenant)
            objects[key] = members[key] = obj
            add_object(obj)
            keys.add(key)
            in_flight[key] = started
            outcomes.append(PutOutcome(PutStatus.RESERVED, segment, offset))
        group.num_in_flight = len(run)
        self.mark_incomplete(group_id)
        return outcomes

    def put_end(self, commits: Sequence[tuple[str, int]]) -> int:
        """Commit in-flight puts (key, checksum); all or none."""
        check_put_end(commits, self.in_flight)
        groups, segments = self.group_table.groups, self.segment_table.segments
        for key, checksum in commits:
            del self.in_flight[key]
            obj = self.index.objects[key]
            obj.checksum = checksum
            obj.committed = True
            group = groups[obj.group_id]
            group.num_in_flight -= 1
            group.num_committed += 1
            group.forget_encodings()
            if group.complete:
                self.incomplete.pop(obj.group_id, None)
            segments[obj.segment_id].journal.add(
                ObjectRecord(key, obj.group_id, group.size, obj.offset, obj.size, checksum, obj.tenant)
            )
            if group.failed and group.num_in_flight == 0:
                self._drop_failed(group)
        return len(commits)

    def put_revoke(self, keys: Iterable[str]) -> int:
        """Give back the space of in-flight puts and fail their groups; committed or unknown keys are left alone."""
        revoked = 0
        for key in keys:
            if key in self.in_flight:
                self._revoke(key)
                revoked += 1
        return revoked

    def revoke_expired_puts(self) -> list[str]:
        """Revoke puts started more than ``put_timeout_s`` ago (their writer died)."""
        deadline = self.clock() - self.settings.put_timeout_s
        expired = []
        for key, started in self.in_flight.items():
            if started > deadline:
                break  # ordered by start time
            expired.append(key)
        for key in expired:
            if key in self.in_flight:  # an earlier revoke may have dropped its group
                self._revoke(key)
        return expired

    def drop_incomplete_groups(self) -> list[str]:
        """Drop groups still incomplete ``incomplete_group_s`` after their last member arrived.

        A group with a put in flight is left to its put timeout and looked at again later.
        """
        now = self.clock()
        dropped = []
        while self.incomplete:
            group_id, deadline = next(iter(self.incomplete.items()))
            if deadline > now:
                break
            del self.incomplete[group_id]
            group = self.group_table.groups.get(group_id)
            if group is None or group.complete:
                continue
            if group.busy:
                self.mark_incomplete(group_id)
                continue
            self.counters.abandoned_groups += 1
            self.index.drop_group(group_id)
            dropped.append(group_id)
        return dropped

    def mark_incomplete(self, group_id: str) -> None:
        """A member arrived: the group is dropped ``incomplete_group_s`` from now unless it completes."""
        self.incomplete[group_id] = self.clock() + self.settings.incomplete_group_s
        self.incomplete.move_to_end(group_id)

    def _revoke(self, key: str) -> None:
        del self.in_flight[key]
        obj = self.index.objects[key]
        group = self.group_table.groups[obj.group_id]
        del group.members[key]
        group.num_in_flight -= 1
        self.index.free(obj)
        if not group.members:
            self.group_table.remove(group)
        self.counters.revoked_puts += 1
        self._fail_group(obj.group_id, group.size)

    # ---- failed groups --------------------------------------------------

    def _fail_group(self, group_id: str, group_size: int) -> None:
        """A member failed to save: drop the group now, or once no member is in flight; refuse it for a while."""
        self.failures.hold(group_id, group_size)
        group = self.group_table.groups.get(group_id)
        if group is None:
            return
        group.failed = True
        if not group.busy:
            self._drop_failed(group)

    def _drop_failed(self, group: Group) -> None:
        self.counters.failed_groups += 1
        self.index.drop_group(group.group_id)

    def _give_back_failed(self, items: Sequence[PutRequestItem], outcomes: list[PutOutcome], failed: set[str]) -> None:
        """Undo this batch's reservations for groups that failed in it (their writer never sees the space)."""
        groups = self.group_table.groups
        for i, item in enumerate(items):
            if item.group_id in failed and outcomes[i].status is PutStatus.RESERVED:
                outcomes[i] = PutOutcome(PutStatus.GROUP_FAILED)
                obj = self.index.objects[item.key]
                group = groups[item.group_id]
                del self.in_flight[item.key]
                del group.members[item.key]
                group.num_in_flight -= 1
                self.index.free(obj)
        for group_id in failed:
            group = groups.get(group_id)
            if group is not None and not group.members:
                self.group_table.remove(group)
            elif group is not None and not group.busy:
                self._drop_failed(group)
