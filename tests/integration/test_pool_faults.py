"""Faults: a store killed with -9, a writer that never ends its put, a store shutting down
cleanly, a full pool. Each degrades to misses, never to errors or wrong bytes. (A master
killed and restarted: test_master_restart.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvpool.tools.cluster import LocalPool
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject, PutResult
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool.transfer import POLL_MIN_BYTES, HostBuffer
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster


async def put_singles(client: PoolClient, buffer: HostBuffer, prefix: str, count: int, size: int = 4096) -> list[str]:
    objects = []
    for i in range(count):
        buffer.view(i * size, size)[:] = bytes([i % 251]) * size
        objects.append(PutObject(f"{prefix}{i}/0", f"{prefix}{i}", 1, buffer.address + i * size, size))
    # two batches, so that (one batch, one segment) both stores hold some
    half = count // 2
    assert await client.put(objects[:half]) == [PutResult.STORED] * half
    assert await client.put(objects[half:]) == [PutResult.STORED] * (count - half)
    return [o.group_id for o in objects]


async def segments(client: PoolClient) -> int:
    return len((await client.stats()).segments)


async def test_killed_store_turns_its_objects_into_misses(
    client: PoolClient, buffer: HostBuffer, pool: LocalPool
) -> None:
    groups = await put_singles(client, buffer, "ns/k", 16)
    found = await client.lookup(groups)
    assert found.num_complete == 16
    await client.release(found.lease_id)
    victim = pool.stores[1]
    victim_endpoint = victim.ready["endpoint"]
    on_victim = {g.group_id for g in found.groups if next(iter(g.members.values())).endpoint == victim_endpoint}
    assert 0 < len(on_victim) < 16

    victim.kill()
    # before the master notices, reads from the dead store fail as misses, not errors
    items = [(next(iter(g.members.values())), buffer.address + (16 << 20) + i * 4096) for i, g in enumerate(found.groups)]
    verified = await client.read(items)
    assert [ok for ok, g in zip(verified, found.groups) if g.group_id in on_victim] == [False] * len(on_victim)
    assert all(ok for ok, g in zip(verified, found.groups) if g.group_id not in on_victim)

    await eventually(lambda: _equals(segments(client), 1), what="store dropped after the 2 s TTL")
    for group_id in groups:
        hit = (await client.lookup([group_id])).num_complete
        assert hit == (0 if group_id in on_victim else 1), group_id
    # the pool keeps serving on the surviving store
    assert len(await put_singles(client, buffer, "ns/after", 4)) == 4


async def test_large_batch_from_a_killed_store_reads_as_misses(
    client: PoolClient, buffer: HostBuffer, pool: LocalPool
) -> None:
    # past POLL_MIN_BYTES objects move one by one: each fails on its own, nothing hangs or raises,
    # and the other store's objects still verify
    size, count = 1 << 20, 10
    objects = [PutObject(f"ns/kb{i}/0", f"ns/kb{i}", 1, buffer.address + i * size, size) for i in range(count)]
    assert await client.put(objects) == [PutResult.STORED] * count
    found = await client.lookup([o.group_id for o in objects])
    assert found.num_complete == count
    locations = [g.members[o.key] for o, g in zip(objects, found.groups)]
    victim = pool.stores[0]
    on_victim = [loc.endpoint == victim.ready["endpoint"] for loc in locations]
    assert sum(on_victim) * size >= POLL_MIN_BYTES and not all(on_victim)  # striped over both stores
    victim.kill()
    items = [(loc, buffer.address + (16 << 20) + i * size) for i, loc in enumerate(locations)]
    assert await asyncio.wait_for(client.read(items), timeout=20) == [not dead for dead in on_victim]


async def _equals(awaitable, expected) -> bool:  # type: ignore[no-untyped-def]
    return await awaitable == expected


async def test_put_never_ended_is_revoked_and_space_returns(client: PoolClient, pool: LocalPool) -> None:
    async with grpc.aio.insecure_channel(pool.master_address) as channel:
        stub = pool_pb2_grpc.PoolMasterStub(channel)
        await stub.PutStart(
            pool_pb2.PutStartRequest(items=[pool_pb2.PutItem(key="ns/d/0", group_id="ns/d", group_size=1, size=1 << 20)])
        )
        assert (await stub.Stats(pool_pb2.StatsRequest())).used_bytes == 1 << 20

        async def space_back() -> bool:
            stats = await stub.Stats(pool_pb2.StatsRequest())
            return stats.used_bytes == 0 and stats.revoked_puts == 1 and stats.num_groups == 0

        await eventually(space_back, what="revoke after the 2 s put timeout")


async def test_store_shutdown_unmounts_at_once(client: PoolClient, buffer: HostBuffer, pool: LocalPool) -> None:
    await put_singles(client, buffer, "ns/s", 8)
    before = await client.stats()
    assert pool.stores[0].stop() == 0  # SIGTERM: clean exit
    # the process leaves without the interpreter's teardown (services/cli.py): its last lines are still written
    log = pool.stores[0].log_file.read_text()
    assert "store_stopped" in log, log[-2000:]
    after = await client.stats()  # no TTL wait: the store said goodbye
    assert len(after.segments) == 1
    assert after.num_objects < before.num_objects


async def test_full_pool_reports_not_stored(client: PoolClient, buffer: HostBuffer, pool: LocalPool) -> None:
    # hold every byte with puts in flight, then ask for more: not stored, no exception
    async with grpc.aio.insecure_channel(pool.master_address) as channel:
        stub = pool_pb2_grpc.PoolMasterStub(channel)
        items = [pool_pb2.PutItem(key=f"ns/f{i}/0", group_id=f"ns/f{i}", group_size=1, size=8 << 20) for i in range(2)]
        started = await stub.PutStart(pool_pb2.PutStartRequest(items=items))
        assert [r.status for r in started.results] == [pool_pb2.PUT_STATUS_RESERVED] * 2
        buffer.view(0, 4096)[:] = bytes(4096)
        assert await client.put([PutObject("ns/g/0", "ns/g", 1, buffer.address, 4096)]) == [PutResult.NOT_STORED]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PutStart(pool_pb2.PutStartRequest(items=[
                pool_pb2.PutItem(key="ns/h/0", group_id="ns/h", group_size=1, size=64)]))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await stub.PutRevoke(pool_pb2.PutRevokeRequest(keys=[i.key for i in items]))
    assert await client.put([PutObject("ns/g/0", "ns/g", 1, buffer.address, 4096)]) == [PutResult.STORED]
