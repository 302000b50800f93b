"""A lookup's packed answer (``LookupRequest.packed``) and its held prefix, exactly: the same locations as
the one-message-per-object form, each group's encoding made once and made again when a member changes."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import PutRequestItem
from kvpool.pool.client import packed_groups
from kvpool.pool.objects import GroupLocation, ObjectLocation
from kvpool.rpc import pool_pb2
from kvpool.services.master.metrics import MasterMetrics
from kvpool.services.master.servicer import PoolMasterServicer
from tests.core.fixtures import KB, make_index


class Aborted(Exception):
    pass


class Context:
    """What a servicer method uses of gRPC's context when it refuses a call."""

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        raise Aborted(code, details)


def servicer(segments: int = 2) -> tuple[PoolMasterServicer, PoolIndex]:
    index, _ = make_index(segments=segments)
    return PoolMasterServicer(index, "test", 1.0, MasterMetrics(CollectorRegistry())), index


def put(index: PoolIndex, group: str, checksums: tuple[int, ...] = (11, 12, 13, 14), host: str = "host0") -> None:
    items = [PutRequestItem(f"{group}/{stage}", group, len(checksums), KB) for stage in range(len(checksums))]
    index.put_start(host, items)
    index.put_end([(item.key, c) for item, c in zip(items, checksums)])


def lookup(service: PoolMasterServicer, ids: list[str], **fields: Any) -> pool_pb2.LookupResponse:
    return asyncio.run(service.Lookup(pool_pb2.LookupRequest(group_ids=ids, **fields), Context()))


def unpacked(response: pool_pb2.LookupResponse) -> list[GroupLocation]:
    return [GroupLocation(g.group_id, {m.key: ObjectLocation(m.key, m.location.endpoint, m.location.address,
                                                             m.location.size, m.checksum, m.location.segment_id)
                                       for m in g.members}) for g in response.groups]


def test_the_packed_answer_holds_exactly_the_locations_of_the_per_object_one() -> None:
    service, index = servicer()
    put(index, "a")
    put(index, "b", host="host1")  # its members lie in the other segment
    put(index, "c", (21, 22, 23, 24))
    legacy = lookup(service, ["a", "b", "c"])
    packed = lookup(service, ["a", "b", "c"], packed=True)
    assert list(packed.groups) == [] and packed.num_complete == legacy.num_complete == 3
    p = packed.packed
    assert list(p.group_id) == ["a", "b", "c"] and list(p.num_members) == [4, 4, 4]
    assert list(p.key) == [f"{g}/{s}" for g in "abc" for s in range(4)]
    assert list(p.checksum) == [11, 12, 13, 14] * 2 + [21, 22, 23, 24] and list(p.size) == [KB] * 12
    numbers = {s.segment_id: s.number for s in packed.segments}
    assert sorted(numbers.values()) == [1, 2]
    objects = [index.objects[key] for key in p.key]
    assert list(p.segment) == [numbers[o.segment_id] for o in objects]
    assert list(p.address) == [index.segments[o.segment_id].base_address + o.offset for o in objects]
    assert {s.segment_id: s.endpoint for s in packed.segments} == {"seg0": "127.0.0.1:9000", "seg1": "127.0.0.1:9001"}
    assert packed_groups(packed.packed, packed.segments) == unpacked(legacy)
    # as bytes: the same PackedGroups, serialized, and packed present but empty
    raw = lookup(service, ["a", "b", "c"], packed=True, packed_bytes=True)
    assert raw.HasField("packed") and raw.packed == pool_pb2.PackedGroups()
    assert pool_pb2.PackedGroups.FromString(raw.packed_bytes) == packed.packed
    assert list(raw.segments) == list(packed.segments) and raw.num_complete == 3
    none = lookup(service, ["missing"], packed=True, packed_bytes=True)
    assert none.HasField("packed") and none.packed_bytes == b"" and none.num_complete == 0


def test_a_held_prefix_is_neither_leased_nor_located_in_either_form() -> None:
    service, index = servicer()
    for group in "abcd":
        put(index, group)
    packed = lookup(service, list("abcd"), packed=True, held_prefix=2)
    legacy = lookup(service, list("abcd"), held_prefix=2)
    assert packed.num_complete == legacy.num_complete == 4
    assert list(packed.packed.group_id) == [g.group_id for g in legacy.groups] == ["c", "d"]
    assert [index.groups[g].num_leases for g in "abcd"] == [0, 0, 2, 2]
    wholly = lookup(service, ["a", "b"], packed=True, held_prefix=2)
    assert (wholly.num_complete, wholly.lease_id, list(wholly.packed.group_id)) == (2, 0, [])
    assert wholly.HasField("packed")  # present, empty: the caller knows this master answered packed


def test_each_groups_encoding_is_made_once_and_again_when_a_member_changes() -> None:
    service, index = servicer(segments=1)
    put(index, "a")
    lookup(service, ["a"], packed=True)
    encoded = index.groups["a"].encoded
    lookup(service, ["a"], packed=True)
    assert index.groups["a"].encoded is encoded  # reused
    group = index.groups["a"]
    index.drop_member(group, group.position("a/2"))  # its store lost it: the group is incomplete, then the member comes back
    assert group.encoded is None and lookup(service, ["a"], packed=True).num_complete == 0
    index.put_start("host0", [PutRequestItem("a/2", "a", 4, KB)])
    index.put_end([("a/2", 99)])
    again = lookup(service, ["a"], packed=True).packed
    assert list(again.key)[-1] == "a/2" and list(again.checksum)[-1] == 99
    assert list(again.address)[-1] == index.segments["seg0"].base_address + index.objects["a/2"].offset


def test_a_held_prefix_longer_than_the_ids_is_refused_naming_the_field() -> None:
    service, index = servicer()
    with pytest.raises(Aborted) as refused:
        lookup(service, ["a"], held_prefix=2)
    assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.args[1].startswith("held_prefix: 2 is more than the 1 group ids")


def test_a_packed_answer_whose_arrays_disagree_is_refused() -> None:
    segments = [pool_pb2.SegmentAccess(segment_id="seg0", number=1, endpoint="e:1")]
    short = pool_pb2.PackedGroups(group_id=["a"], num_members=[2], key=["a/0", "a/1"], segment=[1, 1],
                                  address=[1, 2], size=[3, 3], checksum=[5])
    with pytest.raises(ValueError, match="packed: its arrays disagree"):
        packed_groups(short, segments)
    unknown = pool_pb2.PackedGroups(group_id=["a"], num_members=[1], key=["a/0"], segment=[7], address=[1],
                                    size=[3], checksum=[5])
    with pytest.raises(ValueError, match=r"packed.segment\[0\]: segment 7 is not in the answer"):
        packed_groups(unknown, segments)
    assert packed_groups(pool_pb2.PackedGroups(group_id=["a"], num_members=[1], key=["a/0"], segment=[1],
                                               address=[1], size=[3], checksum=[5]), segments) == [
        GroupLocation("a", {"a/0": ObjectLocation("a/0", "e:1", 1, 3, 5, "seg0")})]


def put_start(service: PoolMasterServicer, keys: list[str], **fields: Any) -> pool_pb2.PutStartResponse:
    items = [pool_pb2.PutItem(key=k, group_id=k.rsplit("/", 1)[0], group_size=1, size=KB) for k in keys]
    return asyncio.run(service.PutStart(pool_pb2.PutStartRequest(client_host="host0", items=items, **fields),
                                        Context()))


def test_a_put_start_ends_the_lease_it_carries_after_its_put() -> None:
    """A save that follows a restore ends the restore's lease in its first call: the lease is gone, its
    groups touched before the put, as a release touches them, a group its reader found corrupt dropped."""
    service, index = servicer()
    for group in "abc":
        put(index, group)
    found = lookup(service, ["a", "b", "c"], packed=True, held_prefix=1)
    assert [index.groups[g].num_leases for g in "abc"] == [0, 1, 1]
    put_start(service, ["new/0"], release_lease_id=found.lease_id, release_corrupt_group_ids=["c"])
    assert index.num_leases == 0 and "c" not in index.groups  # condemned, and no lease held it any more
    # its read was a use before the save: the held head most recent of the two, the save after them
    assert list(index.groups)[-3:] == ["b", "a", "new"]
    again = put_start(service, ["newer/0"], release_lease_id=found.lease_id)  # an ended lease: ignored
    assert again.results[0].status == pool_pb2.PUT_STATUS_RESERVED


def test_corrupt_groups_without_a_lease_in_a_put_start_are_refused_naming_the_field() -> None:
    service, index = servicer()
    with pytest.raises(Aborted) as refused:
        put_start(service, ["x/0"], release_corrupt_group_ids=["a"])
    assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.args[1].startswith("release_corrupt_group_ids: given without release_lease_id")
    assert "x/0" not in index.objects  # refused before anything changed


def test_the_compact_answer_leaves_out_ids_and_derivable_keys_and_reads_back_exactly() -> None:
    service, index = servicer()
    put(index, "a")
    put(index, "b", host="host1")
    odd = [PutRequestItem(key, "c", 2, KB) for key in ("c/1", "other-name")]  # keys that are not derivable
    index.put_start("host0", odd)
    index.put_end([(odd[0].key, 31), (odd[1].key, 32)])
    full = lookup(service, ["a", "b", "c"], packed=True, held_prefix=1)
    compact = lookup(service, ["a", "b", "c"], packed=True, held_prefix=1, compact=True)
    assert compact.compact and not full.compact
    c = compact.packed
    assert list(c.group_id) == [] and list(c.num_members) == [4, 2]
    assert list(c.key) == ["", "", "", "", "c/1", "other-name"]  # "c/1" is c's first member, not its second
    assert (list(c.segment), list(c.address), list(c.size), list(c.checksum)) == (
        list(full.packed.segment), list(full.packed.address), list(full.packed.size), list(full.packed.checksum))
    assert packed_groups(c, compact.segments, ["b", "c"]) == packed_groups(full.packed, full.segments)
    raw = lookup(service, ["a", "b", "c"], packed=True, packed_bytes=True, held_prefix=1, compact=True)
    assert raw.compact and pool_pb2.PackedGroups.FromString(raw.packed_bytes) == c
    # each form's encoding is kept apart, and both are forgotten when a member changes
    group = index.groups["b"]
    assert group.compact is not None and group.encoded is not None and group.compact != group.encoded
    index.drop_member(group, group.position("b/3"))
    assert group.compact is None and group.encoded is None


def test_a_compact_answer_that_cannot_be_read_is_refused() -> None:
    segments = [pool_pb2.SegmentAccess(segment_id="seg0", number=1, endpoint="e:1")]
    two = pool_pb2.PackedGroups(num_members=[1, 1], key=["", ""], segment=[1, 1], address=[1, 2], size=[3, 3],
                                checksum=[5, 6])
    with pytest.raises(ValueError, match="a compact answer of 2 groups"):
        packed_groups(two, segments, ["a"])  # more groups than were asked
    with_ids = pool_pb2.PackedGroups(group_id=["a"], num_members=[1], key=[""], segment=[1], address=[1], size=[3],
                                     checksum=[5])
    with pytest.raises(ValueError, match=r"\(and 1 ids\)"):
        packed_groups(with_ids, segments, ["a"])
    assert packed_groups(two, segments, ["a", "b", "c"]) == [
        GroupLocation("a", {"a/0": ObjectLocation("a/0", "e:1", 1, 3, 5, "seg0")}),
        GroupLocation("b", {"b/0": ObjectLocation("b/0", "e:1", 2, 3, 6, "seg0")})]
