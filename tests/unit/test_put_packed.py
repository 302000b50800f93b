"""A PutStart's packed answer (``PutStartRequest.packed``), exactly: the same outcomes and locations as the
one-message-per-item answer, whatever mix of statuses; a malformed one refused by name; and the pool client
reads either, so a master that predates packed answers still serves it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvpool.core.pool.records import PutRequestItem
from kvpool.pool.client import put_locations
from kvpool.pool.objects import ObjectLocation, PutResult
from kvpool.rpc import pool_pb2
from kvpool.services.master.metrics import MasterMetrics
from kvpool.services.master.servicer import PoolMasterServicer
from tests.core.fixtures import KB, make_index
from tests.unit.test_pool_session import client_of


def servicer() -> PoolMasterServicer:
    index, _ = make_index(segment_bytes=40 * KB, segments=2)
    return PoolMasterServicer(index, "test", 1.0, MasterMetrics(CollectorRegistry()))


def request(items: list[tuple[str, str, int, int]], packed: bool) -> pool_pb2.PutStartRequest:
    return pool_pb2.PutStartRequest(client_host="host0", packed=packed, items=[
        pool_pb2.PutItem(key=k, group_id=g, group_size=n, size=size) for k, g, n, size in items])


def per_item(items: list[tuple[str, str, int, int]], response: pool_pb2.PutStartResponse) -> list[Any]:
    """What the one-message-per-item answer says, as the client reads it."""
    out: list[Any] = []
    for (key, _, _, size), result in zip(items, response.results):
        if result.status == pool_pb2.PUT_STATUS_RESERVED:
            loc = result.location
            out.append(ObjectLocation(key, loc.endpoint, loc.address, size, 0, loc.segment_id))
        else:
            out.append(PutResult.EXISTS if result.status == pool_pb2.PUT_STATUS_ALREADY_EXISTS
                       else PutResult.NOT_STORED)
    return out


# saves of groups of 1-4 members (some repeated: EXISTS), sizes that may not fit (NOT_STORED, GROUP_FAILED)
SAVES = st.lists(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4), st.sampled_from([KB, 8 * KB, 30 * KB])),
                          min_size=1, max_size=4), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(saves=SAVES)
def test_the_packed_answer_says_what_the_answer_per_item_says(saves: list[list[tuple[int, int, int]]]) -> None:
    packed_side, items_side = servicer(), servicer()
    for save in saves:
        items = [(f"g{g}/{m}", f"g{g}", n, size) for g, n, size in save for m in range(n)]
        items = list(dict((item[0], item) for item in items).values())  # one per key in a batch
        try:
            expected = items_side.put_start(request(items, packed=False))
        except Exception as error:  # a refused batch (e.g. nothing fits) is refused alike
            with pytest.raises(type(error)):
                packed_side.put_start(request(items, packed=True))
            continue
        got = packed_side.put_start(request(items, packed=True))
        assert not got.results and len(got.packed.status) == len(items)
        assert put_locations(items, got.packed, got.segments) == per_item(items, expected)
        assert {s.segment_id for s in got.segments} == {s.segment_id for s in expected.segments}
        for side in (packed_side, items_side):  # commit what was reserved, so later saves evict and exist
            in_flight = [key for key, *_ in items if key in side.index.puts.in_flight]
            if in_flight:
                side.put_end(pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key=k, checksum=1) for k in in_flight]))


def test_a_packed_answer_that_does_not_match_its_items_is_refused_by_name() -> None:
    items = [("g/0", "g", 2, KB), ("g/1", "g", 2, KB)]
    answer = servicer().put_start(request(items, packed=True))
    with pytest.raises(ValueError, match=r"packed: 2, 2 and 2 entries for 1 items"):
        put_locations(items[:1], answer.packed, answer.segments)
    with pytest.raises(ValueError, match=r"packed.segment\[0\]: segment \d+ is not in the answer"):
        put_locations(items, answer.packed, [])


class MasterBeforePackedPuts(PoolMasterServicer):
    """A master built before ``PutStartRequest.packed``: it never reads the field."""

    def put_start(self, request: pool_pb2.PutStartRequest) -> pool_pb2.PutStartResponse:
        request.packed = False
        return super().put_start(request)


@pytest.mark.parametrize("master", [PoolMasterServicer, MasterBeforePackedPuts])
def test_the_pool_client_reserves_from_either_answer(master: type[PoolMasterServicer]) -> None:
    index, _ = make_index(segment_bytes=40 * KB, segments=2)
    service = master(index, "test", 1.0, MasterMetrics(CollectorRegistry()))
    index.put_start("host0", [PutRequestItem("old/0", "old", 1, KB)])

    async def main() -> list[Any]:
        async with client_of(service) as client:
            return await client.reserve([("g/0", "g", 2, KB), ("g/1", "g", 2, KB), ("old/0", "old", 1, KB)])

    reserved = asyncio.run(main())
    assert [type(r) for r in reserved[:2]] == [ObjectLocation, ObjectLocation] and reserved[2] is PutResult.EXISTS
    for location, key in zip(reserved[:2], ("g/0", "g/1")):
        obj = index.objects[key]
        segment = index.segments[obj.segment_id]
        assert (location.key, location.segment_id, location.endpoint, location.address, location.size) == \
            (key, segment.segment_id, segment.endpoint, segment.base_address + obj.offset, KB)
