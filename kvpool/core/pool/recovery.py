"""Block reports: which objects a store reports on (re-)mount become objects again.

Pure: no I/O. A store keeps the records of the objects committed in its own
segment (the master sends them, and their removals, with each heartbeat
response, see ``SegmentJournal``) and reports them when it mounts, so after a
master restart the metadata comes back from the same place as the bytes.

Rules, checked for every reported record (sorted by offset) before anything
changes:
- its range is aligned and inside the segment, and overlaps no earlier
  accepted record of the same report;
- its key is unknown to the index (a put after the restart, or another
  store's report, got there first: first writer wins);
- its group agrees on ``group_size``, still has room for a member, and did
  not fail to save moments ago.
A rejected record is named back to the store, which forgets it. Nothing
reported is ever in flight: a store learns of an object only once it is
committed, so a put in flight at a crash is never reported.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass

from kvpool.core.pool.allocator import SegmentAllocator, new_allocator
from kvpool.core.pool.records import Group, ObjectRecord


@dataclass(slots=True, frozen=True)
class ReportPlan:
    """The records to adopt (in offset order) and the keys to reject."""

    accepted: list[ObjectRecord]
    rejected_keys: list[str]


def plan_report(
    records: Sequence[ObjectRecord],
    segment_size: int,
    alignment: int,
    holds: Callable[[str], bool],
    groups: Mapping[str, Group],
    failed_groups: Container[str],
) -> ReportPlan:
    """Split a report into records that may become objects again and keys that may not."""
    accepted: list[ObjectRecord] = []
    rejected: list[str] = []
    new_members: dict[str, int] = {}
    sizes: dict[str, int] = {}
    seen: set[str] = set()
    end = 0
    for record in sorted(records, key=lambda r: (r.offset, r.key)):
        rounded = -(-record.size // alignment) * alignment
        group = groups.get(record.group_id)
        size = group.size if group is not None else sizes.get(record.group_id, record.group_size)
        have = (len(group.keys) if group is not None else 0) + new_members.get(record.group_id, 0)
        ok = (
            record.size > 0
            and record.offset % alignment == 0
            and record.offset >= end
            and record.offset + rounded <= segment_size
            and not holds(record.key)
            and record.key not in seen
            and record.group_id not in failed_groups
            and size == record.group_size
            and have < size
        )
        if not ok:
            rejected.append(record.key)
            continue
        accepted.append(record)
        seen.add(record.key)
        sizes[record.group_id] = record.group_size
        new_members[record.group_id] = new_members.get(record.group_id, 0) + 1
        end = record.offset + rounded
    return ReportPlan(accepted, rejected)


def allocator_with_ranges(capacity: int, alignment: int, ranges: Sequence[tuple[int, int]]) -> SegmentAllocator:
    """A fresh allocator whose live allocations are exactly ``ranges`` ((offset, size), sorted, disjoint, aligned).

    Built with the allocator's public calls alone: while one free extent (the
    tail) is left, ``allocate`` carves from its start, so a filler up to each
    offset and then the range itself land exactly where asked; the fillers are
    freed at the end. O(n log n).
    """
    allocator = new_allocator(capacity, alignment)
    fillers: list[int] = []
    cursor = 0
    for offset, size in ranges:
        if offset > cursor:
            fillers.append(_allocate_at(allocator, cursor, offset - cursor))
        _allocate_at(allocator, offset, size)
        cursor = offset + allocator.rounded_size(size)
    for filler in fillers:
        allocator.free(filler)
    return allocator


def _allocate_at(allocator: SegmentAllocator, offset: int, size: int) -> int:
    got = allocator.allocate(size)
    if got != offset:  # only a caller breaking the sorted/disjoint/aligned contract gets here
        raise ValueError(f"range at {offset} (+{size}) is not free in order (allocator gave {got})")
    return offset
