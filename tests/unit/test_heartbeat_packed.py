"""A heartbeat's packed changes (``HeartbeatRequest.packed``), exactly: the same changes as one message each,
an older master's answer still read, and arrays of unequal lengths refused, naming the field."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import PutRequestItem
from kvpool.rpc import pool_pb2
from kvpool.services.master.metrics import MasterMetrics
from kvpool.services.master.servicer import PoolMasterServicer
from kvpool.services.store.master_client import changes_from_packed, changes_of
from tests.core.fixtures import KB, make_index


def put(index: PoolIndex, group: str, tenant: str = "") -> None:
    items = [PutRequestItem(f"{group}/{stage}", group, 2, KB + stage, tenant or "default") for stage in range(2)]
    index.put_start("host0", items)
    index.put_end([(item.key, 0xFFFF_FFFF_FFFF_FF00 + i) for i, item in enumerate(items)])


def beat(service: PoolMasterServicer, packed: bool) -> pool_pb2.HeartbeatResponse:
    return asyncio.run(service.Heartbeat(pool_pb2.HeartbeatRequest(segment_id="seg0", packed=packed), None))


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
