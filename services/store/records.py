"""The records of the objects committed in this store's segment: the store's half of block reports.

The master sends every change to the segment's committed objects (added when
committed, removed when evicted, removed or dropped) with its heartbeat
responses, in sequence order; the store applies them and acknowledges the
last sequence in its next heartbeat. When it (re-)mounts, it reports what it
holds, so a restarted master gets the pool's metadata back from the same
place as the bytes. Held in memory only: a restarted store has a new
segment, whose bytes are gone anyway.

Invariants:
- records never overlap: a record added over the range of older ones
  replaces them (their bytes were overwritten, so a removal was missed);
- a record is reported only if its bytes still hash to its checksum
  (``verified``), so a record whose removal never arrived before the master
  died cannot bring back bytes that were written over.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import xxhash
from sortedcontainers import SortedDict

from kvpool.core.pool.records import ObjectRecord, SegmentChange


@dataclass(slots=True)
class SegmentRecords:
    """Key → record of the objects committed in one segment, plus the sequence applied."""

    acked_sequence: int = 0
    by_key: dict[str, ObjectRecord] = field(default_factory=dict)
    by_offset: SortedDict = field(default_factory=SortedDict)  # offset -> key

    def __len__(self) -> int:
        return len(self.by_key)

    def apply(self, changes: Iterable[SegmentChange]) -> int:
        """Apply changes in order (any already applied are skipped); returns how many applied."""
        applied = 0
        for change in changes:
            if change.sequence <= self.acked_sequence:
                continue
            if change.removed_key:
                self.remove(change.removed_key)
            else:
                self.add(change.added)
            self.acked_sequence = change.sequence
            applied += 1
        return applied

    def add(self, record: ObjectRecord) -> None:
        self.remove(record.key)
        end = record.offset + record.size
        # records ending after this one starts, starting before it ends: walking down from the last one that
        # starts before it ends, the first that ends before it starts ends the run (records never overlap),
        # so an add looks at the records it replaces and one more, never at the whole segment's
        overlapping = []
        for offset in self.by_offset.irange(maximum=end - 1, reverse=True):
            other = self.by_key[self.by_offset[offset]]
            if other.offset + other.size <= record.offset:
                break
            overlapping.append(other.key)
        for key in overlapping:
            self.remove(key)
        self.by_key[record.key] = record
        self.by_offset[record.offset] = record.key

    def remove(self, key: str) -> None:
        record = self.by_key.pop(key, None)
        if record is not None and self.by_offset.get(record.offset) == key:
            del self.by_offset[record.offset]

    def reset(self, keep: Iterable[ObjectRecord], sequence: int) -> None:
        """After a mount: hold exactly ``keep``, standing at the master's ``sequence``."""
        self.by_key.clear()
        self.by_offset.clear()
        for record in keep:
            self.add(record)
        self.acked_sequence = sequence

    def verified(self, segment: memoryview) -> tuple[list[ObjectRecord], list[str]]:
        """Records whose bytes still match their checksum, and the keys of those that do not.

        Reads the bytes the records cover once (xxh3, several GB/s): cheap next
        to the re-computation a wrong report would cost, run off the event loop.
        """
        good, bad = [], []
        for record in self.by_key.values():
            end = record.offset + record.size
            if end <= len(segment) and xxhash.xxh3_64_intdigest(segment[record.offset:end]) == record.checksum:
                good.append(record)
            else:
                bad.append(record.key)
        return good, bad
