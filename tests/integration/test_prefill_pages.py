"""Restore and save straight between a stage's KV pages and the pool.

Real master, stores and transfer engine; four stage runners of the tiny model
in this process (their pages can be compared byte for byte). A restore must
land exactly the bytes a computation from scratch wrote, in exactly the
blocks it targets, for every layer of every stage, and touch nothing else;
a chunk that did not fully arrive and verify never counts as restored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch

from kvpool.core.chunk_hash import chunk_hashes, group_id, object_key
from kvpool.tools.cluster import LocalPool
from kvpool.model import get_config
from kvpool.model.kv_cache import block_bytes, pack_kv
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import ObjectLocation
from kvpool.transfer import HostBuffer, TransferEngine
from kvpool.services.prefill.metrics import PrefillMetrics
from kvpool.services.prefill.settings import PrefillSettings
from kvpool.services.prefill.stage_runner import ChunkToRestore, StageRunner

pytestmark = pytest.mark.cluster

CHUNK = 16
NUM_BLOCKS = 12
NUM_STAGES = 4
NUM_CHUNKS = 5
TOKENS = NUM_CHUNKS * CHUNK + 7  # 5 full chunks and a partial one
SOURCE_TABLE = [0, 1, 2, 3, 4, 5]
TARGET_TABLE = [9, 3, 7, 0, 11, 5]  # other blocks, other order


def settings(stage: int, master: str, kv_dtype: str) -> PrefillSettings:
    return PrefillSettings(
        stage=stage, num_stages=NUM_STAGES, master=master, chunk_size=CHUNK, kv_dtype=kv_dtype,
        device_cache_tokens=NUM_BLOCKS * CHUNK, port=0, admin_port=0,
        stage_addresses=[f"unused:{i}" for i in range(1, NUM_STAGES)] if stage == 0 else [],
        next_stage="unused:0" if 0 < stage < NUM_STAGES - 1 else "",
    )


class Pipeline:
    """Four stage runners sharing one engine, each with its own pool client."""

    def __init__(self, master: str, engine: TransferEngine, kv_dtype: str) -> None:
        self.clients = [PoolClient(master, engine) for _ in range(NUM_STAGES)]
        self.runners = [StageRunner(settings(s, master, kv_dtype), engine, c, PrefillMetrics())
                        for s, c in enumerate(self.clients)]

    async def compute(self, token_ids: list[int], table: list[int]) -> torch.Tensor:
        x = torch.tensor(token_ids)
        for runner in self.runners:
            x = await runner.forward(x, table, 0)
        return x

    async def close(self) -> None:
        for runner, client in zip(self.runners, self.clients):
            runner.close()
            await client.close()


@pytest.fixture
async def pool(tmp_path) -> AsyncIterator[LocalPool]:  # type: ignore[no-untyped-def]
    with LocalPool(num_stores=2, segment_size="16MiB", workdir=tmp_path) as local:
        yield local


@pytest.fixture(params=["float32", "float8_e4m3fn"])
async def computed_and_saved(request, pool: LocalPool, engine: TransferEngine):  # type: ignore[no-untyped-def]
    """A prompt computed from scratch on one pipeline and saved from its pages; a fresh second pipeline."""
    source = Pipeline(pool.master_address, engine, request.param)
    target = Pipeline(pool.master_address, engine, request.param)
    token_ids = [(7 * i + 3) % get_config("tiny").vocab_size for i in range(TOKENS)]
    await source.compute(token_ids, SOURCE_TABLE)
    namespace = source.runners[0].namespace
    hashes = chunk_hashes(namespace, token_ids, CHUNK)
    for runner in source.runners:
        runner.start_save("a", SOURCE_TABLE, 0, hashes)
    for runner in source.runners:
        figures = await runner.save_done("a")
        assert (figures.num_stored, figures.bytes) == (NUM_CHUNKS, NUM_CHUNKS * runner.chunk_nbytes)
    try:
        yield source, target, namespace, hashes
    finally:
        await source.close()
        await target.close()


async def locations(client: PoolClient, namespace: str, hashes: list[str]) -> list[dict[str, ObjectLocation]]:
    found = await client.lookup([group_id(namespace, h) for h in hashes])
    await client.release(found.lease_id)
    assert found.num_complete == len(hashes)
    return [g.members for g in found.groups]


def to_restore(members: list[dict[str, ObjectLocation]], namespace: str, hashes: list[str],
               stage: int) -> list[ChunkToRestore]:
    return [ChunkToRestore(i, TARGET_TABLE[i], members[i][object_key(namespace, h, stage)])
            for i, h in enumerate(hashes)]


async def test_restore_lands_the_computed_bytes_in_the_target_blocks_only(computed_and_saved) -> None:  # type: ignore[no-untyped-def]
    source, target, namespace, hashes = computed_and_saved
    members = await locations(target.clients[0], namespace, hashes)
    for stage, (src, dst) in enumerate(zip(source.runners, target.runners)):
        figures = await dst.restore(to_restore(members, namespace, hashes, stage))
        assert (figures.num_chunks_restored, figures.bytes) == (NUM_CHUNKS, NUM_CHUNKS * dst.chunk_nbytes)
        # every layer of every restored chunk: the same bytes at the same (token, entry) slots
        for i in range(NUM_CHUNKS):
            assert torch.equal(block_bytes(dst.kv_cache, TARGET_TABLE[i]), block_bytes(src.kv_cache, SOURCE_TABLE[i]))
        assert torch.equal(pack_kv(dst.kv_cache, TARGET_TABLE, 0, NUM_CHUNKS * CHUNK),
                           pack_kv(src.kv_cache, SOURCE_TABLE, 0, NUM_CHUNKS * CHUNK))
        # no other block was written (the pages start zeroed)
        untouched = [b for b in range(NUM_BLOCKS) if b not in TARGET_TABLE[:NUM_CHUNKS]]
        assert all(not block_bytes(dst.kv_cache, b).any() for b in untouched)
    # and computing the partial chunk over the restored pages equals computing it over the computed ones
    token_ids = [(7 * i + 3) % get_config("tiny").vocab_size for i in range(TOKENS)]
    tail = torch.tensor(token_ids[NUM_CHUNKS * CHUNK:])
    x_src, x_dst = tail, tail
    for src, dst in zip(source.runners, target.runners):
        x_src = await src.forward(x_src, SOURCE_TABLE, NUM_CHUNKS * CHUNK)
        x_dst = await dst.forward(x_dst, TARGET_TABLE, NUM_CHUNKS * CHUNK)
    assert torch.equal(x_dst, x_src)


async def test_a_chunk_that_fails_mid_batch_ends_what_counts_as_restored(  # type: ignore[no-untyped-def]
    computed_and_saved, engine: TransferEngine
) -> None:
    source, target, namespace, hashes = computed_and_saved
    members = await locations(target.clients[0], namespace, hashes)
    # stage 1: chunk 2's object is overwritten in the store behind the master's back
    bad = members[2][object_key(namespace, hashes[2], 1)]
    junk = HostBuffer(bad.size)
    engine.register(junk.address, junk.size)
    junk.view()[:] = b"\x5a" * junk.size
    try:
        await engine.write(bad.endpoint, [junk.address], [bad.address], [junk.size])
    finally:
        engine.unregister(junk.address)  # the session's engine outlives this buffer
    figures = await target.runners[1].restore(to_restore(members, namespace, hashes, 1))
    assert (figures.num_chunks_restored, figures.bytes) == (2, 2 * target.runners[1].chunk_nbytes)
    # stage 3: chunk 1's group was evicted and its space reused: its location no longer verifies
    chunks = to_restore(members, namespace, hashes, 3)
    stale = chunks[1].location
    chunks[1] = ChunkToRestore(1, TARGET_TABLE[1], ObjectLocation(stale.key, stale.endpoint, stale.address,
                                                                  stale.size, stale.checksum ^ 1))
    figures = await target.runners[3].restore(chunks)
    assert (figures.num_chunks_restored, figures.bytes) == (1, target.runners[3].chunk_nbytes)
    # stage 2: an object of the wrong size is not read at all, nor anything after it
    chunks = to_restore(members, namespace, hashes, 2)
    short = chunks[3].location
    chunks[3] = ChunkToRestore(3, TARGET_TABLE[3], ObjectLocation(short.key, short.endpoint, short.address,
                                                                  short.size - 1, short.checksum))
    figures = await target.runners[2].restore(chunks)
    assert figures.num_chunks_restored == 3
    assert not block_bytes(target.runners[2].kv_cache, TARGET_TABLE[3]).any()
    assert not block_bytes(target.runners[2].kv_cache, TARGET_TABLE[4]).any()
    # what counted is byte-exact
    for stage, count in ((1, 2), (3, 1), (2, 3)):
        src, dst = source.runners[stage], target.runners[stage]
        for i in range(count):
            assert torch.equal(block_bytes(dst.kv_cache, TARGET_TABLE[i]), block_bytes(src.kv_cache, SOURCE_TABLE[i]))
