"""One stage's tensors: its layers, its device KV pages, its staging arenas.

Compute runs on one thread (the stage's "compute stream"); packing and
unpacking KV run on another (the "copy stream"), so a restore for one request
does not queue behind another request's forward pass. All torch work is off
the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
import torch

from kvpool.core.chunk_hash import ChunkHash, group_id, object_key
from kvpool.core.planner import chunks_that_fit, leading_count
from kvpool.model import ModelStage, kv_dtype, pack_kv, unpack_kv
from kvpool.pool.client import ObjectLocation, PoolClient, PutObject, PutResult
from kvpool.transfer import TransferEngine
from services.prefill.arena import Arena, Region
from services.prefill.metrics import PrefillMetrics
from services.prefill.settings import PrefillSettings

log = structlog.get_logger(__name__)


@dataclass(slots=True, frozen=True)
class ChunkToRestore:
    chunk_index: int
    block_id: int
    location: ObjectLocation


@dataclass(slots=True)
class RestoreFigures:
    num_chunks_requested: int
    num_chunks_restored: int = 0
    bytes: int = 0
    read_ms: float = 0.0
    unpack_ms: float = 0.0


class StageRunner:
    """Owns the stage's model layers, KV pages and arenas (see module doc)."""

    def __init__(
        self, settings: PrefillSettings, engine: TransferEngine, pool: PoolClient | None, metrics: PrefillMetrics
    ) -> None:
        torch.set_num_threads(settings.torch_threads)
        self.settings = settings
        self.config = settings.model_config()
        start, end = settings.layers
        self.model = ModelStage(self.config, start, end, weights=settings.weights or None)
        self.kv_cache = self.model.allocate_kv_cache(settings.num_blocks, settings.chunk_size,
                                                     kv_dtype(settings.kv_dtype))
        self.engine = engine
        self.pool = pool
        self.metrics = metrics
        self.namespace = settings.namespace
        self.chunk_nbytes = settings.chunk_nbytes
        kv_bytes = settings.num_blocks * self.chunk_nbytes
        # a request never restores or saves more than the device cache holds
        self.restore_arena = Arena("restore", kv_bytes, engine)
        self.save_arena = Arena("save", kv_bytes, engine)
        max_tokens = min(self.config.max_position_embeddings, settings.device_cache_tokens)
        activation_bytes = 2 * max_tokens * self.config.hidden_size * 4
        self.send_arena = Arena("send", activation_bytes, engine)
        self.recv_arena = Arena("recv", activation_bytes, engine)
        if pool is not None:
            for arena in (self.restore_arena, self.save_arena):
                pool.register(arena.buffer.address, arena.size)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"stage{settings.stage}-compute")
        self._copy = ThreadPoolExecutor(1, thread_name_prefix=f"stage{settings.stage}-copy")
        # saves in flight, oldest first, with the save-arena region each holds
        self._saves: dict[asyncio.Task[None], Region] = {}

    def close(self) -> None:
        self._compute.shutdown(wait=False, cancel_futures=True)
        self._copy.shutdown(wait=False, cancel_futures=True)

    # ---- restore --------------------------------------------------------

    async def restore(self, chunks: Sequence[ChunkToRestore]) -> RestoreFigures:
        """Read this stage's objects of the given chunks and unpack them into
        their blocks; only the leading chunks that all arrived and verified
        count. Never raises for pool trouble: a failed chunk ends the run."""
        figures = RestoreFigures(len(chunks))
        if not chunks or self.pool is None:
            return figures
        size = self.chunk_nbytes
        count = leading_count(c.location.size == size for c in chunks)  # a wrong size ends the run (recomputed)
        count = chunks_that_fit(count, size, self.restore_arena.largest_free, self.restore_arena.alignment)
        region = self.restore_arena.allocate(count * size) if count else None
        if region is None:
            return figures
        try:
            t0 = time.perf_counter()
            verified = await self.pool.read([(c.location, region.address + i * size) for i, c in enumerate(chunks[:count])])
            figures.read_ms = (time.perf_counter() - t0) * 1e3
            restored = leading_count(verified)
            if restored:
                t1 = time.perf_counter()
                await asyncio.get_running_loop().run_in_executor(
                    self._copy, self._unpack, region, [c.block_id for c in chunks[:restored]]
                )
                figures.unpack_ms = (time.perf_counter() - t1) * 1e3
            figures.num_chunks_restored = restored
            figures.bytes = restored * size
        finally:
            self.restore_arena.free(region)
        return figures

    def _unpack(self, region, block_ids: list[int]) -> None:  # type: ignore[no-untyped-def]
        size = self.chunk_nbytes
        for i, block_id in enumerate(block_ids):
            unpack_kv(self.kv_cache, [block_id], 0, self.restore_arena.tensor(region, i * size, size))

    # ---- compute --------------------------------------------------------

    async def forward(self, inputs: torch.Tensor, block_table: Sequence[int], compute_start: int) -> torch.Tensor:
        """This stage's layers on tokens [compute_start, compute_start + n)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._compute, self.model.forward, inputs, self.kv_cache, list(block_table), compute_start
        )

    # ---- save -----------------------------------------------------------

    async def pack_for_save(
        self, block_table: Sequence[int], first_chunk: int, chunk_hashes: Sequence[ChunkHash]
    ) -> None:
        """Copy the chunks to save out of the pages now (so the pages may be
        reused as soon as the request is released), then put them in the
        background. A full pool means "not stored".

        Newest wins: when the save arena has no room, the oldest saves in
        flight are given up (superseded) until this one fits, so a save stuck
        on the pool never makes a newer one wait or be dropped.
        """
        if self.pool is None or not chunk_hashes:
            return
        size = self.chunk_nbytes
        region = self.save_arena.allocate(len(chunk_hashes) * size)
        while region is None and self._saves:
            self._supersede(next(iter(self._saves)))
            region = self.save_arena.allocate(len(chunk_hashes) * size)
        if region is None:  # cannot happen: the arena holds the whole device cache
            self._skipped("arena_full", len(chunk_hashes))
            return
        block_ids = [block_table[first_chunk + i] for i in range(len(chunk_hashes))]
        await asyncio.get_running_loop().run_in_executor(self._copy, self._pack, region, block_ids)
        task = asyncio.create_task(self._put(region, list(chunk_hashes)))
        self._saves[task] = region
        task.add_done_callback(self._save_done)

    def _supersede(self, task: asyncio.Task[None]) -> None:
        """Give an older save up and take its region back now.

        Safe while its bytes are still moving: a put commits only after its
        transfer and checksum both ended, and a cancelled put never commits,
        so what it left in the store is revoked by the master's put timeout.
        """
        region = self._saves.pop(task)
        task.cancel()
        self.save_arena.free(region)
        self._skipped("superseded", region.size // self.chunk_nbytes)
        log.info("save_superseded", bytes=region.size)

    def _save_done(self, task: asyncio.Task[None]) -> None:
        region = self._saves.pop(task, None)
        if region is not None:  # not superseded: its region is still ours to free
            self.save_arena.free(region)

    def _skipped(self, reason: str, num_chunks: int) -> None:
        self.metrics.saves_skipped.labels(reason).inc(num_chunks)

    def _pack(self, region, block_ids: list[int]) -> None:  # type: ignore[no-untyped-def]
        size = self.chunk_nbytes
        for i, block_id in enumerate(block_ids):
            pack_kv(self.kv_cache, [block_id], 0, self.settings.chunk_size,
                    out=self.save_arena.tensor(region, i * size, size))

    async def _put(self, region, chunk_hashes: list[ChunkHash]) -> None:  # type: ignore[no-untyped-def]
        assert self.pool is not None
        size, stage, ns = self.chunk_nbytes, self.settings.stage, self.namespace
        try:
            objects = [
                PutObject(object_key(ns, h, stage), group_id(ns, h), self.settings.num_stages,
                          region.address + i * size, size)
                for i, h in enumerate(chunk_hashes)
            ]
            results = await self.pool.put(objects)
            self._count(results)
        except Exception:  # a save is best effort: never take the stage down
            log.exception("save_failed", chunks=len(chunk_hashes))
            self._skipped("failed", len(chunk_hashes))

    def _count(self, results: Sequence[PutResult]) -> None:
        stored = results.count(PutResult.STORED)
        exists = results.count(PutResult.EXISTS)
        self.metrics.saves_stored.labels("stored").inc(stored)
        self.metrics.saves_stored.labels("exists").inc(exists)
        if stored + exists < len(results):
            self._skipped("not_stored", len(results) - stored - exists)
            log.info("chunks_not_stored", stored=stored, exists=exists, total=len(results))

    async def drain_saves(self) -> None:
        """Wait for background saves (tests and shutdown)."""
        while self._saves:
            await asyncio.gather(*list(self._saves), return_exceptions=True)

