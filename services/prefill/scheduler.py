"""Stage 0's scheduler: hash the prompt, plan device → pool → compute, restore
on every stage, run the pipeline, hold the KV until released.

The block manager (one block table for all stages) and the planner are pure
cores; this module does the I/O around them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
import torch

from kvpool.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable, status_errors
from kvpool.pool.client import LookupResult, PoolClient
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from services.prefill.block_manager import BlockManager, NoFreeBlocks
from services.prefill.chunk_hash import ChunkHash, chunk_hashes, group_id, object_key
from services.prefill.metrics import PrefillMetrics
from services.prefill.planner import RestorePlan, max_hit_chunks, plan_restore
from services.prefill.stage_runner import ChunkToRestore, RestoreFigures, StageRunner
from services.prefill.stage_servicer import ActivationLink, figures_message, run_stage

log = structlog.get_logger(__name__)

RESTORE_TIMEOUT_S = 60.0
MAX_SESSION_ID_BYTES = 256


@dataclass(slots=True)
class Outcome:
    plan: RestorePlan
    num_restored_chunks: int
    restore: list[prefill_pb2.StageRestoreFigures] = field(default_factory=list)
    restore_wait_ms: float = 0.0
    lookup_ms: float = 0.0


class PrefillScheduler:
    """Admits prefills against the device cache and runs them through all stages."""

    def __init__(
        self, runner: StageRunner, link: ActivationLink, stages: Sequence[prefill_pb2_grpc.PrefillStageStub],
        pool: PoolClient | None, metrics: PrefillMetrics,
    ) -> None:
        self.runner = runner
        self.link = link
        self.stages = list(stages)  # stages 1..N-1
        self.pool = pool
        self.metrics = metrics
        self.settings = runner.settings
        self.config = runner.config
        self.namespace = runner.namespace
        self.chunk_size = self.settings.chunk_size
        self.blocks = BlockManager(self.settings.num_blocks, self.chunk_size)
        self.held: dict[str, float] = {}
        self._freed = asyncio.Condition()

    # ---- the request path ----------------------------------------------

    def validate(self, token_ids: Sequence[int], session_id: str) -> None:
        if not token_ids:
            raise InvalidArgument("token_ids: must not be empty")
        vocab = self.config.vocab_size
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= vocab:
            bad = next(i for i, t in enumerate(token_ids) if not 0 <= t < vocab)
            raise InvalidArgument(f"token_ids[{bad}]: {token_ids[bad]} is outside the vocabulary 0..{vocab - 1}")
        context = self.config.max_position_embeddings
        if len(token_ids) > context:
            raise InvalidArgument(f"token_ids: {len(token_ids)} tokens exceed the model's context of {context}")
        needed = self.blocks.num_blocks_needed(len(token_ids))
        if needed > self.blocks.num_blocks:
            raise InvalidArgument(
                f"token_ids: {len(token_ids)} tokens need {needed} device blocks; the device cache holds "
                f"{self.blocks.num_blocks} ({self.blocks.num_blocks * self.chunk_size} tokens)"
            )
        if len(session_id.encode()) > MAX_SESSION_ID_BYTES:
            raise InvalidArgument(f"session_id: longer than {MAX_SESSION_ID_BYTES} bytes")

    async def prefill(self, token_ids: Sequence[int], session_id: str, return_logits: bool) -> prefill_pb2.PrefillResponse:
        self.validate(token_ids, session_id)
        started = time.perf_counter()
        request_id = uuid.uuid4().hex
        num_tokens = len(token_ids)
        hashes = chunk_hashes(self.namespace, token_ids, self.chunk_size)
        limit = min(len(hashes), max_hit_chunks(num_tokens, self.chunk_size))
        num_device, block_table = await self._admit(request_id, hashes, num_tokens, limit)
        bound = structlog.get_logger(__name__).bind(request_id=request_id, session_id=session_id)
        work = asyncio.ensure_future(
            self._run(request_id, token_ids, hashes, num_device, limit, block_table, return_logits)
        )
        try:
            # shielded: if the caller goes away, the stages are still writing this
            # request's pages, so its blocks go back only once they are done
            outcome, result, compute_start, compute_ms = await asyncio.shield(work)
        except asyncio.CancelledError:
            bound.info("prefill_cancelled")
            work.add_done_callback(lambda task: self._free_after(task, request_id))
            raise
        except BaseException:
            await self._free(request_id)
            raise
        self.held[request_id] = time.monotonic() + self.settings.kv_hold_s
        figures = prefill_pb2.PrefillFigures(
            num_prompt_tokens=num_tokens,
            num_device_tokens=num_device * self.chunk_size,
            num_pool_tokens=outcome.num_restored_chunks * self.chunk_size,
            num_computed_tokens=num_tokens - compute_start,
            num_pool_chunks_lost=outcome.plan.num_pool_chunks - outcome.num_restored_chunks,
            restore=outcome.restore,
            restore_wait_ms=outcome.restore_wait_ms,
            compute_ms=compute_ms,
            lookup_ms=outcome.lookup_ms,
            total_ms=(time.perf_counter() - started) * 1e3,
            stage_compute_ms=list(result.stage_compute_ms),
        )
        self.metrics.observe(figures, self.blocks.usage)
        bound.info("prefill_done", tokens=num_tokens, device=figures.num_device_tokens, pool=figures.num_pool_tokens,
                   computed=figures.num_computed_tokens, lost_chunks=figures.num_pool_chunks_lost,
                   total_ms=round(figures.total_ms, 1))
        return prefill_pb2.PrefillResponse(
            first_token=result.first_token, kv_handle=request_id, logits=result.logits, figures=figures,
            block_table=block_table, block_size=self.chunk_size, kv_hold_s=self.settings.kv_hold_s,
        )

    async def _run(
        self, request_id: str, token_ids: Sequence[int], hashes: list[ChunkHash], num_device: int, limit: int,
        block_table: list[int], return_logits: bool,
    ) -> tuple[Outcome, prefill_pb2.ForwardResponse, int, float]:
        """Restore on every stage, then compute through all stages; returns what the figures need."""
        num_tokens = len(token_ids)
        outcome = await self._restore(request_id, hashes, num_tokens, num_device, limit, block_table)
        compute_start = (num_device + outcome.num_restored_chunks) * self.chunk_size
        save_first = compute_start // self.chunk_size
        forward = prefill_pb2.ForwardRequest(
            request_id=request_id, block_table=block_table, compute_start=compute_start, num_tokens=num_tokens,
            save_first_chunk=save_first, save_chunk_hashes=hashes[save_first:], return_logits=return_logits,
        )
        inputs = torch.tensor(token_ids[compute_start:], dtype=torch.int64)
        t0 = time.perf_counter()
        result = await run_stage(self.runner, self.link, forward, inputs, block_table)
        compute_ms = (time.perf_counter() - t0) * 1e3
        self.blocks.commit_chunks(request_id, save_first, hashes[save_first:])
        return outcome, result, compute_start, compute_ms

    def _free_after(self, task: asyncio.Future[object], request_id: str) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.info("cancelled_prefill_failed", request_id=request_id, error=str(task.exception()))
        asyncio.ensure_future(self._free(request_id))

    async def _admit(
        self, request_id: str, hashes: list[ChunkHash], num_tokens: int, limit: int
    ) -> tuple[int, list[int]]:
        """Take device blocks (device hits are ref'd first), waiting while others hold them."""
        deadline = time.monotonic() + self.settings.admission_timeout_s
        async with self._freed:
            while True:
                num_device = self.blocks.match_prefix(hashes[:limit])
                try:
                    return num_device, self.blocks.allocate(request_id, hashes, num_tokens, num_device)
                except NoFreeBlocks as exc:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ResourceExhausted(
                            f"device cache: {exc}; {len(self.held)} requests hold KV (release their handles)"
                        ) from None
                    try:
                        await asyncio.wait_for(self._freed.wait(), remaining)
                    except TimeoutError:
                        pass

    async def _restore(
        self, request_id: str, hashes: list[ChunkHash], num_tokens: int, num_device: int, limit: int,
        block_table: list[int],
    ) -> Outcome:
        lookup: LookupResult | None = None
        lookup_ms = 0.0
        if self.pool is not None and num_device < limit:
            t0 = time.perf_counter()
            lookup = await self.pool.lookup([group_id(self.namespace, h) for h in hashes[num_device:limit]])
            lookup_ms = (time.perf_counter() - t0) * 1e3
        num_pool = lookup.num_complete if lookup is not None else 0
        plan = plan_restore(num_tokens, self.chunk_size, len(hashes), num_device, num_pool)
        outcome = Outcome(plan, 0, lookup_ms=lookup_ms)
        if lookup is None:
            return outcome
        try:
            if plan.num_pool_chunks:
                await self._restore_on_stages(request_id, hashes, plan, lookup, block_table, outcome)
        finally:
            await self.pool.release(lookup.lease_id)  # type: ignore[union-attr]
        if outcome.num_restored_chunks:
            self.blocks.commit_chunks(request_id, num_device, hashes[num_device:num_device + outcome.num_restored_chunks])
        return outcome

    async def _restore_on_stages(
        self, request_id: str, hashes: list[ChunkHash], plan: RestorePlan, lookup: LookupResult,
        block_table: list[int], outcome: Outcome,
    ) -> None:
        """Every stage reads its own objects at once; a prefix counts only as far as all stages got it."""
        per_stage: list[list[ChunkToRestore]] = []
        for stage in range(self.settings.num_stages):
            chunks = []
            for i, chunk_index in enumerate(plan.pool_chunk_range):
                location = lookup.groups[i].members.get(object_key(self.namespace, hashes[chunk_index], stage))
                if location is None:
                    break  # cannot happen for a complete group; stay safe
                chunks.append(ChunkToRestore(chunk_index, block_table[chunk_index], location))
            per_stage.append(chunks)
        t0 = time.perf_counter()
        results = await asyncio.gather(
            self._restore_local(per_stage[0]),
            *(self._restore_remote(stage, request_id, per_stage[stage]) for stage in range(1, len(per_stage))),
        )
        outcome.restore_wait_ms = (time.perf_counter() - t0) * 1e3
        outcome.restore = list(results)
        outcome.num_restored_chunks = min(r.num_chunks_restored for r in results)

    async def _restore_local(self, chunks: list[ChunkToRestore]) -> prefill_pb2.StageRestoreFigures:
        figures: RestoreFigures = await self.runner.restore(chunks)
        return figures_message(0, figures)

    async def _restore_remote(
        self, stage: int, request_id: str, chunks: list[ChunkToRestore]
    ) -> prefill_pb2.StageRestoreFigures:
        request = prefill_pb2.RestoreRequest(request_id=request_id, chunks=[
            prefill_pb2.RestoreChunk(chunk_index=c.chunk_index, block_id=c.block_id, endpoint=c.location.endpoint,
                                     address=c.location.address, size=c.location.size,
                                     checksum=c.location.checksum, key=c.location.key)
            for c in chunks
        ])
        try:
            response = await self.stages[stage - 1].Restore(request, timeout=RESTORE_TIMEOUT_S)
            return response.figures
        except grpc.aio.AioRpcError as exc:
            # a stage that cannot restore makes those chunks computed, not the request failed
            log.warning("stage_restore_failed", stage=stage, code=exc.code().name, details=exc.details())
            return prefill_pb2.StageRestoreFigures(stage=stage, num_chunks_requested=len(chunks))

    # ---- holding KV -----------------------------------------------------

    async def release(self, kv_handle: str) -> None:
        if self.held.pop(kv_handle, None) is None:
            raise NotFound(f"kv_handle: {kv_handle!r} is unknown or already released")
        await self._free(kv_handle)

    async def _free(self, request_id: str) -> None:
        self.blocks.free(request_id)
        async with self._freed:
            self._freed.notify_all()

    async def expire_held_forever(self, interval_s: float = 1.0) -> None:
        while True:
            now = time.monotonic()
            for request_id in [r for r, deadline in self.held.items() if deadline <= now]:
                del self.held[request_id]
                await self._free(request_id)
                log.info("kv_released_after_timeout", request_id=request_id, hold_s=self.settings.kv_hold_s)
            await asyncio.sleep(interval_s)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """The front of the pipeline; UNAVAILABLE until the later stages have been checked."""

    def __init__(self) -> None:
        self.scheduler: PrefillScheduler | None = None

    def _ready(self) -> PrefillScheduler:
        if self.scheduler is None:
            raise Unavailable("prefill: stage 0 is still waiting for the later stages")
        return self.scheduler

    @status_errors
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        return await self._ready().prefill(list(request.token_ids), request.session_id, request.return_logits)

    @status_errors
    async def Release(self, request: prefill_pb2.ReleaseRequest, context: Any) -> prefill_pb2.ReleaseResponse:
        await self._ready().release(request.kv_handle)
        return prefill_pb2.ReleaseResponse(released=True)
