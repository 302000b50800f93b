"""A master with a standby, elected through a real etcd: real processes, the transfer engine, SIGKILL and SIGSTOP.

- The leader killed with -9: the standby leads with a newer epoch, the stores re-mount to it with their block
  reports, and every group whose put was acknowledged is found again, at the same place, with the same bytes.
- The leader paused past its lease and resumed: it answers nothing and commits nothing; the new leader serves.
``kvpool up`` and a replay with a standby: test_master_standby_up.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from kvpool import service
from kvpool.ha.election import LEADER_KEY, leader_of
from kvpool.ha.etcd_client import EtcdClient
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject, PutResult
from kvpool.pool.stats_client import fetch_stats
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool.tools.cluster import LocalPool
from kvpool.transfer import HostBuffer, TransferEngine
from tests.integration.conftest import FAST_MASTER, eventually

pytestmark = pytest.mark.cluster

KB = 1024
MEMBERS = 2
SIZE = 4 * KB
READ_AT = 32 << 20


@pytest.fixture
def ha_pool(tmp_path: Path) -> Iterator[LocalPool]:
    with LocalPool(num_stores=2, segment_size="8MiB", master_args=FAST_MASTER, workdir=tmp_path,
                   master_standbys=1) as local:
        yield local


@pytest.fixture
async def ha_client(ha_pool: LocalPool, engine: TransferEngine, buffer: HostBuffer) -> AsyncIterator[PoolClient]:
    c = PoolClient(ha_pool.master_address, engine)
    c.register(buffer.address, buffer.size)
    assert await c.connect(10.0)
    yield c
    await c.close()


async def leader_address(pool: LocalPool) -> tuple[str, int]:
    cluster = pool.cluster
    assert cluster is not None and cluster.etcd is not None
    client = EtcdClient(cluster.etcd.endpoint)
    try:
        kv, _ = await client.get(LEADER_KEY)
    finally:
        await client.close()
    leader = leader_of(kv) if kv is not None else None
    return (leader.address, int(leader.epoch)) if leader is not None else ("", 0)


def fill(buffer: HostBuffer, offset: int, seed: int) -> None:
    buffer.view(offset, SIZE)[:] = bytes((seed * 13 + j) % 251 for j in range(256)) * (SIZE // 256)


async def put_groups(client: PoolClient, buffer: HostBuffer, prefix: str, count: int, start: int) -> list[str]:
    objects = []
    for g in range(count):
        for m in range(MEMBERS):
            slot = start + g * MEMBERS + m
            fill(buffer, slot * SIZE, slot)
            objects.append(PutObject(f"{prefix}{g}/{m}", f"{prefix}{g}", MEMBERS, buffer.address + slot * SIZE, SIZE))
    assert await client.put(objects) == [PutResult.STORED] * len(objects)  # acknowledged: PutEnd answered
    return [f"{prefix}{g}" for g in range(count)]


async def all_found(client: PoolClient, groups: list[str]) -> bool:
    try:
        found = await client.lookup(groups)
    except grpc.aio.AioRpcError:
        return False
    if found.lease_id:
        await client.release(found.lease_id)
    return found.num_complete == len(groups)


async def bytes_right(client: PoolClient, buffer: HostBuffer, groups: list[str]) -> bool:
    found = await client.lookup(groups)
    members = [m for g in found.groups for m in g.members.values()]
    ok = all(await client.read([(loc, buffer.address + READ_AT + i * SIZE) for i, loc in enumerate(members)]))
    await client.release(found.lease_id)
    return ok and found.num_complete == len(groups)


async def test_the_leader_killed_the_standby_leads_and_nothing_acknowledged_is_lost(
        ha_pool: LocalPool, ha_client: PoolClient, buffer: HostBuffer) -> None:
    groups = await put_groups(ha_client, buffer, "ns/a", 8, start=0)
    old_address, old_epoch = await leader_address(ha_pool)
    assert old_epoch > 0
    # the last batch right before the kill: its PutEnd was answered only once the stores held the records
    groups += await put_groups(ha_client, buffer, "ns/b", 8, start=8 * MEMBERS)
    ha_pool.candidate_at(old_address).kill()  # (how fast the standby takes over is bench faults' to measure)
    await eventually(lambda: all_found(ha_client, groups), timeout_s=15.0, what="every group found again")
    new_address, new_epoch = await leader_address(ha_pool)
    assert new_address != old_address and new_epoch > old_epoch
    assert ha_client.link.epoch == new_epoch
    assert await bytes_right(ha_client, buffer, groups)
    # the new leader takes saves, and kvpool pool stats finds it through etcd too
    assert await put_groups(ha_client, buffer, "ns/c", 2, start=16 * MEMBERS)
    stats = await fetch_stats(ha_pool.master_address)
    assert len(stats["segments"]) == 2 and int(stats["num_objects"]) == 18 * MEMBERS
    # the client's fence: had a newer leader answered already, this leader's answers would be refused
    assert ha_client.link.fence.admit(new_epoch + 1000)
    with pytest.raises(grpc.aio.AioRpcError) as fenced:
        await ha_client.stats()
    assert fenced.value.code() == grpc.StatusCode.UNAVAILABLE and "older epoch" in (fenced.value.details() or "")


async def test_a_leader_paused_past_its_lease_answers_and_commits_nothing_when_resumed(
        ha_pool: LocalPool, ha_client: PoolClient, buffer: HostBuffer) -> None:
    groups = await put_groups(ha_client, buffer, "ns/a", 4, start=0)
    old_address, old_epoch = await leader_address(ha_pool)
    old = ha_pool.candidate_at(old_address)
    async with grpc.aio.insecure_channel(old_address, options=service.GRPC_OPTIONS) as channel:
        stub = pool_pb2_grpc.PoolMasterStub(channel)
        # a put started on the leader before it froze: ended after it wakes, it must not commit
        item = pool_pb2.PutItem(key="ns/late/0", group_id="ns/late", group_size=1, size=SIZE)
        started = await stub.PutStart(pool_pb2.PutStartRequest(items=[item]), timeout=5.0)
        assert started.results[0].status == pool_pb2.PUT_STATUS_RESERVED
        old.pause()
        try:
            await eventually(lambda: _new_leader(ha_pool, old_epoch), timeout_s=15.0, what="a new leader")
            await eventually(lambda: all_found(ha_client, groups), timeout_s=15.0, what="groups on the new leader")
        finally:
            old.resume()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.PutEnd(pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key="ns/late/0", checksum=1)]),
                              timeout=5.0)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not the leader" in (refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Lookup(pool_pb2.LookupRequest(group_ids=groups), timeout=5.0)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # deposed, it campaigns again and stands by behind the new leader, and its refusals say so
        await eventually(lambda: _refused_as(stub, "is a standby, not the leader"), timeout_s=10.0,
                         what="the old leader standing by")
    assert not await all_found(ha_client, ["ns/late"])
    assert await bytes_right(ha_client, buffer, groups)
    new_address, new_epoch = await leader_address(ha_pool)
    assert new_address != old_address and new_epoch > old_epoch


async def _refused_as(stub: pool_pb2_grpc.PoolMasterStub, words: str) -> bool:
    try:
        await stub.Stats(pool_pb2.StatsRequest(), timeout=5.0)
    except grpc.aio.AioRpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE and words in (exc.details() or "")
    return False


async def _new_leader(pool: LocalPool, old_epoch: int) -> bool:
    return (await leader_address(pool))[1] > old_epoch


async def test_a_bad_wait_is_refused_naming_the_field(ha_pool: LocalPool) -> None:
    address, _ = await leader_address(ha_pool)
    async with grpc.aio.insecure_channel(address, options=service.GRPC_OPTIONS) as channel:
        stub = pool_pb2_grpc.PoolMasterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.Heartbeat(pool_pb2.HeartbeatRequest(segment_id="x", wait_ms=10**9), timeout=5.0)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "wait_ms" in (bad.value.details() or "")


async def test_a_store_whose_registration_lapses_is_dropped_before_its_heartbeat_ttl(
        tmp_path: Path, engine: TransferEngine, buffer: HostBuffer) -> None:
    # a heartbeat TTL far longer than the registration's 2 s lease: only etcd can drop the store this soon
    args = ["--segment-ttl-s", "60", "--heartbeat-interval-s", "2"]
    with LocalPool(num_stores=2, segment_size="8MiB", master_args=args, workdir=tmp_path, master_standbys=1) as pool:
        client = PoolClient(pool.master_address, engine)
        client.register(buffer.address, buffer.size)
        try:
            assert await client.connect(10.0)
            await eventually(lambda: _segments(client, 2), what="both stores mounted")
            frozen = pool.stores[1]
            frozen.pause()
            try:  # within its lease (2 s) and slack for a busy host, far inside the 60 s heartbeat TTL
                await eventually(lambda: _segments(client, 1), timeout_s=15.0, what="the frozen store dropped")
                # placement skips it: a save lands on the live store
                assert await put_groups(client, buffer, "ns/p", 2, start=0)
            finally:
                frozen.resume()
            await eventually(lambda: _segments(client, 2), timeout_s=20.0, what="the store back, registered again")
        finally:
            await client.close()


async def _segments(client: PoolClient, count: int) -> bool:
    try:
        return len((await client.stats()).segments) == count
    except grpc.aio.AioRpcError:
        return False


async def test_while_etcd_is_down_the_leader_serves_until_its_lease_ends_then_requests_miss_and_it_comes_back(
        ha_pool: LocalPool, ha_client: PoolClient, buffer: HostBuffer) -> None:
    groups = await put_groups(ha_client, buffer, "ns/a", 4, start=0)
    cluster = ha_pool.cluster
    assert cluster is not None and cluster.etcd is not None
    cluster.etcd.pause()
    try:
        assert await all_found(ha_client, groups)  # the leader's lease still runs: it serves
        # then it stops answering before its lease could end: a lookup is a miss, a save is not stored
        # (how soon, against the lease, is test_etcd_election.py's: here, that it does and nothing is lost)
        await eventually(lambda: _missed(ha_client, groups), timeout_s=10.0, what="the leader stops answering")
        assert await ha_client.put([PutObject("ns/z/0", "ns/z", 1, buffer.address, SIZE)]) == [PutResult.NOT_STORED]
    finally:
        cluster.etcd.resume()
    # etcd back: a leader (a new epoch), the stores' block reports, every acknowledged group found and right
    await eventually(lambda: all_found(ha_client, groups), timeout_s=20.0, what="the pool back after etcd")
    assert await bytes_right(ha_client, buffer, groups)


async def _missed(client: PoolClient, groups: list[str]) -> bool:
    return not await all_found(client, groups)
