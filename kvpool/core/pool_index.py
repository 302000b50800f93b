"""The pool master's object index: segments, objects, groups, leases, eviction.

Pure policy: no grpc, no I/O, an injectable clock. The servicer converts
protobuf to these calls; unit tests drive it directly.

Invariants:
- a group is visible to lookups only when every declared member is committed;
- eviction removes whole groups, least recently used first, and never a group
  that is leased or has a put in flight (``eviction="object"``, for comparisons
  only, removes one member at a time and may leave partial groups, invisible);
- eviction starts when used bytes would pass ``high_watermark × capacity`` and
  frees down to ``low_watermark × capacity``;
- every allocated byte belongs to exactly one object (committed or in flight);
- a group with a member that failed to save (no space, revoked, timed out) is
  dropped at once, or as soon as no member is in flight, and its other
  members are refused for ``failed_group_hold_s``;
- a group still incomplete ``incomplete_group_s`` after its last member
  arrived, with nothing in flight, is dropped (its other writers died, or the
  stores with its other members never re-reported after a master restart);
- each segment's journal holds the changes to its committed objects that its
  store has not acknowledged; a store reports what it holds on (re-)mount and
  only what passes ``plan_report`` becomes an object again (block reports,
  see ``pool_recovery``).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.core.errors import FailedPrecondition, InvalidArgument
from kvpool.core.placement import batch_orders, group_first
from kvpool.core.pool_eviction import Eviction, GroupFailures
from kvpool.core.pool_records import (
    Group,
    IndexCounters,
    LookupResult,
    ObjectRecord,
    PutOutcome,
    PutRequestItem,
    PutStatus,
    Segment,
    StoredObject,
)
from kvpool.core.pool_segments import SegmentTable
from kvpool.core.pool_settings import IndexSettings


@dataclass(slots=True)
class PoolIndex(Eviction, GroupFailures, SegmentTable):
    """Where every object lives, which groups are complete, what to evict."""

    settings: IndexSettings = field(default_factory=IndexSettings)
    clock: Callable[[], float] = time.monotonic
    segments: dict[str, Segment] = field(default_factory=dict)
    objects: dict[str, StoredObject] = field(default_factory=dict)
    # LRU order: first entry is the least recently used group.
    groups: OrderedDict[str, Group] = field(default_factory=OrderedDict)
    counters: IndexCounters = field(default_factory=IndexCounters)
    _in_flight: OrderedDict[str, float] = field(default_factory=OrderedDict)
    _leases: dict[int, tuple[list[Group], float]] = field(default_factory=dict)
    _lease_expiry: list[tuple[float, int]] = field(default_factory=list)
    _lease_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    # groups that failed to save, with when they may be saved again (in that order)
    _failed: OrderedDict[str, float] = field(default_factory=OrderedDict)
    # incomplete groups, with when they are dropped unless a member arrives (in that order)
    _incomplete: OrderedDict[str, float] = field(default_factory=OrderedDict)

    # ---- writes ---------------------------------------------------------

    def put_start(self, client_host: str, items: Sequence[PutRequestItem]) -> list[PutOutcome]:
        """Reserve space for each item, evicting LRU groups when needed.

        The whole batch is validated before anything changes, so a bad item
        leaves the index untouched. A member with no space fails its group:
        members of it reserved earlier in this batch are given back at once
        (``GROUP_FAILED``), later ones are refused.
        """
        self.expire_leases()
        self._validate_put(items)
        self._prune_failed()
        outcomes: list[PutOutcome] = []
        rotations = batch_orders(
            self.segments.values(), client_host, sum(item.size for item in items), self.settings.stripe_min_bytes
        )
        num_placed = 0
        capacity = self.capacity
        high = self.settings.high_watermark * capacity
        low = self.settings.low_watermark * capacity
        started = self.clock()
        objects, groups, in_flight, failed = self.objects, self.groups, self._in_flight, self._failed
        failed_here: set[str] = set()
        for item in items:
            key = item.key
            if key in objects:
                outcomes.append(PutOutcome(PutStatus.ALREADY_EXISTS))
                continue
            if item.group_id in failed:
                outcomes.append(PutOutcome(PutStatus.GROUP_FAILED))
                continue
            group = groups.get(item.group_id)
            order = rotations[num_placed % len(rotations)]
            if group is not None and group.members:
                # keep a group in one store where room allows
                order = group_first(order, {m.segment_id for m in group.members.values()}, client_host)
            placed = self._reserve(order, item.size, high, low, keep=item.group_id)
            if placed is None:
                outcomes.append(PutOutcome(PutStatus.NO_SPACE))
                failed_here.add(item.group_id)
                self._fail_group(item.group_id, item.group_size)
                continue
            num_placed += 1
            segment, offset = placed
            obj = StoredObject(key, item.group_id, segment.segment_id, offset, item.size)
            objects[key] = obj
            segment.keys.add(key)
            group = groups.get(item.group_id)  # eviction may have dropped it meanwhile
            if group is None:
                group = groups[item.group_id] = Group(item.group_id, item.group_size)
            group.members[key] = obj
            group.num_in_flight += 1
            self._mark_incomplete(item.group_id)
            in_flight[key] = started
            outcomes.append(PutOutcome(PutStatus.RESERVED, segment, offset))
        if failed_here:
            self._give_back_failed(items, outcomes, failed_here)
        self.touch(dict.fromkeys(item.group_id for item in items if item.group_id in groups))
        return outcomes

    def put_end(self, commits: Sequence[tuple[str, int]]) -> int:
        """Commit in-flight puts (key, checksum); all or none."""
        seen: set[str] = set()
        for i, (key, _checksum) in enumerate(commits):
            if key in seen:
                raise InvalidArgument(f"items[{i}].key: duplicate key {key!r} in one batch")
            seen.add(key)
            if key not in self._in_flight:
                raise FailedPrecondition(
                    f"items[{i}].key: no put in flight for {key!r} (never started, revoked or timed out)"
                )
        for key, checksum in commits:
            del self._in_flight[key]
            obj = self.objects[key]
            obj.checksum = checksum
            obj.committed = True
            group = self.groups[obj.group_id]
            group.num_in_flight -= 1
            group.num_committed += 1
            if group.complete:
                self._incomplete.pop(obj.group_id, None)
            self.segments[obj.segment_id].journal.add(
                ObjectRecord(key, obj.group_id, group.size, obj.offset, obj.size, checksum)
            )
            if group.failed and group.num_in_flight == 0:
                self._drop_failed(group)
        return len(commits)

    def put_revoke(self, keys: Iterable[str]) -> int:
        """Give back the space of in-flight puts and fail their groups; committed or unknown keys are left alone."""
        revoked = 0
        for key in keys:
            if key in self._in_flight:
                self._revoke(key)
                revoked += 1
        return revoked

    def revoke_expired_puts(self) -> list[str]:
        """Revoke puts started more than ``put_timeout_s`` ago (their writer died)."""
        deadline = self.clock() - self.settings.put_timeout_s
        expired = []
        for key, started in self._in_flight.items():
            if started > deadline:
                break  # ordered by start time
            expired.append(key)
        for key in expired:
            if key in self._in_flight:  # an earlier revoke may have dropped its group
                self._revoke(key)
        return expired

    def drop_incomplete_groups(self) -> list[str]:
        """Drop groups still incomplete ``incomplete_group_s`` after their last member arrived.

        A group with a put in flight is left to its put timeout and looked at again later.
        """
        now = self.clock()
        dropped = []
        while self._incomplete:
            group_id, deadline = next(iter(self._incomplete.items()))
            if deadline > now:
                break
            del self._incomplete[group_id]
            group = self.groups.get(group_id)
            if group is None or group.complete:
                continue
            if group.busy:
                self._mark_incomplete(group_id)
                continue
            self.counters.abandoned_groups += 1
            self._drop_group(group_id)
            dropped.append(group_id)
        return dropped

    def _mark_incomplete(self, group_id: str) -> None:
        self._incomplete[group_id] = self.clock() + self.settings.incomplete_group_s
        self._incomplete.move_to_end(group_id)

    # ---- reads ----------------------------------------------------------

    def lookup(self, group_ids: Sequence[str], lease_s: float | None = None) -> LookupResult:
        """Count leading complete groups; lease and touch them."""
        self.expire_leases()
        found: list[Group] = []
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is None or not group.complete:
                break
            found.append(group)
        if not found:
            return LookupResult([], 0, 0.0)
        duration = self.settings.lease_s if lease_s is None else lease_s
        lease_id = next(self._lease_ids)
        expires = self.clock() + duration
        self._leases[lease_id] = (found, expires)
        heapq.heappush(self._lease_expiry, (expires, lease_id))
        for group in found:
            group.num_leases += 1
        self.touch([g.group_id for g in found])
        return LookupResult(found, lease_id, duration)

    def release_lease(self, lease_id: int) -> bool:
        """End a lease early (the reader is done); a read counts as a use."""
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            return False
        self._unlease(entry[0])
        self.touch(g.group_id for g in entry[0] if self.groups.get(g.group_id) is g)
        return True

    def expire_leases(self) -> int:
        now = self.clock()
        expired = 0
        while self._lease_expiry and self._lease_expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_expiry)
            entry = self._leases.pop(lease_id, None)
            if entry is not None:
                self._unlease(entry[0])
                expired += 1
        return expired

    def exists(self, keys: Iterable[str]) -> list[bool]:
        return [(obj := self.objects.get(key)) is not None and obj.committed for key in keys]

    def remove(self, group_ids: Iterable[str]) -> tuple[int, list[str]]:
        """Remove whole groups; busy ones (leased, put in flight) are left and named."""
        self.expire_leases()
        removed, busy = 0, []
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is None:
                continue
            if group.busy:
                busy.append(group_id)
                continue
            self._drop_group(group_id)
            removed += 1
        return removed, busy

    def touch(self, group_ids: Iterable[str]) -> None:
        """Mark groups used, the first named becoming the most recently used.

        Group ids come in prefix order; a chunk is useless without the chunks
        before it, so within one request the tail is made older than the head
        and is evicted first.
        """
        for group_id in reversed(list(group_ids)):
            if group_id in self.groups:
                self.groups.move_to_end(group_id)

    # ---- accounting -----------------------------------------------------

    @property
    def capacity(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def used_bytes(self) -> int:
        return sum(s.allocator.used_bytes for s in self.segments.values())

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # ---- internals ------------------------------------------------------

    def _validate_put(self, items: Sequence[PutRequestItem]) -> None:
        largest = max((s.size for s in self.segments.values()), default=0)
        declared: dict[str, int] = {}
        new_members: dict[str, int] = {}
        seen: set[str] = set()
        for i, item in enumerate(items):
            if item.key in seen:
                raise InvalidArgument(f"items[{i}].key: duplicate key {item.key!r} in one batch")
            seen.add(item.key)
            if self.segments and item.size > largest:
                raise InvalidArgument(
                    f"items[{i}].size: {item.size} bytes is larger than any segment (largest {largest})"
                )
            group = self.groups.get(item.group_id)
            expected = group.size if group is not None else declared.get(item.group_id)
            if expected is not None and expected != item.group_size:
                raise InvalidArgument(
                    f"items[{i}].group_size: {item.group_size} disagrees with {expected} "
                    f"declared earlier for group {item.group_id!r}"
                )
            declared[item.group_id] = item.group_size
            if item.key not in self.objects:
                count = new_members.get(item.group_id, 0) + 1
                new_members[item.group_id] = count
                have = len(group.members) if group is not None else 0
                if have + count > item.group_size:
                    raise InvalidArgument(
                        f"items[{i}].key: group {item.group_id!r} already has {have + count - 1} "
                        f"of {item.group_size} members"
                    )

    def _drop_group(self, group_id: str) -> int:
        group = self.groups.pop(group_id)
        self._incomplete.pop(group_id, None)
        for key, obj in group.members.items():
            self._in_flight.pop(key, None)
            self._free(obj)
        return len(group.members)

    def _revoke(self, key: str) -> None:
        del self._in_flight[key]
        obj = self.objects[key]
        group = self.groups[obj.group_id]
        del group.members[key]
        group.num_in_flight -= 1
        self._free(obj)
        if not group.members:
            del self.groups[obj.group_id]
        self.counters.revoked_puts += 1
        self._fail_group(obj.group_id, group.size)

    def _free(self, obj: StoredObject) -> None:
        del self.objects[obj.key]
        segment = self.segments.get(obj.segment_id)
        if segment is not None:
            segment.keys.discard(obj.key)
            segment.allocator.free(obj.offset)
            if obj.committed:  # the store holds its record: it must forget it
                segment.journal.remove(obj.key)

    @staticmethod
    def _unlease(groups: list[Group]) -> None:
        # the lease holds the group objects themselves: a group dropped and
        # re-created under the same id is a new object with its own count
        for group in groups:
            group.num_leases -= 1
