"""The store's half of block reports: records applied in sequence, overlaps replaced, stale bytes not reported.

No process needed: the store's ``SegmentRecords`` over a real registered-size
buffer, exact keys and sequences.
"""

from __future__ import annotations

import xxhash
from sortedcontainers import SortedDict

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


class CountingSortedDict(SortedDict):
    """A ``SortedDict`` that counts the offsets its ranges hand out (what an add looks at). ``SortedDict``
    binds ``irange`` per instance, so the count wraps that."""

    looked_at = 0

    def __init__(self) -> None:
        super().__init__()
        plain = self.irange

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            for key in plain(*args, **kwargs):
                CountingSortedDict.looked_at += 1
                yield key
        self.irange = counted


def test_an_add_looks_at_the_records_it_replaces_and_one_more_not_the_whole_segment() -> None:
    """A store holds hundreds of thousands of records; every commit the master sends is an add. An add that
    walked every record below it (as one did) stalled the store's heartbeats past the master's TTL at 10^6
    objects (``kvpool bench master``), and the master dropped the segment with all its groups."""
    records = SegmentRecords(by_offset=CountingSortedDict())
    records.apply([added(i + 1, record(f"k{i}", 64 * i)) for i in range(10_000)])
    CountingSortedDict.looked_at = 0
    records.add(record("past", 64 * 10_000))
    assert CountingSortedDict.looked_at == 1  # the one just below, which ends where it starts
    CountingSortedDict.looked_at = 0
    records.add(record("over", 64 * 5_000 + 32, size=64))  # over the second half of k5000 and the first of k5001
    assert CountingSortedDict.looked_at == 3  # k5001, k5000 (both replaced) and k4999, which ends the run
    assert "k5000" not in records.by_key and "k5001" not in records.by_key and "k4999" in records.by_key
    assert len(records) == 10_000
