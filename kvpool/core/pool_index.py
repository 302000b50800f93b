"""The pool master's object index: segments, objects, groups, leases, eviction.

Pure policy: no grpc, no I/O, an injectable clock. The servicer converts
protobuf to these calls; unit tests drive it directly.

Invariants:
- a group is visible to lookups only when every declared member is committed;
- eviction removes whole groups, least recently used first, and never a group
  that is leased or has a put in flight;
- eviction starts when used bytes would pass ``high_watermark × capacity`` and
  frees down to ``low_watermark × capacity``;
- every allocated byte belongs to exactly one object (committed or in flight).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.core.allocator import SegmentAllocator
from kvpool.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kvpool.core.placement import batch_orders
from kvpool.core.pool_records import (
    Group,
    LookupResult,
    PutOutcome,
    PutRequestItem,
    PutStatus,
    Segment,
    StoredObject,
)
from kvpool.core.pool_settings import IndexSettings


@dataclass(slots=True)
class IndexCounters:
    evicted_groups: int = 0
    evicted_bytes: int = 0
    revoked_puts: int = 0
    dropped_segments: int = 0


@dataclass(slots=True)
class PoolIndex:
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

    # ---- segments -------------------------------------------------------

    def mount_segment(
        self, segment_id: str, endpoint: str, host: str, base_address: int, size: int, numa_node: int = -1
    ) -> bool:
        """Add a segment; returns False when this exact segment is already mounted.

        A segment id that comes back with another address, size or endpoint is
        a restarted store: its old objects are gone, so they are dropped first.
        """
        existing = self.segments.get(segment_id)
        if existing is not None:
            if (existing.endpoint, existing.base_address, existing.size) == (endpoint, base_address, size):
                existing.last_heartbeat = self.clock()
                return False
            self.unmount_segment(segment_id)
        self.segments[segment_id] = Segment(
            segment_id=segment_id,
            endpoint=endpoint,
            host=host,
            numa_node=numa_node,
            base_address=base_address,
            size=size,
            allocator=SegmentAllocator(size, alignment=self.settings.alignment),
            last_heartbeat=self.clock(),
        )
        return True

    def unmount_segment(self, segment_id: str) -> int:
        """Drop a segment and every group with a member in it; returns objects dropped."""
        segment = self._segment(segment_id, field_name="segment_id")
        group_ids = {self.objects[key].group_id for key in segment.keys}
        dropped = 0
        for group_id in group_ids:
            dropped += self._drop_group(group_id)
        del self.segments[segment_id]
        return dropped

    def heartbeat(self, segment_id: str) -> None:
        self._segment(segment_id, field_name="segment_id").last_heartbeat = self.clock()

    def expire_segments(self) -> list[str]:
        """Unmount every segment whose store missed heartbeats for the TTL."""
        deadline = self.clock() - self.settings.segment_ttl_s
        dead = [s.segment_id for s in self.segments.values() if s.last_heartbeat < deadline]
        for segment_id in dead:
            self.unmount_segment(segment_id)
            self.counters.dropped_segments += 1
        return dead

    # ---- writes ---------------------------------------------------------

    def put_start(self, client_host: str, items: Sequence[PutRequestItem]) -> list[PutOutcome]:
        """Reserve space for each item, evicting LRU groups when needed.

        The whole batch is validated before anything changes, so a bad item
        leaves the index untouched.
        """
        self.expire_leases()
        self._validate_put(items)
        outcomes: list[PutOutcome] = []
        rotations = batch_orders(
            self.segments.values(), client_host, sum(item.size for item in items), self.settings.stripe_min_bytes
        )
        num_placed = 0
        capacity = self.capacity
        high = self.settings.high_watermark * capacity
        low = self.settings.low_watermark * capacity
        started = self.clock()
        objects, groups, in_flight = self.objects, self.groups, self._in_flight
        for item in items:
            key = item.key
            if key in objects:
                outcomes.append(PutOutcome(PutStatus.ALREADY_EXISTS))
                continue
            placed = self._reserve(rotations[num_placed % len(rotations)], item.size, high, low)
            if placed is None:
                outcomes.append(PutOutcome(PutStatus.NO_SPACE))
                continue
            num_placed += 1
            segment, offset = placed
            obj = StoredObject(key, item.group_id, segment.segment_id, offset, item.size)
            objects[key] = obj
            segment.keys.add(key)
            group = groups.get(item.group_id)
            if group is None:
                group = groups[item.group_id] = Group(item.group_id, item.group_size)
            group.members[key] = obj
            group.num_in_flight += 1
            in_flight[key] = started
            outcomes.append(PutOutcome(PutStatus.RESERVED, segment, offset))
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
        return len(commits)

    def put_revoke(self, keys: Iterable[str]) -> int:
        """Give back the space of in-flight puts; committed or unknown keys are left alone."""
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
            self._revoke(key)
        return expired

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

    def _segment(self, segment_id: str, field_name: str) -> Segment:
        segment = self.segments.get(segment_id)
        if segment is None:
            raise NotFound(f"{field_name}: unknown segment {segment_id!r}")
        return segment

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

    def _reserve(self, order: list[Segment], size: int, high: float, low: float) -> tuple[Segment, int] | None:
        """Place ``size`` bytes: evict to ``low`` used bytes past ``high``, then allocate."""
        if not order:
            return None
        if self.used_bytes + size > high:
            self._evict_until(lambda: self.used_bytes + size <= low)
        while True:
            placed = self._allocate(order, size)
            if placed is not None:
                return placed
            if not self._evict_one():
                return None

    @staticmethod
    def _allocate(order: list[Segment], size: int) -> tuple[Segment, int] | None:
        for segment in order:
            if segment.allocator.largest_free >= size:
                offset = segment.allocator.allocate(size)
                if offset is not None:
                    return segment, offset
        return None

    def _evict_until(self, done: Callable[[], bool]) -> None:
        while not done() and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        for group_id, group in self.groups.items():
            if not group.busy:
                self.counters.evicted_groups += 1
                self.counters.evicted_bytes += sum(m.size for m in group.members.values())
                self._drop_group(group_id)
                return True
        return False

    def _drop_group(self, group_id: str) -> int:
        group = self.groups.pop(group_id)
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

    def _free(self, obj: StoredObject) -> None:
        del self.objects[obj.key]
        segment = self.segments.get(obj.segment_id)
        if segment is not None:
            segment.keys.discard(obj.key)
            segment.allocator.free(obj.offset)

    @staticmethod
    def _unlease(groups: list[Group]) -> None:
        # the lease holds the group objects themselves: a group dropped and
        # re-created under the same id is a new object with its own count
        for group in groups:
            group.num_leases -= 1
