"""Bad input: the right status, a message naming the field, and the master keeps serving."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from kvpool import service
from kvpool.tools.cluster import LocalPool
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from tests.integration.conftest import FAST_MASTER
from tests.integration.unparsed_bytes import HEALTH, assert_unparsable_bytes_refused

pytestmark = pytest.mark.cluster

Code = grpc.StatusCode


def item(key: str = "ns/a/0", group_id: str = "ns/a", group_size: int = 1, size: int = 64) -> pool_pb2.PutItem:
    return pool_pb2.PutItem(key=key, group_id=group_id, group_size=group_size, size=size)


def put(*items: pool_pb2.PutItem) -> tuple[str, pool_pb2.PutStartRequest]:
    return "PutStart", pool_pb2.PutStartRequest(client_host="h", items=list(items))


CASES = [
    ("empty key", put(item(key="")), Code.INVALID_ARGUMENT, "items[0].key: must not be empty"),
    ("oversized key", put(item(key="k" * 513)), Code.INVALID_ARGUMENT, "items[0].key: 513 bytes is longer than 512"),
    ("empty group", put(item(group_id="")), Code.INVALID_ARGUMENT, "items[0].group_id: must not be empty"),
    ("zero size", put(item(size=0)), Code.INVALID_ARGUMENT, "items[0].size: must be positive, got 0"),
    ("negative size", put(item(), item(key="ns/b/0", group_id="ns/b", size=-5)), Code.INVALID_ARGUMENT,
     "items[1].size: must be positive, got -5"),
    ("zero group size", put(item(group_size=0)), Code.INVALID_ARGUMENT, "items[0].group_size: 0 is outside 1..64"),
    ("larger than any segment", put(item(size=9 << 20)), Code.INVALID_ARGUMENT,
     "items[0].size: 9437184 bytes is larger than any segment"),
    ("duplicate keys", put(item(group_size=2), item(group_size=2)), Code.INVALID_ARGUMENT,
     "items[1].key: duplicate key 'ns/a/0'"),
    ("group size disagrees", put(item(key="ns/g/0", group_id="ns/g", group_size=2),
                                 item(key="ns/g/1", group_id="ns/g", group_size=3)),
     Code.INVALID_ARGUMENT, "items[1].group_size: 3 disagrees with 2"),
    ("empty batch", ("PutStart", pool_pb2.PutStartRequest()), Code.INVALID_ARGUMENT, "items: must not be empty"),
    ("oversized tenant", ("PutStart", pool_pb2.PutStartRequest(client_host="h", items=[item()], tenant="t" * 65)),
     Code.INVALID_ARGUMENT, "tenant: longer than 64 bytes"),
    ("put end never started", ("PutEnd", pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key="ns/zz/0")])),
     Code.FAILED_PRECONDITION, "items[0].key: no put in flight for 'ns/zz/0'"),
    ("unknown segment heartbeat", ("Heartbeat", pool_pb2.HeartbeatRequest(segment_id="nope")),
     Code.NOT_FOUND, "segment_id: unknown segment 'nope'"),
    ("unknown segment unmount", ("UnmountSegment", pool_pb2.UnmountSegmentRequest(segment_id="nope")),
     Code.NOT_FOUND, "segment_id: unknown segment 'nope'"),
    ("mount without endpoint", ("MountSegment", pool_pb2.MountSegmentRequest(segment_id="s", size=10, base_address=1)),
     Code.INVALID_ARGUMENT, "endpoint: '' is not host:port"),
    ("mount negative size", ("MountSegment", pool_pb2.MountSegmentRequest(
        segment_id="s", endpoint="127.0.0.1:1", size=-1, base_address=1)), Code.INVALID_ARGUMENT,
     "size: must be positive, got -1"),
    ("lookup empty id", ("Lookup", pool_pb2.LookupRequest(group_ids=["ns/a", ""])), Code.INVALID_ARGUMENT,
     "group_ids[1]: must not be empty"),
    ("lookup negative lease", ("Lookup", pool_pb2.LookupRequest(group_ids=["ns/a"], lease_ms=-1)),
     Code.INVALID_ARGUMENT, "lease_ms: -1 is outside"),
    ("exists oversized", ("Exists", pool_pb2.ExistsRequest(keys=["x" * 600])), Code.INVALID_ARGUMENT,
     "keys[0]: 600 bytes is longer than 512"),
    ("remove nothing", ("Remove", pool_pb2.RemoveRequest()), Code.INVALID_ARGUMENT, "group_ids: must not be empty"),
    ("demote nothing", ("Demote", pool_pb2.DemoteRequest()), Code.INVALID_ARGUMENT, "group_ids: must not be empty"),
    ("demote an empty name", ("Demote", pool_pb2.DemoteRequest(group_ids=["ns/a", ""])), Code.INVALID_ARGUMENT,
     "group_ids[1]: must not be empty"),
    ("release naming an empty corrupt group", ("ReleaseLease", pool_pb2.ReleaseLeaseRequest(
        lease_id=1, corrupt_group_ids=["ns/a", ""])), Code.INVALID_ARGUMENT, "corrupt_group_ids[1]: must not be empty"),
]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPool]:
    """One pool for the module: no test here stops a part of it, and only the first reads its state."""
    with LocalPool(num_stores=2, segment_size="8MiB", master_args=FAST_MASTER,
                   workdir=tmp_path_factory.mktemp("pool")) as local:
        yield local


@pytest.fixture
async def stub(pool: LocalPool) -> AsyncIterator[pool_pb2_grpc.PoolMasterStub]:
    async with grpc.aio.insecure_channel(pool.master_address, options=service.GRPC_OPTIONS) as channel:
        yield pool_pb2_grpc.PoolMasterStub(channel)


SESSION_BODIES = {"PutStart": "put_start", "PutEnd": "put_end", "PutRevoke": "put_revoke", "Lookup": "lookup",
                  "ReleaseLease": "release_lease"}


async def test_the_same_bad_input_on_a_session_stream_is_answered_alike_and_the_stream_goes_on(
        stub: pool_pb2_grpc.PoolMasterStub) -> None:
    """Every case a Session message can carry: the same code and message as the unary call, in the answer to
    that message alone; the stream stays open and answers a good lookup after them. (First in the module: the
    cases expect the pool empty.)"""
    cases = [(name, SESSION_BODIES[method], request, code, message)
             for name, (method, request), code, message in CASES if method in SESSION_BODIES]
    assert len(cases) >= 12
    session = stub.Session(timeout=30)
    for number, (name, body, request, code, message) in enumerate(cases, start=1):
        await session.write(pool_pb2.SessionRequest(call=number, **{body: request}))
        answer = await session.read()
        assert answer.call == number and answer.code == code.value[0], name
        assert message in answer.message and answer.WhichOneof("body") is None, (name, answer.message)
    await session.write(pool_pb2.SessionRequest(call=99, lookup=pool_pb2.LookupRequest(group_ids=["ns/none"])))
    answer = await session.read()
    assert (answer.call, answer.code, answer.lookup.num_complete) == (99, 0, 0)
    await session.done_writing()
    assert await session.read() is grpc.aio.EOF


async def test_bad_input_is_rejected_by_field_and_master_keeps_serving(stub: pool_pb2_grpc.PoolMasterStub) -> None:
    for name, (method, request), code, message in CASES:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(stub, method)(request, timeout=5)
        assert err.value.code() == code, name
        assert message in (err.value.details() or ""), (name, err.value.details())
    # nothing was half-applied, and good requests still work
    stats = await stub.Stats(pool_pb2.StatsRequest(), timeout=5)
    assert stats.num_objects == 0 and stats.used_bytes == 0 and len(stats.segments) == 2
    started = await stub.PutStart(pool_pb2.PutStartRequest(client_host="h", items=[item()]), timeout=5)
    assert started.results[0].status == pool_pb2.PUT_STATUS_RESERVED
    ended = await stub.PutEnd(pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key="ns/a/0", checksum=1)]), timeout=5)
    assert ended.num_committed == 1
    # a session's end demotes the groups the pool holds, and only those
    demoted = await stub.Demote(pool_pb2.DemoteRequest(group_ids=["ns/a", "ns/gone"]), timeout=5)
    assert demoted.num_demoted == 1  # ns/a is held, ns/gone is not


async def test_health_service_reports_serving(pool: LocalPool) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    targets = [pool.master_address] + [f"127.0.0.1:{s.ready['port']}" for s in pool.stores]
    for target in targets:
        async with grpc.aio.insecure_channel(target) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, target


def test_bytes_that_do_not_parse_are_invalid_argument_naming_the_message(pool: LocalPool) -> None:
    assert assert_unparsable_bytes_refused(pool.master_address, ["kvpool.rpc.PoolMaster", HEALTH]) >= 13
    for store in pool.stores:  # a store serves health (and reflection) only
        assert assert_unparsable_bytes_refused(f"127.0.0.1:{store.ready['port']}", [HEALTH]) >= 2
