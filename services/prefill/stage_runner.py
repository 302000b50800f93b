"""One stage's tensors: its layers, its KV pages (registered with the transfer
engine, when the stage runs one), its activation arenas; restore into and save
from the pages.

The send arena is shared memory (``--shared-memory``) the next stage on this
host maps; the receive arena, for hidden states read with the engine, exists
only with an engine. A stage without one (``--no-transfer-engine``) registers
nothing and moves pool bytes by memory only (``PoolClient`` without an engine).

The whole KV cache is registered with the engine once, at start-up (host
memory here; device memory on a GPUDirect host, the engine build being the
install option). Its layout is block-major (``kvpool.model.kv_cache``): one
block is one chunk of all this stage's layers, byte for byte the chunk's pool
object. So a restore reads each object straight into the block its chunk
occupies and a save writes straight from it: no staging copy, no pack or
unpack loop. Pool objects and the cache share one dtype (the namespace
fingerprints it), so no conversion, and no staging arena, is ever needed.

Invariants the caller (stage 0's core) keeps: a restore only targets blocks
private to its request (``BlockManager.is_private``), and a block a save
reads from stays referenced until that save ended (``BlockManager.hold``,
released after ``save_done`` on every stage).

Compute runs on one thread per tenant (its "compute lane"): a tenant's
pieces run one at a time in the order they came, and different tenants'
pieces run at once, sharing the cores as the OS shares runnable threads
(equally). So a tenant's short turn never waits behind another tenant's
piece already computing (a 2,048-token piece at a 30K context takes seconds
on a CPU), and a tenant alone runs exactly as on one thread. The first 16
tenants a stage sees get a lane each, later ones share one
(``kvpool.core.tenancy.tenants.TenantLabels``); ``--no-tenant-fair``: one
thread for all, in arrival order. The engine's moves run in
worker threads, so a restore for one request does not queue behind another
request's forward pass. All torch work is off the event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
import torch

from kvpool.core.chunk_hash import ChunkHash, group_id, object_key
from kvpool.core.errors import DeviceCacheLost
from kvpool.core.pool.paths import SegmentAccess
from kvpool.core.prefill.planner import leading_count
from kvpool.core.prefill.work_scale import WorkScale
from kvpool.core.tenancy.shares import tenant_name
from kvpool.core.tenancy.tenants import TenantLabels
from kvpool.model import ModelStage, kv_dtype
from kvpool.model.kv_cache import block_address, block_nbytes, kv_cache_nbytes
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import ObjectLocation, PutObject, PutResult, ReadStatus
from kvpool.transfer import HostBuffer, TransferEngine
from kvpool.services.prefill.arena import Arena
from kvpool.services.prefill.metrics import PrefillMetrics
from kvpool.core.prefill.restore_figures import RestoreFigures
from kvpool.services.prefill.settings import PrefillSettings

log = structlog.get_logger(__name__)

# finished saves nobody asked about (stage 0 gone) are forgotten past this many
MAX_FINISHED_SAVES = 1024


@dataclass(slots=True, frozen=True)
class ChunkToRestore:
    chunk_index: int
    block_id: int
    location: ObjectLocation


@dataclass(frozen=True, slots=True)
class StageRestore:
    """One stage's part of a request's restore: its objects of the planned chunks, and how to reach the
    segments they lie in (as the master told stage 0)."""

    chunks: tuple[ChunkToRestore, ...] = ()
    accesses: tuple[SegmentAccess, ...] = ()


@dataclass(slots=True)
class SaveFigures:
    num_stored: int = 0
    num_exists: int = 0
    num_not_stored: int = 0
    bytes: int = 0
    put_ms: float = 0.0


class StageRunner:
    """Owns the stage's model layers, KV pages and activation arenas (see module doc)."""

    def __init__(
        self, settings: PrefillSettings, engine: TransferEngine | None, pool: PoolClient | None,
        metrics: PrefillMetrics,
    ) -> None:
        torch.set_num_threads(settings.torch_threads)
        self.settings = settings
        self.config = settings.model_config()
        start, end = settings.layers
        self.model = ModelStage(self.config, start, end, weights=settings.weights or settings.model_dir or None)
        dtype = kv_dtype(settings.kv_dtype)
        nbytes = kv_cache_nbytes(self.config, end - start, settings.num_blocks, settings.chunk_size, dtype)
        self._kv_memory: HostBuffer | None = None
        storage = None
        if self.model.device.type == "cpu":
            # our own mmap: huge pages, and an address the engine can register
            self._kv_memory = HostBuffer(nbytes)
            storage = torch.frombuffer(self._kv_memory.view(), dtype=torch.uint8)
        self.kv_cache = self.model.allocate_kv_cache(settings.num_blocks, settings.chunk_size, dtype, storage)
        self.engine = engine
        self.pool = pool
        self.metrics = metrics
        self.namespace = settings.namespace
        self.chunk_nbytes = settings.chunk_nbytes
        if block_nbytes(self.kv_cache) != self.chunk_nbytes:
            raise ValueError(f"a block holds {block_nbytes(self.kv_cache)} bytes, a chunk object {self.chunk_nbytes}")
        # the pages are where pool bytes land and leave from (and the handoff's source)
        if pool is not None:
            pool.register(self.kv_cache.data_ptr(), nbytes)
        elif engine is not None:
            engine.register(self.kv_cache.data_ptr(), nbytes)
        activation_bytes = settings.activation_arena_bytes
        self.send_arena = Arena("send", activation_bytes, engine, shared=settings.shared_memory)
        # hidden states the engine reads land here; without an engine every read is a copy into its tensor
        self.recv_arena = Arena("recv", activation_bytes, engine) if engine is not None else None
        # one compute thread per tenant (the module doc); the first 16 tenants keep their own
        self._lanes: dict[str, ThreadPoolExecutor] = {}
        self._lane_names = TenantLabels()
        self._busy_lock = threading.Lock()
        self._busy = 0  # pieces computing now, on any lane
        self._starts = 0  # pieces started so far (a piece ran alone if none started while it ran)
        # this host's speed against the work estimates' (the gate's and the router's orders and budgets)
        self.work_scale = WorkScale()
        metrics.work_scale.set_function(lambda: self.work_scale.factor)
        # each request's save, from start until stage 0 asked for its end (save_done)
        self._saves: dict[str, asyncio.Task[SaveFigures]] = {}
        # blocks whose KV this process wrote (restored or computed): a stage that
        # restarted has none, and must not compute over blocks stage 0 calls cached
        self._written = bytearray(settings.num_blocks)

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        # the engine outlives us (tests): a later mapping at these addresses must register anew
        if self.engine is not None:
            self.engine.unregister(self.kv_cache.data_ptr())
        self.send_arena.close()
        if self.recv_arena is not None:
            self.recv_arena.close()

    def block_address(self, block_id: int) -> int:
        return block_address(self.kv_cache, block_id)

    # ---- restore --------------------------------------------------------

    async def restore(self, chunks: Sequence[ChunkToRestore]) -> RestoreFigures:
        """Read this stage's objects of the given chunks straight into their blocks.

        Only the leading chunks that all arrived and verified count; a block
        past them may hold part of an object, and is recomputed over (it is
        private to the request). Never raises for pool trouble.
        """
        figures = RestoreFigures(len(chunks))
        if not chunks or self.pool is None:
            return figures
        size = self.chunk_nbytes
        count = leading_count(c.location.size == size for c in chunks)  # a wrong size ends the run (recomputed)
        if not count:
            return figures
        t0 = time.perf_counter()
        statuses = await self.pool.read_checked([(c.location, self.block_address(c.block_id))
                                                 for c in chunks[:count]])
        figures.read_ms = (time.perf_counter() - t0) * 1e3
        figures.num_chunks_restored = leading_count(s is ReadStatus.VERIFIED for s in statuses)
        figures.corrupt_chunk_indexes = [c.chunk_index for c, s in zip(chunks, statuses) if s is ReadStatus.CORRUPT]
        if figures.corrupt_chunk_indexes:
            self.metrics.corrupt_objects.inc(len(figures.corrupt_chunk_indexes))
        for c in chunks[:figures.num_chunks_restored]:
            self._written[c.block_id] = 1
        figures.bytes = figures.num_chunks_restored * size
        self.metrics.restored_bytes.inc(figures.bytes)
        self.metrics.restore_seconds.observe(figures.read_ms / 1e3)
        return figures

    # ---- compute --------------------------------------------------------

    def _lane(self, tenant: str) -> ThreadPoolExecutor:
        """The tenant's compute thread (its label's: the first 16 tenants each their own; one for all with
        ``--no-tenant-fair``)."""
        name = self._lane_names.label(tenant_name(tenant)) if self.settings.tenant_fair else ""
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = ThreadPoolExecutor(
                1, thread_name_prefix=f"stage{self.settings.stage}-compute-{len(self._lanes)}")
        return lane

    async def forward(self, inputs: torch.Tensor, block_table: Sequence[int], compute_start: int,
                      on_piece: Callable[[int, int], None] | None = None,
                      on_output: Callable[[torch.Tensor, int, int], None] | None = None,
                      tenant: str = "") -> torch.Tensor:
        """This stage's layers on tokens [compute_start, compute_start + n), in pieces, on ``tenant``'s lane.

        A piece ends at a multiple of ``forward_piece_tokens``; once it has, its
        KV is final and ``on_piece(start, end)`` is called (the handoff streams it),
        then ``on_output(hidden, start, end)`` with its output (the next stage's
        piece). Every request runs the same pieces, so its output does not
        depend on when its KV is handed off or how it travels on.
        """
        self.check_cached(block_table, compute_start)
        loop = asyncio.get_running_loop()
        lane = self._lane(tenant)
        piece, size = self.settings.forward_piece_tokens, self.settings.chunk_size
        end = compute_start + inputs.shape[0]
        outputs = []
        start = compute_start
        while start < end:
            stop = min(end, (start // piece + 1) * piece)
            piece_inputs = inputs[start - compute_start: stop - compute_start]
            if stop - start <= self.settings.inline_forward_tokens and not self._busy:
                # nothing else computes: a short piece costs less here than the compute thread's two wake-ups
                out, seconds, alone = self._timed_forward(piece_inputs, list(block_table), start)
            else:
                out, seconds, alone = await loop.run_in_executor(
                    lane, self._timed_forward, piece_inputs, list(block_table), start)
            if alone:  # (one sharing the cores with another lane's would read this host as slower)
                self.work_scale.observe_piece(start, stop, seconds)
            for block_id in block_table[start // size:-(-stop // size)]:
                self._written[block_id] = 1
            outputs.append(out)
            if on_piece is not None:
                on_piece(start, stop)
            if on_output is not None:
                on_output(out, start, stop)
            start = stop
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _timed_forward(self, inputs: torch.Tensor, block_table: list[int],
                       start: int) -> tuple[torch.Tensor, float, bool]:
        """On a compute lane: the piece's forward, its time there (not its wait for the thread), and whether it
        ran alone (no other lane computed meanwhile)."""
        with self._busy_lock:
            self._busy += 1
            self._starts += 1
            started, alone = self._starts, self._busy == 1
        t0 = time.perf_counter()
        try:
            out = self.model.forward(inputs, self.kv_cache, block_table, start)
            return out, time.perf_counter() - t0, alone and self._starts == started
        finally:
            with self._busy_lock:
                self._busy -= 1

    def check_cached(self, block_table: Sequence[int], compute_start: int) -> None:
        """Every block holding tokens before ``compute_start`` must hold KV this process wrote."""
        num_cached_blocks = -(-compute_start // self.settings.chunk_size)
        missing = [b for b in block_table[:num_cached_blocks] if not self._written[b]]
        if missing:
            raise DeviceCacheLost(
                f"stage {self.settings.stage}: {len(missing)} of {num_cached_blocks} cached blocks were never "
                f"written by this process (it restarted); the pipeline's device cache must be dropped"
            )

    # ---- save -----------------------------------------------------------

    def start_save(
        self, request_id: str, block_table: Sequence[int], first_chunk: int, chunk_hashes: Sequence[ChunkHash],
        tenant: str = "",
    ) -> None:
        """Put ``tenant``'s chunks to the pool straight from their blocks, in the background.

        Nothing is copied, so nothing can be dropped for want of staging
        space; the blocks must stay unused until ``save_done`` (stage 0 holds
        them). A full or unreachable pool means "not stored", at once.
        """
        if self.pool is None or not chunk_hashes or request_id in self._saves:
            return
        size, stage, ns = self.chunk_nbytes, self.settings.stage, self.namespace
        objects = [
            PutObject(object_key(ns, h, stage), group_id(ns, h), self.settings.num_stages,
                      self.block_address(block_table[first_chunk + i]), size)
            for i, h in enumerate(chunk_hashes)
        ]
        if len(self._saves) >= MAX_FINISHED_SAVES:
            for done in [r for r, t in self._saves.items() if t.done()]:
                del self._saves[done]
        self._saves[request_id] = asyncio.create_task(self._put(objects, tenant))

    async def write_told(self, restore: StageRestore) -> tuple[SaveFigures, list[tuple[str, int]]]:
        """Write this stage's objects of a save stage 0 reserved (``restore``'s chunks: each block and where its
        object goes) straight from their blocks: what was written and each one's checksum. Stage 0 commits
        them with every other stage's in one call, and counts them; a write that failed is left out (stage 0
        gives its reservation back). A chunk whose size is not this stage's object size is not written."""
        figures = SaveFigures()
        if self.pool is None or not restore.chunks:
            figures.num_not_stored = len(restore.chunks)
            return figures, []
        self.pool.learn(restore.accesses)
        chunks = [c for c in restore.chunks if c.location.size == self.chunk_nbytes]
        t0 = time.perf_counter()
        try:
            sums = await self.pool.write([(self.block_address(c.block_id), c.location) for c in chunks])
        except Exception:  # a save is best effort: never take the stage down
            log.exception("save_failed", chunks=len(chunks))
            sums = [None] * len(chunks)
        figures.put_ms = (time.perf_counter() - t0) * 1e3
        written = [(c.location.key, s) for c, s in zip(chunks, sums) if s is not None]
        figures.num_stored = len(written)
        figures.num_not_stored = len(restore.chunks) - len(written)
        figures.bytes = len(written) * self.chunk_nbytes
        if written:  # its bytes and time; stage 0 counts what was stored, for every stage
            self.metrics.saved_bytes.inc(figures.bytes)
            self.metrics.save_seconds.observe(figures.put_ms / 1e3)
        return figures, written

    async def save_done(self, request_id: str) -> SaveFigures:
        """Wait for a request's save to end (at once if it had none) and forget it."""
        task = self._saves.get(request_id)
        if task is None:
            return SaveFigures()
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._saves.pop(request_id, None)

    async def _put(self, objects: list[PutObject], tenant: str) -> SaveFigures:
        assert self.pool is not None
        figures = SaveFigures()
        t0 = time.perf_counter()
        try:
            results = await self.pool.put(objects, tenant)
        except Exception:  # a save is best effort: never take the stage down
            log.exception("save_failed", chunks=len(objects))
            self.metrics.saves_skipped.labels("failed").inc(len(objects))
            figures.num_not_stored = len(objects)
            return figures
        figures.put_ms = (time.perf_counter() - t0) * 1e3
        figures.num_stored = results.count(PutResult.STORED)
        figures.num_exists = results.count(PutResult.EXISTS)
        figures.num_not_stored = len(results) - figures.num_stored - figures.num_exists
        figures.bytes = figures.num_stored * self.chunk_nbytes
        self.metrics.saves_stored.labels("stored").inc(figures.num_stored)
        self.metrics.saves_stored.labels("exists").inc(figures.num_exists)
        if figures.num_stored:
            self.metrics.saved_bytes.inc(figures.bytes)
            self.metrics.save_seconds.observe(figures.put_ms / 1e3)
        if figures.num_not_stored:
            self.metrics.saves_skipped.labels("not_stored").inc(figures.num_not_stored)
            log.info("chunks_not_stored", stored=figures.num_stored, exists=figures.num_exists,
                     total=len(results))
        return figures

    async def drain_saves(self) -> None:
        """Wait for background saves (tests and shutdown)."""
        await asyncio.gather(*list(self._saves.values()), return_exceptions=True)
