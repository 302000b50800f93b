"""The pool index's segment table: mounts with block reports, heartbeats with journals, expiry.

Pure: a mixin of :class:`~kvpool.core.pool_index.PoolIndex` (kept apart so
each module stays small); it works on the index's own fields.

Invariants (with the index's):
- a segment mounted again with the same endpoint, base address and size is
  the same DRAM: the index keeps what it holds and resyncs the store's records;
- a segment id back with another identity is a new segment: the old one's
  objects are dropped, and only records that pass ``plan_report`` count;
- a heartbeat acknowledges journal changes and returns the next ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvpool.core.errors import NotFound
from kvpool.core.pool_records import (
    Group,
    IndexCounters,
    MountResult,
    ObjectRecord,
    Segment,
    SegmentChange,
    StoredObject,
)
from kvpool.core.pool_recovery import allocator_with_ranges, plan_report
from kvpool.core.pool_settings import IndexSettings


class SegmentTable:
    """Segment calls of the pool index; every field named here is the index's."""

    __slots__ = ()
    settings: IndexSettings
    clock: Callable[[], float]
    segments: dict[str, Segment]
    objects: dict[str, StoredObject]
    groups: OrderedDict[str, Group]
    counters: IndexCounters
    _failed: OrderedDict[str, float]
    _incomplete: OrderedDict[str, float]

    # ---- segments -------------------------------------------------------

    def mount_segment(
        self,
        segment_id: str,
        endpoint: str,
        host: str,
        base_address: int,
        size: int,
        numa_node: int = -1,
        records: Sequence[ObjectRecord] = (),
    ) -> MountResult:
        """Add a segment with the objects its store reports (a block report).

        A segment id that comes back with another address, size or endpoint is
        a restarted store: its old objects are gone, so they are dropped first
        and only what the new segment reports counts. This exact segment
        mounted again (a retried mount) keeps what the index holds: reported
        records it does not hold are rejected, and its journal is rebuilt to
        send the store what it lacks.
        """
        existing = self.segments.get(segment_id)
        if existing is not None:
            if (existing.endpoint, existing.base_address, existing.size) == (endpoint, base_address, size):
                existing.last_heartbeat = self.clock()
                return self._resync(existing, records)
            self.unmount_segment(segment_id)
        self._prune_failed()
        plan = plan_report(records, size, self.settings.alignment, self.objects, self.groups, self._failed)
        allocator = allocator_with_ranges(size, self.settings.alignment, [(r.offset, r.size) for r in plan.accepted])
        segment = self.segments[segment_id] = Segment(
            segment_id=segment_id,
            endpoint=endpoint,
            host=host,
            numa_node=numa_node,
            base_address=base_address,
            size=size,
            allocator=allocator,
            last_heartbeat=self.clock(),
        )
        for record in plan.accepted:
            obj = StoredObject(record.key, record.group_id, segment_id, record.offset, record.size, record.checksum, True)
            self.objects[record.key] = obj
            segment.keys.add(record.key)
            group = self.groups.get(record.group_id)
            if group is None:
                group = self.groups[record.group_id] = Group(record.group_id, record.group_size)
            group.members[record.key] = obj
            group.num_committed += 1
            if not group.complete:  # its other members are in stores that have not reported yet
                self._mark_incomplete(record.group_id)
            else:
                self._incomplete.pop(record.group_id, None)
        self.counters.adopted_objects += len(plan.accepted)
        self.counters.rejected_records += len(plan.rejected_keys)
        return MountResult(True, len(plan.accepted), plan.rejected_keys, 0)

    def _resync(self, segment: Segment, records: Sequence[ObjectRecord]) -> MountResult:
        held = {r.key for r in records if self._record_of(r.key, segment.segment_id) == r}
        rejected = [r.key for r in records if r.key not in held]
        journal = segment.journal
        journal.entries.clear()
        journal.acked = journal.sequence
        for key in sorted(segment.keys - held):
            record = self._record_of(key, segment.segment_id)
            if record is not None:
                journal.add(record)
        self.counters.rejected_records += len(rejected)
        return MountResult(False, len(held), rejected, journal.acked)

    def _record_of(self, key: str, segment_id: str) -> ObjectRecord | None:
        obj = self.objects.get(key)
        if obj is None or not obj.committed or obj.segment_id != segment_id:
            return None
        size = self.groups[obj.group_id].size
        return ObjectRecord(key, obj.group_id, size, obj.offset, obj.size, obj.checksum)

    def unmount_segment(self, segment_id: str) -> int:
        """Drop a segment and every group with a member in it; returns objects dropped."""
        segment = self._segment(segment_id, field_name="segment_id")
        group_ids = {self.objects[key].group_id for key in segment.keys}
        dropped = 0
        for group_id in group_ids:
            dropped += self._drop_group(group_id)
        del self.segments[segment_id]
        return dropped

    def heartbeat(self, segment_id: str, acked_sequence: int = 0) -> tuple[list[SegmentChange], bool]:
        """Keep a segment alive; returns the changes its store has not acknowledged, and whether more wait."""
        segment = self._segment(segment_id, field_name="segment_id")
        segment.last_heartbeat = self.clock()
        journal = segment.journal
        journal.ack(acked_sequence)
        changes = journal.pending(self.settings.max_changes_per_heartbeat)
        return changes, len(journal.entries) > len(changes)

    def expire_segments(self) -> list[str]:
        """Unmount every segment whose store missed heartbeats for the TTL."""
        deadline = self.clock() - self.settings.segment_ttl_s
        dead = [s.segment_id for s in self.segments.values() if s.last_heartbeat < deadline]
        for segment_id in dead:
            self.unmount_segment(segment_id)
            self.counters.dropped_segments += 1
        return dead

    def _segment(self, segment_id: str, field_name: str) -> Segment:
        segment = self.segments.get(segment_id)
        if segment is None:
            raise NotFound(f"{field_name}: unknown segment {segment_id!r}")
        return segment

    # provided by the index
    def _drop_group(self, group_id: str) -> int:
        raise NotImplementedError

    def _prune_failed(self) -> None:
        raise NotImplementedError

    def _mark_incomplete(self, group_id: str) -> None:
        raise NotImplementedError
