"""The pool index's segment table: space, mounts with block reports, heartbeats with journals, expiry.

Pure. The index holds one ``SegmentTable``; the table sees the index's
objects and groups only through ``SegmentHost``.

Invariants:
- ``used_bytes`` and ``capacity`` always equal the sums over the mounted
  segments' allocators and sizes (kept as running totals: a put reads them
  on every placement);
- a segment mounted again with the same endpoint, base address and size is
  the same DRAM: the index keeps what it holds and resyncs the store's records;
- a segment id back with another identity is a new segment: the old one's
  objects are dropped, and only records that pass ``plan_report`` count;
- a heartbeat acknowledges journal changes and returns the next ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from kvpool.core.errors import NotFound
from kvpool.core.pool.eviction import GroupFailures
from kvpool.core.pool.paths import SharedMemoryRef
from kvpool.core.pool.records import (
    Group,
    IndexCounters,
    MountResult,
    ObjectRecord,
    Segment,
    ChangeRow,
    JournalChanges,
    SegmentJournal,
)
from kvpool.core.pool.recovery import allocator_with_ranges, plan_report
from kvpool.core.pool.settings import IndexSettings


class SegmentHost(Protocol):
    """What the segment table needs of the index."""

    def owner(self, key: str) -> tuple[Group, int] | None:
        """The group holding object ``key`` and its place there, or None."""
        ...

    def holds(self, key: str) -> bool:
        ...

    @property
    def lru_groups(self) -> Mapping[str, Group]: ...

    def drop_group(self, group_id: str) -> int:
        """Free every member of a group and forget it; returns members dropped."""
        ...

    def adopt(self, record: ObjectRecord, segment: Segment) -> None:
        """A committed object a store reported in ``segment`` joins its group."""
        ...


@dataclass(slots=True)
class SegmentTable:
    """Every mounted segment, with the space used in them all."""

    index: SegmentHost
    settings: IndexSettings
    clock: Callable[[], float]
    counters: IndexCounters
    # groups refused for now: a store's report may not bring one back
    failures: GroupFailures
    segments: dict[str, Segment] = field(default_factory=dict)
    used_bytes: int = 0
    capacity: int = 0
    numbered: int = 0  # segments ever mounted anew (each gets the next number)

    # ---- space ----------------------------------------------------------

    def allocate(self, order: list[Segment], size: int) -> tuple[Segment, int] | None:
        """``size`` bytes in the first segment of ``order`` with room."""
        for segment in order:
            allocator = segment.allocator
            if allocator.largest_free >= size:
                before = allocator.used_bytes
                offset = allocator.allocate(size)
                if offset is not None:
                    self.used_bytes += allocator.used_bytes - before
                    return segment, offset
        return None

    def allocate_run(self, segment: Segment, sizes: list[int]) -> list[int] | None:
        """Room for one piece per size in ``segment``, back to back, as one allocation
        (``SegmentAllocator.allocate_run``): the pieces' offsets, or None with nothing changed when no one hole
        there holds them all."""
        allocator = segment.allocator
        before = allocator.used_bytes
        offsets = allocator.allocate_run(sizes)
        if offsets is not None:
            self.used_bytes += allocator.used_bytes - before
        return offsets

    def release_member(self, group: Group, position: int) -> None:
        """Give back the space of a group's member (before it leaves the group); a committed one's store is told to
        forget it."""
        segment = self.segments.get(group.segment_ids[position])
        if segment is None:
            return
        segment_id = segment.segment_id
        segment.num_objects -= 1
        if group.segment_ids.count(segment_id) == 1:  # its group's last member here
            segment.groups.pop(group.group_id, None)
        allocator = segment.allocator
        if group.run:  # its members become allocations of their own first
            allocator.split_run(group.offsets[0], list(group.sizes))
            group.run = False
        before = allocator.used_bytes
        allocator.free(group.offsets[position])
        self.used_bytes -= before - allocator.used_bytes
        if group.committed(position):  # the store holds its record: it must forget it
            segment.journal.remove(group.key(position))

    def release_group(self, group: Group) -> None:
        """Give back every member's space (the group is being forgotten): a segment's members go back as one run,
        merged once where they lie back to back (``SegmentAllocator.free_run``); the committed ones' store is told
        to forget them, in one journal entry."""
        segment_ids = group.segment_ids
        if not segment_ids:
            return
        first = segment_ids[0]
        if segment_ids.count(first) == len(segment_ids):  # nearly always: the whole group in one segment
            self._release_in(group, first, group.offsets[:1] if group.run else group.offsets, group.keys,
                             group.pending, group.key_prefix)
            return
        for segment_id, positions in group.by_segment(range(len(segment_ids))).items():
            self._release_in(group, segment_id, tuple(group.offsets[i] for i in positions),
                             tuple(group.keys[i] for i in positions),
                             sum(1 << n for n, i in enumerate(positions) if not group.committed(i)), group.key_prefix)

    def release_idle(self, groups: list[Group]) -> None:
        """``release_group`` of each of ``groups``: each wholly in one segment, keeping its keys in part, none of
        its members in flight (eviction's victims, ``PoolIndex.evict``); each segment's removals go to its
        journal at once, in the groups' order."""
        segments = self.segments
        freed = 0
        removed: dict[str, list[Group]] = {}
        for group in groups:
            segment_id = group.segment_ids[0]
            segment = segments[segment_id]
            group_id = group.group_id
            segment.groups.pop(group_id, None)
            segment.num_objects -= len(group.keys)
            allocator = segment.allocator
            before = allocator.used_bytes
            offsets = group.offsets
            if group.run or len(offsets) == 1:
                allocator.free(offsets[0])
            else:
                allocator.free_run(list(offsets))
            freed += before - allocator.used_bytes
            mine = removed.get(segment_id)
            if mine is None:
                removed[segment_id] = [group]
            else:
                mine.append(group)
        self.used_bytes -= freed
        for segment_id, mine in removed.items():
            segments[segment_id].journal.remove_groups(list(map(_KEYS, mine)), [g.group_id + "/" for g in mine])

    def _release_in(self, group: Group, segment_id: str, offsets: tuple[int, ...], keys: tuple[str, ...],
                    pending: int, prefix: str) -> None:
        segment = self.segments.get(segment_id)
        if segment is None:
            return
        segment.groups.pop(group.group_id, None)
        segment.num_objects -= len(keys)
        allocator = segment.allocator
        before = allocator.used_bytes
        if len(offsets) == 1:
            allocator.free(offsets[0])
        else:
            allocator.free_run(list(offsets))
        self.used_bytes -= before - allocator.used_bytes
        if pending:
            keys = tuple(key for n, key in enumerate(keys) if not pending >> n & 1)
        segment.journal.remove_keys(keys, prefix)

    # ---- mounts ---------------------------------------------------------

    def mount(
        self,
        segment_id: str,
        endpoint: str,
        host: str,
        base_address: int,
        size: int,
        numa_node: int = -1,
        records: Sequence[ObjectRecord] = (),
        shared: SharedMemoryRef | None = None,
    ) -> MountResult:
        """Add a segment with the objects its store reports (a block report).

        A segment id that comes back with another address, size, endpoint or
        shared memory (a new token: new memory) is a restarted store: its old objects are gone, so they are dropped first
        and only what the new segment reports counts. This exact segment
        mounted again (a retried mount) keeps what the index holds: reported
        records it does not hold are rejected, and its journal is rebuilt to
        send the store what it lacks.
        """
        existing = self.segments.get(segment_id)
        if existing is not None:
            if (existing.endpoint, existing.base_address, existing.size, existing.shared) == (
                    endpoint, base_address, size, shared):
                existing.last_heartbeat = self.clock()
                return self._resync(existing, records)
            self.unmount(segment_id)
        self.failures.prune()
        alignment = self.settings.alignment
        plan = plan_report(records, size, alignment, self.index.holds, self.index.lru_groups, self.failures)
        allocator = allocator_with_ranges(size, alignment, [(r.offset, r.size) for r in plan.accepted])
        segment = self.segments[segment_id] = Segment(
            segment_id=segment_id,
            endpoint=endpoint,
            host=host,
            numa_node=numa_node,
            base_address=base_address,
            size=size,
            allocator=allocator,
            last_heartbeat=self.clock(),
            shared=shared,
            number=self.numbered + 1,
        )
        self.numbered += 1
        self.capacity += size
        self.used_bytes += allocator.used_bytes
        for record in plan.accepted:
            self.index.adopt(record, segment)
        self.counters.adopted_objects += len(plan.accepted)
        self.counters.rejected_records += len(plan.rejected_keys)
        return MountResult(True, len(plan.accepted), plan.rejected_keys, 0)

    def _resync(self, segment: Segment, records: Sequence[ObjectRecord]) -> MountResult:
        segment_id = segment.segment_id
        held = {r.key for r in records if self._record_of(r.key, segment_id) == r}
        rejected = [r.key for r in records if r.key not in held]
        journal = segment.journal
        journal.clear()
        mine = [group.key(i) for group in segment.groups.values() for i in range(len(group.keys))
                if group.segment_ids[i] == segment_id and group.committed(i)]
        for key in sorted(set(mine) - held):
            record = self._record_of(key, segment_id)
            if record is not None:
                journal.add(record)
        self.counters.rejected_records += len(rejected)
        return MountResult(False, len(held), rejected, journal.acked)

    def _record_of(self, key: str, segment_id: str) -> ObjectRecord | None:
        found = self.index.owner(key)
        if found is None:
            return None
        group, i = found
        if not group.committed(i) or group.segment_ids[i] != segment_id:
            return None
        return ObjectRecord(key, group.group_id, group.size, group.offsets[i], group.sizes[i], group.checksums[i],
                            group.tenant)

    def unmount(self, segment_id: str) -> int:
        """Drop a segment and every group with a member in it; returns objects dropped."""
        segment = self.get(segment_id, field_name="segment_id")
        dropped = 0
        for group_id in list(segment.groups):
            dropped += self.index.drop_group(group_id)
        del self.segments[segment_id]
        self.capacity -= segment.size
        self.used_bytes -= segment.allocator.used_bytes
        return dropped

    # ---- liveness -------------------------------------------------------

    def heartbeat(self, segment_id: str, acked_sequence: int = 0) -> tuple[list[ChangeRow], bool]:
        """Keep a segment alive; returns the changes its store has not acknowledged (as rows), and whether more
        wait."""
        journal = self._beat(segment_id, acked_sequence)
        rows = journal.pending_rows(self.settings.max_changes_per_heartbeat)
        return rows, journal.unacked > len(rows)

    def heartbeat_changes(self, segment_id: str, acked_sequence: int = 0) -> tuple[JournalChanges, bool]:
        """``heartbeat``, the changes in a journal's columns (``SegmentJournal.pending_columns``)."""
        journal = self._beat(segment_id, acked_sequence)
        changes = journal.pending_columns(self.settings.max_changes_per_heartbeat)
        return changes, journal.unacked > len(changes)

    def _beat(self, segment_id: str, acked_sequence: int) -> SegmentJournal:
        segment = self.get(segment_id, field_name="segment_id")
        segment.last_heartbeat = self.clock()
        journal = segment.journal
        journal.ack(acked_sequence)
        return journal

    def expire(self) -> list[str]:
        """Unmount every segment whose store missed heartbeats for the TTL."""
        deadline = self.clock() - self.settings.segment_ttl_s
        dead = [s.segment_id for s in self.segments.values() if s.last_heartbeat < deadline]
        for segment_id in dead:
            self.unmount(segment_id)
            self.counters.dropped_segments += 1
        return dead

    def get(self, segment_id: str, field_name: str) -> Segment:
        segment = self.segments.get(segment_id)
        if segment is None:
            raise NotFound(f"{field_name}: unknown segment {segment_id!r}")
        return segment


_KEYS = attrgetter("keys")
