"""A heartbeat's packed and grouped changes (``HeartbeatRequest.packed``, ``.grouped``), exactly: the same changes
as one message each, wherever an acknowledgement or the per-beat limit cuts an entry; an older master's answer
still read; arrays of disagreeing lengths refused, naming the field."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import PutRequestItem, change_of_row
from kvpool.rpc import pool_pb2
from kvpool.services.master.metrics import MasterMetrics
from kvpool.services.master.servicer import PoolMasterServicer
from kvpool.services.store.master_client import changes_from_grouped, changes_from_packed, changes_of
from tests.core.fixtures import KB, make_index


def put(index: PoolIndex, group: str, tenant: str = "") -> None:
    items = [PutRequestItem(f"{group}/{stage}", group, 2, KB + stage, tenant or "default") for stage in range(2)]
    index.put_start("host0", items)
    index.put_end([(item.key, 0xFFFF_FFFF_FFFF_FF00 + i) for i, item in enumerate(items)])


def beat(service: PoolMasterServicer, packed: bool, grouped: bool = False,
         acked: int = 0) -> pool_pb2.HeartbeatResponse:
    request = pool_pb2.HeartbeatRequest(segment_id="seg0", packed=packed, grouped=grouped, acked_sequence=acked)
    return asyncio.run(service.Heartbeat(request, None))


def test_packed_changes_are_exactly_the_changes_one_message_each_gives() -> None:
    index, _ = make_index()
    service = PoolMasterServicer(index, "test", 1.0, MasterMetrics(CollectorRegistry()))
    put(index, "a")
    put(index, "b", tenant="alice")
    index.remove(["a"])  # two removals after four additions
    expected, _ = index.heartbeat("seg0", 0)
    legacy, packed = beat(service, packed=False), beat(service, packed=True)
    assert len(packed.changes) == 0 and len(packed.packed_changes.sequence) == 6 == len(legacy.changes)
    assert changes_of(packed) == changes_of(legacy) == tuple(expected)
    assert [c.removed_key for c in expected[4:]] == ["a/0", "a/1"] and expected[2].added.tenant == "alice"
    assert expected[3].added.checksum == 0xFFFF_FFFF_FFFF_FF01  # a fixed64 keeps every bit


def test_no_changes_packed_are_none() -> None:
    index, _ = make_index()
    service = PoolMasterServicer(index, "test", 1.0, MasterMetrics(CollectorRegistry()))
    assert changes_of(beat(service, packed=True)) == () == changes_of(beat(service, packed=False))


def test_packed_arrays_of_unequal_lengths_are_refused_naming_the_field() -> None:
    packed = pool_pb2.PackedChanges(sequence=[1, 2], key=["a/0", "a/1"], group_id=["a"], group_size=[2, 2],
                                    offset=[0, 1], size=[1, 1], checksum=[1, 2], tenant=["default", "default"])
    with pytest.raises(ValueError, match=r"packed_changes\.group_id: 1 entries, but packed_changes.sequence has 2"):
        changes_from_packed(packed)


def journal_of_every_kind() -> tuple[PoolIndex, PoolMasterServicer]:
    """A segment's journal with additions of groups keeping their keys in part (a prefix) and whole, of two
    tenants, removals of both kinds, and a removal of one member alone."""
    index, _ = make_index(max_changes_per_heartbeat=3)
    service = PoolMasterServicer(index, "test", 1.0, MasterMetrics(CollectorRegistry()))
    put(index, "a")
    put(index, "b", tenant="alice")
    whole = [PutRequestItem(f"w{stage}", "w", 2, KB, "default") for stage in range(2)]  # keys not "<group>/<part>"
    index.put_start("host0", whole)
    index.put_end([(item.key, 7 + i) for i, item in enumerate(whole)])
    put(index, "c")
    index.remove(["a", "w"])
    index.put_start("host0", [PutRequestItem("d/0", "d", 2, KB, "default")])
    index.put_revoke(["d/0"])  # in flight: nothing the store knew
    return index, service


def test_grouped_changes_are_exactly_the_changes_one_message_each_gives_wherever_a_beat_cuts() -> None:
    index, service = journal_of_every_kind()
    limit = index.settings.max_changes_per_heartbeat
    journal = index.segments["seg0"].journal
    everything = list(map(change_of_row, journal.pending_columns(1 << 30).rows()))
    assert len(everything) == journal.sequence == 12 and journal.num_entries == 6
    for acked in range(journal.sequence + 1):  # every acknowledgement: entries cut at the front and by the limit
        grouped = beat(service, packed=True, grouped=True, acked=acked)
        packed = beat(service, packed=True, acked=acked)
        legacy = beat(service, packed=False, acked=acked)
        assert grouped.HasField("grouped_changes") and not grouped.HasField("packed_changes")
        assert len(grouped.changes) == 0
        expected = tuple(everything[acked:acked + limit])
        assert changes_of(grouped) == changes_of(packed) == changes_of(legacy) == expected
        assert grouped.more == packed.more == (acked + limit < journal.sequence)


def test_grouped_changes_name_each_entry_once() -> None:
    _, service = journal_of_every_kind()
    first = beat(service, packed=True, grouped=True, acked=0).grouped_changes  # entries a/0..1, b/0 (cut)
    assert list(first.first) == [1, 3] and list(first.count) == [2, 1] and list(first.prefix) == ["a/", "b/"]
    assert list(first.part) == ["0", "1", "0"] and list(first.tenant) == ["default", "alice"]
    removal = beat(service, packed=True, grouped=True, acked=8).grouped_changes  # "w": whole keys, no prefix
    assert list(removal.group_size) == [0, 0] and list(removal.prefix) == ["a/", ""]
    assert list(removal.part) == ["a/0"[2:], "a/1"[2:], "w0"] and list(removal.offset) == []


def test_an_entry_the_last_beat_cut_is_taken_up_where_it_stopped() -> None:
    index, service = journal_of_every_kind()
    seen: list[object] = []
    acked, more = 0, True
    while more:
        answer = beat(service, packed=True, grouped=True, acked=acked)
        changes = changes_of(answer)
        seen += changes
        acked, more = (changes[-1].sequence if changes else acked), answer.more
    assert [change.sequence for change in seen] == list(range(1, 13))
    assert changes_of(beat(service, packed=True, grouped=True, acked=acked)) == ()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("count", [2], r"grouped_changes\.count: 1 entries, but grouped_changes\.first has 2"),
    ("tenant", ["default"], r"grouped_changes\.tenant: 1 entries, but grouped_changes\.first has 2"),
    ("part", ["0", "1", "0"], r"grouped_changes\.part: 3 entries, but grouped_changes\.count adds up to 4"),
    ("checksum", [1], r"grouped_changes\.checksum: 1 entries, but the entries that add \(group_size > 0\) have 2"),
])
def test_grouped_arrays_whose_lengths_disagree_are_refused_naming_the_field(field: str, value: list[object],
                                                                           message: str) -> None:
    fields: dict[str, list[object]] = dict(
        first=[1, 3], count=[2, 2], prefix=["a/", "a/"], group_id=["a", ""], group_size=[2, 0],
        tenant=["default", ""], part=["0", "1", "0", "1"], offset=[0, 1], size=[1, 1], checksum=[1, 2])
    assert len(changes_from_grouped(pool_pb2.GroupedChanges(**fields))) == 4  # (as they were, they are read)
    fields[field] = value
    with pytest.raises(ValueError, match=message):
        changes_from_grouped(pool_pb2.GroupedChanges(**fields))
