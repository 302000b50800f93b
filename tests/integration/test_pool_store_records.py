"""The store's half of block reports: records applied in sequence, overlaps replaced, stale bytes not reported.

No process needed: the store's ``SegmentRecords`` over a real registered-size
buffer, exact keys and sequences.
"""

from __future__ import annotations

import xxhash

from kvpool.core.pool.records import ObjectRecord, SegmentChange
from kvpool.transfer import HostBuffer
from kvpool.services.store.records import SegmentRecords


def record(key: str, offset: int, size: int = 64, checksum: int = 0) -> ObjectRecord:
    return ObjectRecord(key=key, group_id=key.split("/")[0], group_size=1, offset=offset, size=size,
                        checksum=checksum)


def added(sequence: int, r: ObjectRecord) -> SegmentChange:
    return SegmentChange(sequence=sequence, added=r)


def removed(sequence: int, key: str) -> SegmentChange:
    return SegmentChange(sequence=sequence, removed_key=key)


def test_changes_apply_once_in_order() -> None:
    records = SegmentRecords()
    changes = [added(1, record("a/0", 0)), added(2, record("b/0", 64)), removed(3, "a/0"), added(4, record("a/0", 128))]
    assert records.apply(changes) == 4
    assert records.apply(changes) == 0  # a repeated answer (the ack was lost) changes nothing
    assert records.acked_sequence == 4
    assert sorted((r.key, r.offset) for r in records.by_key.values()) == [("a/0", 128), ("b/0", 64)]


def test_a_record_over_older_ones_replaces_them() -> None:
    records = SegmentRecords()
    records.apply([added(1, record("a/0", 0)), added(2, record("b/0", 64)), added(3, record("c/0", 192))])
    # its removals never arrived, but a new object covers a/0's tail and all of b/0
    records.apply([added(4, record("n/0", 32, size=128))])
    assert sorted(records.by_key) == ["c/0", "n/0"]
    assert list(records.by_offset.items()) == [(32, "n/0"), (192, "c/0")]


def test_only_records_whose_bytes_still_match_are_reported() -> None:
    buffer = HostBuffer(4096)
    buffer.view(0, 128)[:] = bytes(range(128))
    good = record("g/0", 0, checksum=xxhash.xxh3_64_intdigest(bytes(range(64))))
    stale = record("s/0", 64, checksum=xxhash.xxh3_64_intdigest(b"\x01" * 64))  # written over since
    outside = record("o/0", 4064, size=64, checksum=0)  # past the end of the segment
    records = SegmentRecords()
    records.reset([good, stale, outside], 7)
    with buffer.view() as view:
        report, bad = records.verified(view)
    assert [r.key for r in report] == ["g/0"] and bad == ["s/0", "o/0"]
    assert records.acked_sequence == 7
