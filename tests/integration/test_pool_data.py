"""Bytes in equal bytes out; eviction by whole group in LRU order; puts racing eviction."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvpool.tools.cluster import LocalPool
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject, PutResult
from kvpool.transfer import MAX_IN_FLIGHT, POLL_MIN_BYTES, HostBuffer

pytestmark = pytest.mark.cluster

GROUP = 4  # members per group, as with four pipeline stages


def pattern(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def write_group(buffer: HostBuffer, offset: int, group_id: str, size: int) -> list[PutObject]:
    objects = []
    for m in range(GROUP):
        key = f"{group_id}/{m}"
        start = offset + m * size
        buffer.view(start, size)[:] = pattern(key, size)
        objects.append(PutObject(key, group_id, GROUP, buffer.address + start, size))
    return objects


async def test_bytes_written_equal_bytes_read(client: PoolClient, buffer: HostBuffer) -> None:
    sizes = [1, 63, 64, 4096, 100_000, 1 << 20]
    objects = []
    offset = 0
    for i, size in enumerate(sizes):
        key = f"ns/rt{i}/0"
        buffer.view(offset, size)[:] = pattern(key, size)
        objects.append(PutObject(key, f"ns/rt{i}", 1, buffer.address + offset, size))
        offset += size
    # two batches: each lands on one segment, the second on the emptier one
    assert await client.put(objects[:3]) == [PutResult.STORED] * 3
    assert await client.put(objects[3:]) == [PutResult.STORED] * 3
    assert await client.put(objects[:1]) == [PutResult.EXISTS]

    found = await client.lookup([o.group_id for o in objects])
    assert found.num_complete == len(sizes)
    read_at = 32 << 20
    items, cursor = [], read_at
    for obj, group in zip(objects, found.groups):
        items.append((group.members[obj.key], buffer.address + cursor))
        cursor += obj.size
    buffer.view(read_at, cursor - read_at)[:] = bytes(cursor - read_at)
    assert await client.read(items) == [True] * len(sizes)
    assert bytes(buffer.view(read_at, cursor - read_at)) == bytes(buffer.view(0, offset))
    await client.release(found.lease_id)

    stats = await client.stats()
    assert stats.num_objects == len(sizes)
    assert len(stats.segments) == 2
    assert sorted(seg.num_objects for seg in stats.segments) == [3, 3]  # batches spread over both stores


async def test_corrupted_object_reads_as_a_miss(client: PoolClient, buffer: HostBuffer, engine) -> None:  # type: ignore[no-untyped-def]
    buffer.view(0, 4096)[:] = pattern("c", 4096)
    assert await client.put([PutObject("ns/c/0", "ns/c", 1, buffer.address, 4096)]) == [PutResult.STORED]
    found = await client.lookup(["ns/c"])
    location = found.groups[0].members["ns/c/0"]
    # overwrite the stored bytes behind the master's back
    buffer.view(8192, 4096)[:] = bytes(4096)
    await engine.write(location.endpoint, [buffer.address + 8192], [location.address], [4096])
    assert await client.read([(location, buffer.address + 16384)]) == [False]


def write_singles(buffer: HostBuffer, prefix: str, count: int, size: int) -> list[PutObject]:
    objects = []
    for i in range(count):
        key = f"{prefix}{i}/0"
        buffer.view(i * size, size)[:] = pattern(key, size)
        objects.append(PutObject(key, f"{prefix}{i}", 1, buffer.address + i * size, size))
    return objects


async def test_large_batch_is_verified_object_by_object(client: PoolClient, buffer: HostBuffer, engine) -> None:  # type: ignore[no-untyped-def]
    # past POLL_MIN_BYTES per store each object moves on its own and is verified as it lands
    size, count = 1 << 20, 10
    objects = write_singles(buffer, "ns/big", count, size)
    assert await client.put(objects) == [PutResult.STORED] * count
    found = await client.lookup([o.group_id for o in objects])
    assert found.num_complete == count
    locations = [g.members[o.key] for o, g in zip(objects, found.groups)]
    for endpoint in {loc.endpoint for loc in locations}:
        assert sum(loc.size for loc in locations if loc.endpoint == endpoint) >= POLL_MIN_BYTES
    # overwrite one stored object in the middle behind the master's back
    buffer.view(32 << 20, size)[:] = bytes(size)
    await engine.write(locations[2].endpoint, [buffer.address + (32 << 20)], [locations[2].address], [size])
    read_at = 40 << 20
    buffer.view(read_at, count * size)[:] = bytes(count * size)
    items = [(loc, buffer.address + read_at + i * size) for i, loc in enumerate(locations)]
    assert await client.read(items) == [i != 2 for i in range(count)]
    assert bytes(buffer.view(read_at, 2 * size)) == bytes(buffer.view(0, 2 * size))
    assert bytes(buffer.view(read_at + 3 * size, 7 * size)) == bytes(buffer.view(3 * size, 7 * size))
    await client.release(found.lease_id)


async def test_batch_of_thousands_of_objects_round_trips(client: PoolClient, buffer: HostBuffer) -> None:
    # past ~2k queued transfers per peer the TCP transport rejects some: moves go in windows
    size, count = 1024, 3000
    assert count > 2 * MAX_IN_FLIGHT
    objects = write_singles(buffer, "ns/many", count, size)
    assert await client.put(objects) == [PutResult.STORED] * count
    found = await client.lookup([o.group_id for o in objects])
    assert found.num_complete == count
    read_at = 32 << 20
    buffer.view(read_at, count * size)[:] = bytes(count * size)
    items = [(g.members[o.key], buffer.address + read_at + i * size) for i, (o, g) in enumerate(zip(objects, found.groups))]
    assert await client.read(items) == [True] * count
    assert bytes(buffer.view(read_at, count * size)) == bytes(buffer.view(0, count * size))
    await client.release(found.lease_id)


async def test_filling_past_capacity_evicts_whole_groups_in_lru_order(
    client: PoolClient, buffer: HostBuffer, pool: LocalPool
) -> None:
    size = 128 << 10  # 4 × 128 KiB = 512 KiB a group; pool = 2 × 8 MiB
    stats = await client.stats()
    capacity = stats.capacity_bytes
    num_groups = 3 * capacity // (GROUP * size)
    hot = "ns/lru0"
    max_used = 0
    for g in range(num_groups):
        group_id = f"ns/lru{g}"
        objects = write_group(buffer, 0, group_id, size)
        results = await client.put(objects)
        assert results == [PutResult.STORED] * GROUP, (g, results)
        # keep the first group hot: a lookup touches it
        found = await client.lookup([hot])
        assert found.num_complete == 1
        await client.release(found.lease_id)
        max_used = max(max_used, (await client.stats()).used_bytes)

    stats = await client.stats()
    assert stats.evicted_groups > 0
    assert max_used <= stats.high_watermark * capacity + GROUP * size
    present = []
    for g in range(num_groups):
        keys = [f"ns/lru{g}/{m}" for m in range(GROUP)]
        exists = await client.exists(keys)
        assert len(set(exists)) == 1, f"group {g} is partial: {exists}"
        if exists[0]:
            present.append(g)
    # LRU: the hot group survives; the rest that survive are the most recent ones, in one run
    assert present[0] == 0
    survivors = present[1:]
    assert survivors == list(range(num_groups - len(survivors), num_groups))
    assert stats.num_groups == len(present)


async def test_puts_racing_eviction_never_yield_partial_groups_or_bad_reads(
    client: PoolClient, buffer: HostBuffer
) -> None:
    """Writers put each group's members in separate batches (like separate stages) into a
    pool far too small, while readers look groups up and read them."""
    size = 256 << 10
    num_groups = 48  # 48 × 1 MiB = 3 × the 16 MiB pool
    region = 4 * size * GROUP  # per-writer staging
    partial_seen = 0
    wrong_bytes = 0
    reads_ok = 0
    done = asyncio.Event()

    async def writer(w: int) -> None:
        for g in range(w, num_groups, 2):
            objects = write_group(buffer, w * region, f"ns/race{g}", size)
            for obj in objects:  # one member per batch, like one stage each
                await client.put([obj])

    async def reader(r: int) -> None:
        nonlocal partial_seen, wrong_bytes, reads_ok
        rng = random.Random(r)
        base = (8 + r) * region
        while not done.is_set():
            g = rng.randrange(num_groups)
            found = await client.lookup([f"ns/race{g}"])
            if found.num_complete:
                members = found.groups[0].members
                if len(members) != GROUP:
                    partial_seen += 1
                items = [(loc, buffer.address + base + i * size) for i, loc in enumerate(members.values())]
                verified = await client.read(items)
                for ok, (loc, addr) in zip(verified, items):
                    if ok:
                        reads_ok += 1
                        offset = addr - buffer.address
                        if bytes(buffer.view(offset, size)) != pattern(loc.key, size):
                            wrong_bytes += 1
                await client.release(found.lease_id)
            await asyncio.sleep(0)

    readers = [asyncio.create_task(reader(r)) for r in range(2)]
    await asyncio.gather(writer(0), writer(1))
    done.set()
    await asyncio.gather(*readers)
    stats = await client.stats()
    assert stats.evicted_groups > 0
    assert partial_seen == 0
    assert wrong_bytes == 0
    assert reads_ok > 0
    # a group a lookup calls complete has every member stored, now as during the run
    for g in range(num_groups):
        found = await client.lookup([f"ns/race{g}"])
        if found.num_complete:
            assert await client.exists([f"ns/race{g}/{m}" for m in range(GROUP)]) == [True] * GROUP
            await client.release(found.lease_id)


async def test_a_history_looked_up_again_goes_by_its_handle_and_finds_the_same(
        client: PoolClient, pool: LocalPool, engine, buffer: HostBuffer) -> None:  # type: ignore[no-untyped-def]
    """The second lookup of a history sends the master's handle and only the ids after it; the answer is the
    one every id gets. A master that does not know the handle (here: a client's handle made up) is asked
    again with every id."""
    ids = [f"ns/hist{g}" for g in range(6)]
    for g, group_id in enumerate(ids[:5]):  # the sixth is not stored: every lookup stops before it
        assert await client.put(write_group(buffer, g * GROUP * 256, group_id, 256)) == [PutResult.STORED] * GROUP
    first = await client.lookup(ids[:3])
    await client.release(first.lease_id)
    assert len(client.histories) == 1 and client.histories.take(ids[:2]) == (0, 0)  # only its whole prefix
    plain = PoolClient(pool.master_address, engine)  # no handles: every lookup by ids
    try:
        for held in (0, 2):
            by_handle = await client.lookup(ids, held_prefix=held)
            by_ids = await plain.lookup(ids, held_prefix=held)
            assert (by_handle.num_complete, by_handle.first) == (by_ids.num_complete, by_ids.first) == (5, held)
            assert by_handle.groups == by_ids.groups and len(client.histories) == 1
            await client.release(by_handle.lease_id)
            await plain.release(by_ids.lease_id)
        handle, kept = client.histories.take(ids)
        assert handle and kept == 5
        client.histories.keep(ids[:5], handle ^ 1)  # a handle the master never gave
        again, expected = await client.lookup(ids), await plain.lookup(ids)
        assert again.num_complete == 5 and again.groups == expected.groups and len(client.histories) == 1
        await client.release(again.lease_id)
        await plain.release(expected.lease_id)
    finally:
        await plain.close()
