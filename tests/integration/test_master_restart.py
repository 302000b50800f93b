"""A master killed with -9 and started again keeps the pool: stores' block reports.

Real processes: a master, two stores and the pool client with the transfer
engine. Committed groups come back without a put or a byte copied; a put in
flight at the crash never does; a group with members in two stores comes
back only once both have reported; a store restarted with a new segment
brings back nothing.
"""

from __future__ import annotations

import grpc
import pytest

from kvpool import service
from kvpool.tools.cluster import LocalPool
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import GroupLocation, PutObject, PutResult
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool.transfer import HostBuffer
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

KB = 1024
MEMBERS = 4
READ_AT = 32 << 20  # reads land in the upper half of the shared buffer


def fill(buffer: HostBuffer, offset: int, size: int, seed: int) -> None:
    buffer.view(offset, size)[:] = bytes((seed * 7 + j) % 251 for j in range(256)) * (size // 256)


async def put_groups(client: PoolClient, buffer: HostBuffer, prefix: str, count: int, start: int = 0) -> list[str]:
    """``count`` groups of four 4 KiB members in one batch; bytes differ per member."""
    size = 4 * KB
    objects = []
    for g in range(count):
        for m in range(MEMBERS):
            offset = (start + g * MEMBERS + m) * size
            fill(buffer, offset, size, start + g * MEMBERS + m)
            objects.append(PutObject(f"{prefix}{g}/{m}", f"{prefix}{g}", MEMBERS, buffer.address + offset, size))
    assert await client.put(objects) == [PutResult.STORED] * len(objects)
    return [f"{prefix}{g}" for g in range(count)]


async def read_verifies(client: PoolClient, buffer: HostBuffer, groups: list[GroupLocation]) -> bool:
    items = [(loc, buffer.address + READ_AT + i * loc.size)
             for i, loc in enumerate(m for g in groups for m in g.members.values())]
    return all(await client.read(items))


async def stats(client: PoolClient) -> pool_pb2.StatsResponse:
    return await client.stats()


async def all_acked(client: PoolClient) -> bool:
    """Every store holds the record of every committed object in its segment."""
    s = await client.stats()
    return len(s.segments) == 2 and all(seg.acked_sequence == seg.sequence for seg in s.segments)


async def hits(client: PoolClient, group_id: str) -> int:
    """Complete groups a lookup of one group finds (its lease released at once)."""
    found = await client.lookup([group_id])
    await client.release(found.lease_id)
    return found.num_complete


async def mounted(client: PoolClient, count: int) -> bool:
    try:
        return len((await client.stats()).segments) == count
    except grpc.aio.AioRpcError:
        return False  # the master is still starting


def endpoints_of(group: GroupLocation) -> set[str]:
    return {m.endpoint for m in group.members.values()}


async def test_master_kill_keeps_committed_groups_of_both_stores(
    client: PoolClient, buffer: HostBuffer, pool: LocalPool
) -> None:
    # two batches: the second goes to the emptier store, so both hold groups
    groups = await put_groups(client, buffer, "ns/a", 6)
    groups += await put_groups(client, buffer, "ns/b", 6, start=6 * MEMBERS)
    # a group with members in both stores: its first member goes to store X,
    # then X is filled (below the high watermark overall), so the second spills to Y
    size = 64 * KB
    fill(buffer, 0, size, 1)
    span = [PutObject(f"ns/span/{m}", "ns/span", 2, buffer.address, size) for m in range(2)]
    assert await client.put(span[:1]) == [PutResult.STORED]
    x = next(s for s in (await client.stats()).segments if s.num_objects == 6 * MEMBERS + 1)
    # Y (the emptier) takes 1 MiB, then X is the emptier and takes all it has left
    fillers = [PutObject("ns/fill1/0", "ns/fill1", 1, buffer.address + (16 << 20), 1 << 20),
               PutObject("ns/fill2/0", "ns/fill2", 1, buffer.address + (18 << 20), x.capacity_bytes - x.used_bytes)]
    for filler in fillers:
        assert await client.put([filler]) == [PutResult.STORED]
    assert await client.put(span[1:]) == [PutResult.STORED]
    found = await client.lookup([*groups, "ns/span"])
    assert found.num_complete == 13
    spanning = found.groups[12]
    assert len(endpoints_of(spanning)) == 2
    assert all(len(endpoints_of(g)) == 1 for g in found.groups[:12])  # members follow the group
    assert (await client.stats()).evicted_groups == 0
    await client.release(found.lease_id)
    await eventually(lambda: all_acked(client), what="stores hold every record")
    num_objects = (await client.stats()).num_objects
    assert num_objects == 12 * MEMBERS + 4

    async with grpc.aio.insecure_channel(pool.master_address, options=service.GRPC_OPTIONS) as channel:
        stub = pool_pb2_grpc.PoolMasterStub(channel)
        # a put in flight at the crash: reserved and written, never ended
        started = await stub.PutStart(pool_pb2.PutStartRequest(
            items=[pool_pb2.PutItem(key="ns/x/0", group_id="ns/x", group_size=1, size=4 * KB)]))
        assert started.results[0].status == pool_pb2.PUT_STATUS_RESERVED

        paused = next(s for s in pool.stores if s.ready["endpoint"] != next(iter(endpoints_of(found.groups[0]))))
        assert pool.master is not None
        pool.master.kill()
        paused.pause()  # this store cannot report until it is resumed
        try:
            pool.start_master()
            await eventually(lambda: mounted(client, 1), what="the running store re-mounted")
            assert 0 < sum(paused.ready["endpoint"] in endpoints_of(g) for g in found.groups) < 13
            for g in found.groups:
                hit = await hits(client, g.group_id)
                on_paused = paused.ready["endpoint"] in endpoints_of(g)
                assert hit == (0 if on_paused else 1), g.group_id  # the spanning group waits for both reports
        finally:
            paused.resume()
        await eventually(lambda: mounted(client, 2), what="the resumed store re-mounted")

        after = await client.lookup([*groups, "ns/span"])
        assert after.num_complete == 13
        # the very same locations: no byte was copied
        assert [(g.group_id, g.members) for g in after.groups] == [(g.group_id, g.members) for g in found.groups]
        assert await read_verifies(client, buffer, after.groups)
        await client.release(after.lease_id)
        s = await client.stats()
        assert s.adopted_objects == num_objects and s.rejected_records == 0 and s.num_objects == num_objects
        assert (await client.exists(["ns/x/0"])) == [False]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PutEnd(pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key="ns/x/0", checksum=1)]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    # evicting or removing after the restart reaches the stores too: a second restart keeps only what is left
    assert await client.remove(["ns/a0"]) == (1, [])
    await eventually(lambda: all_acked(client), what="stores forgot the removed group")
    assert pool.master is not None
    pool.master.kill()
    pool.start_master()
    await eventually(lambda: mounted(client, 2), what="stores re-mounted")
    assert (await client.lookup(groups)).num_complete == 0  # ns/a0 is gone: the prefix stops there
    assert (await client.lookup(groups[1:])).num_complete == 11
    assert (await client.stats()).num_objects == num_objects - MEMBERS


async def test_store_restarted_with_a_new_segment_brings_back_nothing(
    client: PoolClient, buffer: HostBuffer, pool: LocalPool
) -> None:
    groups = await put_groups(client, buffer, "ns/a", 4)
    groups += await put_groups(client, buffer, "ns/b", 4, start=4 * MEMBERS)
    found = await client.lookup(groups)
    assert found.num_complete == 8
    await client.release(found.lease_id)
    await eventually(lambda: all_acked(client), what="stores hold every record")
    victim = pool.stores[1]
    on_victim = {g.group_id for g in found.groups if victim.ready["endpoint"] in endpoints_of(g)}
    assert 0 < len(on_victim) < 8

    assert pool.master is not None
    pool.master.kill()
    victim.kill()
    pool.start_master()
    # the same segment id, a new process: new memory, nothing to report
    pool.add_store("store1-again", ["--segment-id", victim.ready["segment_id"]]).wait_ready()
    await eventually(lambda: mounted(client, 2), what="both stores mounted")
    for group_id in groups:
        hit = await hits(client, group_id)
        assert hit == (0 if group_id in on_victim else 1), group_id
    s = await client.stats()
    assert s.adopted_objects == (8 - len(on_victim)) * MEMBERS
    assert s.num_objects == s.adopted_objects


async def test_a_session_stream_the_master_ended_leaves_no_task_behind(pool: LocalPool) -> None:
    """The master dies under an open ``Session`` stream: the client's next calls fail (a miss for the pool
    client) and nothing is left pending in the loop. grpc.aio's pump of the stream's writes outlived an ended
    call, and was destroyed pending with "aclose(): asynchronous generator is already running" errors."""
    import asyncio
    import gc

    from kvpool.pool.session_client import MasterSession

    reported: list[str] = []

    def leaked(_: object, context: dict) -> None:  # the leak's two signatures, not grpc's other noise
        # (a test process binds grpc's poller to each test's loop: its wakeups then raise a harmless
        # BlockingIOError in loops that lost the race, grpc/grpc#25364)
        message, exc = str(context.get("message")), context.get("exception")
        if "destroyed but it is pending" in message or "already running" in str(exc):
            reported.append(f"{message} {exc!r}")

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(leaked)
    channel = service.channel(pool.master_address)
    stub = pool_pb2_grpc.PoolMasterStub(channel)
    session = MasterSession(channel, stub)
    missing = pool_pb2.ReleaseLeaseRequest(lease_id=1 << 62)
    try:
        assert (await session.call("release_lease", missing, stub.ReleaseLease, timeout=10)).released is False
        assert pool.master is not None
        pool.master.kill()
        for _ in range(2):  # the broken stream, then a new one that cannot connect
            with pytest.raises(grpc.aio.AioRpcError):
                await session.call("release_lease", missing, stub.ReleaseLease, timeout=5)
        for _ in range(3):
            gc.collect()  # what is left pending and unreferenced is reported as it is destroyed
            await asyncio.sleep(0.1)
    finally:
        await session.close()
        await channel.close()
        loop.set_exception_handler(None)
    assert reported == []
