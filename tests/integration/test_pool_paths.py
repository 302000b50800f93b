"""The pool's two byte paths on real stores (issue 36): a store on the client's host is mapped and copied, the
transfer engine moves the rest, and the host the segment declares decides which, never a socket that happens to
connect. Bytes are equal either way and every read is verified."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvpool.core.pool.paths import BytePath
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject, PutResult, ReadStatus
from kvpool.tools.cluster import LocalPool
from kvpool.transfer import HostBuffer, TransferEngine
from tests.integration.conftest import listening_ports

pytestmark = pytest.mark.cluster

SIZE = 256 << 10
COUNT = 8


async def round_trip(client: PoolClient, buffer: HostBuffer, prefix: str) -> None:
    """Put COUNT objects, read them back elsewhere in the buffer: equal bytes, every read verified."""
    objects = []
    for i in range(COUNT):
        buffer.view(i * SIZE, SIZE)[:] = random.Random(f"{prefix}{i}").randbytes(SIZE)
        objects.append(PutObject(f"{prefix}/g{i}/0", f"{prefix}/g{i}", 1, buffer.address + i * SIZE, SIZE))
    assert await client.put(objects) == [PutResult.STORED] * COUNT
    found = await client.lookup([o.group_id for o in objects])
    assert found.num_complete == COUNT
    read_at = 16 << 20
    items = [(g.members[o.key], buffer.address + read_at + i * SIZE) for i, (o, g) in enumerate(zip(objects, found.groups))]
    buffer.view(read_at, COUNT * SIZE)[:] = bytes(COUNT * SIZE)
    assert await client.read_checked(items) == [ReadStatus.VERIFIED] * COUNT
    assert bytes(buffer.view(read_at, COUNT * SIZE)) == bytes(buffer.view(0, COUNT * SIZE))
    await client.release(found.lease_id)


def moved(client: PoolClient, path: BytePath) -> tuple[int, int]:
    return client.bytes_by_path[(path.value, "write")], client.bytes_by_path[(path.value, "read")]


async def test_a_store_on_this_host_is_reached_by_memory(pool: LocalPool, engine: TransferEngine,
                                                         buffer: HostBuffer) -> None:
    client = PoolClient(pool.master_address, engine)
    client.register(buffer.address, buffer.size)
    try:
        await round_trip(client, buffer, "mem")
        assert moved(client, BytePath.MEMORY) == (COUNT * SIZE, COUNT * SIZE)
        assert moved(client, BytePath.ENGINE) == (0, 0)
        assert client.maps.mapped_bytes > 0
    finally:
        await client.close()
    assert client.maps.mapped_bytes == 0  # closing unmaps


async def test_engine_only_moves_every_byte_by_the_engine(pool: LocalPool, engine: TransferEngine,
                                                          buffer: HostBuffer) -> None:
    client = PoolClient(pool.master_address, engine, engine_only=True)
    client.register(buffer.address, buffer.size)
    try:
        await round_trip(client, buffer, "eng")
        assert moved(client, BytePath.ENGINE) == (COUNT * SIZE, COUNT * SIZE)
        assert moved(client, BytePath.MEMORY) == (0, 0)
        assert client.maps.mapped_bytes == 0
    finally:
        await client.close()


async def test_a_client_of_another_declared_host_uses_the_engine(pool: LocalPool, engine: TransferEngine,
                                                                 buffer: HostBuffer) -> None:
    # the stores' socket is right there on this kernel; the declared host still decides
    client = PoolClient(pool.master_address, engine, host_name="some-other-host")
    client.register(buffer.address, buffer.size)
    try:
        await round_trip(client, buffer, "far")
        assert moved(client, BytePath.ENGINE) == (COUNT * SIZE, COUNT * SIZE)
        assert moved(client, BytePath.MEMORY) == (0, 0)
    finally:
        await client.close()


async def test_a_restarted_store_is_never_read_through_its_old_memory(pool: LocalPool, engine: TransferEngine,
                                                                      buffer: HostBuffer) -> None:
    client = PoolClient(pool.master_address, engine)
    client.register(buffer.address, buffer.size)
    try:
        await round_trip(client, buffer, "old")
        found = await client.lookup([f"old/g{i}" for i in range(COUNT)])
        items = [(next(iter(g.members.values())), buffer.address + (32 << 20) + i * SIZE)
                 for i, g in enumerate(found.groups)]
        for store in pool.stores:
            store.kill()
        # the stores are dead: their memory is nobody's, every read is a miss, nothing crashes
        assert await client.read_checked(items) == [ReadStatus.NOT_READ] * COUNT
        assert client.maps.mapped_bytes == 0
    finally:
        await client.close()


async def test_a_segment_out_of_this_process_reach_goes_by_the_engine(pool: LocalPool, engine: TransferEngine,
                                                                      buffer: HostBuffer) -> None:
    # same declared host, but the socket is not where this process looks (another container's /run, say):
    # the moves go by the engine instead of missing
    scout = PoolClient(pool.master_address, engine)
    scout.register(buffer.address, buffer.size)
    try:
        await round_trip(scout, buffer, "scout")  # a batch lands on one segment, the next on the emptier one:
        await round_trip(scout, buffer, "scout2")  # both learn where each store's socket is
    finally:
        await scout.close()
    hidden = sorted({Path(a.shared.socket_path) for a in scout.accesses.values() if a.shared is not None})
    assert len(hidden) == len(pool.stores)
    for path in hidden:
        path.rename(path.with_suffix(".hidden"))
    client = PoolClient(pool.master_address, engine)
    client.register(buffer.address, buffer.size)
    try:
        await round_trip(client, buffer, "reach")
        assert moved(client, BytePath.ENGINE) == (COUNT * SIZE, COUNT * SIZE)
        assert moved(client, BytePath.MEMORY) == (0, 0)
    finally:
        for path in hidden:
            path.with_suffix(".hidden").rename(path)
        await client.close()


async def test_without_an_engine_same_host_moves_work_and_others_fail_as_misses(pool: LocalPool,
                                                                                 buffer: HostBuffer) -> None:
    # a one-host cluster opens no engine: its stores are all reached by memory
    client = PoolClient(pool.master_address, None)
    client.register(buffer.address, buffer.size)
    try:
        await round_trip(client, buffer, "noengine")
        assert moved(client, BytePath.MEMORY) == (COUNT * SIZE, COUNT * SIZE)
    finally:
        await client.close()
    far = PoolClient(pool.master_address, None, host_name="some-other-host")
    far.register(buffer.address, buffer.size)
    try:  # nothing reaches the stores from "another host" without an engine: not stored, nothing raised
        objects = [PutObject("far/g0/0", "far/g0", 1, buffer.address, SIZE)]
        assert await far.put(objects) == [PutResult.NOT_STORED]
        assert moved(far, BytePath.ENGINE) == (0, 0)
    finally:
        await far.close()
    with pytest.raises(ValueError, match="^engine_only: "):
        PoolClient(pool.master_address, None, engine_only=True)


async def test_a_store_without_an_engine_opens_no_engine_port_and_serves_by_memory(tmp_path: Path,
                                                                                   buffer: HostBuffer) -> None:
    with LocalPool(num_stores=1, segment_size="8MiB", workdir=tmp_path, store_args=["--no-transfer-engine"]) as pool:
        store = pool.stores[0]
        assert store.ready["endpoint"] == ""
        assert listening_ports(store.proc.pid) == {store.ready["port"], store.ready["admin_port"]}
        client = PoolClient(pool.master_address, None)
        client.register(buffer.address, buffer.size)
        try:
            await round_trip(client, buffer, "portless")
            assert moved(client, BytePath.MEMORY) == (COUNT * SIZE, COUNT * SIZE)
        finally:
            await client.close()
