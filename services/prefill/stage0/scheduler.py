"""Stage 0's scheduler: hash the prompt, plan device → pool → compute, restore
on every stage, run the pipeline (every stage streams its KV, the last stage
also the final logits, into decode's reserved region as its forward passes
them), collect the handoff's figures, free the blocks.

Every decision is the core's: the block manager (one block table for all
stages), the hit planner and the request's life (``kvpool.core``). This
module does the I/O around them; the restore from the pool is
``pool_restore.py``, the stages' handoff and save ends ``stage_ends.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from kvpool.core.admission import retry as retry_policy
from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import chunk_hashes, hash_root
from kvpool.core.errors import (
    DeviceCacheLost,
    FailedPrecondition,
    InvalidArgument,
    RestoreFellShort,
    Unavailable,
)
from kvpool.core.prefill.queue_settings import queue_order
from kvpool.core.prefill.request import Phase, PrefillRequest, try_admit
from kvpool.core.sessions.table import SessionId
from kvpool.core.tenancy.shares import MAX_TENANT_BYTES, TenantShares, tenant_name
from kvpool.pool.client import PoolClient
from kvpool.request_id import new_request_id
from kvpool.core.handoff.target import HandoffFigures, HandoffTarget
from kvpool.core.prefill.stage_forward import StageForward, StageForwardResult
from kvpool.services.prefill.handoff import HandoffMetrics, StageHandoff
from kvpool.services.prefill.stage0.gate import PrefillGate
from kvpool.services.prefill.metrics import GatePopsCollector, PrefillMetrics
from kvpool.services.prefill.stage0.pool_restore import ChainRestore, PoolRestore, RestoreReport
from kvpool.services.prefill.stage0.prefill_result import PrefillFigures, PrefillResult
from kvpool.services.prefill.stage0.prefetch import PrefetchMetrics, SessionPrefetcher
from kvpool.services.prefill.stage0.stage_clients import StageClient
from kvpool.services.prefill.stage0.stage_ends import StageEnds
from kvpool.services.prefill.stage_runner import StageRunner
from kvpool.services.prefill.pieces import ActivationLink
from kvpool.services.prefill.forward import run_stage

log = structlog.get_logger(__name__)

MAX_SESSION_KEY_BYTES = 256


def save_holder(request_id: str) -> str:
    """The block manager's holder id of a request's save (its blocks' extra reference)."""
    return f"{request_id}/save"


@dataclass(slots=True)
class RunResult:
    restore: RestoreReport
    forward: StageForwardResult
    compute_ms: float
    handoff: HandoffFigures | None = None


class PrefillScheduler:
    """Admits prefills against the device cache and runs them through all stages.

    The decisions are the core's (``PrefillRequest``, ``try_admit``); this
    class does the I/O between them. A request's blocks are its own only
    while its Prefill runs: they are freed when it returns, however it ends.
    """

    def __init__(
        self, runner: StageRunner, link: ActivationLink, stages: Sequence[StageClient],
        pool: PoolClient | None, metrics: PrefillMetrics, handoff: StageHandoff, handoff_metrics: HandoffMetrics,
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
        self.blocks = BlockManager(self.settings.num_blocks, self.chunk_size,
                                   TenantShares.parse(self.settings.tenant_weights))
        self.restorer = PoolRestore(runner, self.stages, pool, self.blocks)
        self.handoff = handoff
        self.ends = StageEnds(runner, handoff, handoff_metrics, self.stages)
        self._freed = asyncio.Condition()
        self._releases: set[asyncio.Task[None]] = set()
        self._releasing: dict[str, asyncio.Task[None]] = {}  # by request id
        # the gate (--sched-slots) in --sched's order; session-aware prefill: retention by session, staging
        order = queue_order(self.settings)
        self.gate = (PrefillGate(self.settings.sched_slots, self.settings.sched_max_wait_s, order,
                                 self.settings.sched_max_bypass_s, self.settings.sched_reorder_below_s)
                     if self.settings.sched_slots else None)
        if self.gate is not None:
            metrics.registry.register(GatePopsCollector(self.gate.queue))
        self.prefetcher = SessionPrefetcher(self, PrefetchMetrics(metrics.registry),
                                            runner.chunk_nbytes * self.settings.num_stages)

    # ---- the request path ----------------------------------------------

    def validate(self, token_ids: Sequence[int], session_key: str, tenant: str = "", cache_salt: str = "") -> None:
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
        if len(session_key.encode()) > MAX_SESSION_KEY_BYTES:
            raise InvalidArgument(f"session_key: longer than {MAX_SESSION_KEY_BYTES} bytes")
        # a tenant is a key of the pool's and the device cache's shares, and a metric label
        for name, value, limit in (("tenant", tenant, MAX_TENANT_BYTES), ("cache_salt", cache_salt, MAX_SESSION_KEY_BYTES)):
            if len(value.encode()) > limit:
                raise InvalidArgument(f"{name}: longer than {limit} bytes")

    async def prefill(self, token_ids: Sequence[int], session_key: str, return_logits: bool,
                      request_id: str = "", tenant: str = "", cache_salt: str = "",
                      target: HandoffTarget | None = None) -> PrefillResult:
        """Prefill under ``request_id`` (the caller's, else a fresh one); with ``target``, hand the KV off."""
        self.validate(token_ids, session_key, tenant, cache_salt)
        request_id = request_id or new_request_id("prefill")
        # a request's blocks (in flight) and its save's hold are keyed by its id
        if self.blocks.has_holder(request_id) or self.blocks.has_holder(save_holder(request_id)):
            raise FailedPrecondition(f"request_id: {request_id!r} is in use on this pipeline")
        if target is not None:  # checked before any work: a bad target costs nothing
            self.handoff.check(target, len(token_ids), self.config.vocab_size)
        started = time.perf_counter()
        hashes = chunk_hashes(hash_root(self.namespace, tenant, cache_salt), token_ids, self.chunk_size)
        bound = log.bind(request_id=request_id, session_key=session_key)
        session = SessionId(tenant_name(tenant), session_key) if session_key else None
        work_s = self.prefetcher.work_s(hashes, len(token_ids), session)
        self.prefetcher.turn_started(session)
        # the session's cached blocks were touched: a block event (kvpool simulate --validate follows it)
        bound.debug("prefill_arrived")
        queued = True
        try:
            async with self.gate.slot(request_id, work_s, session) if self.gate else contextlib.nullcontext():
                queued = False
                if self.gate is not None:
                    self.metrics.gate_wait.observe(time.perf_counter() - started)
                return await self._prefill(request_id, token_ids, hashes, session, return_logits, tenant, target,
                                           started, bound)
        except asyncio.CancelledError:
            if queued:  # the caller went away while it waited for a slot of the gate: nothing was taken
                self._cancelled(bound, "queued")
            raise
        finally:
            self.prefetcher.turn_ended(session, hashes)

    def _cancelled(self, bound: Any, phase: str) -> None:
        """The caller went away (cancelled, or its deadline passed) while its request was in ``phase``."""
        bound.info("prefill_cancelled", phase=phase)
        self.metrics.cancelled.labels(phase).inc()

    async def _prefill(self, request_id: str, token_ids: Sequence[int], hashes: list[Any], session: SessionId | None,
                       return_logits: bool, tenant: str, target: HandoffTarget | None,
                       started: float, bound: Any) -> PrefillResult:
        use_pool, replans = True, 0
        for attempt in range(1, retry_policy.MAX_REPLANS + 2):
            request = PrefillRequest(request_id, len(token_ids), self.chunk_size, hashes, tenant=tenant_name(tenant),
                                     session=session)
            try:
                await self._admit(request)
            except asyncio.CancelledError:  # while it waited for device blocks: none were taken
                self._cancelled(bound, "admission")
                raise
            # the admission order (kvpool simulate --validate replays the simulator in it)
            bound.info("prefill_admitted", attempt=attempt, tokens=request.num_tokens)
            self.prefetcher.admitted(request)
            work = asyncio.ensure_future(
                self._run(request, token_ids, return_logits, target, tenant, use_pool))
            try:
                # shielded: if the caller goes away, the stages are still writing this
                # request's pages, so its blocks go back only once they are done
                run = await asyncio.shield(work)
            except asyncio.CancelledError:
                self._cancelled(bound, "running")
                # its blocks go back once the stages are done with them, not before
                work.add_done_callback(lambda task: self._free_after(task, request.request_id))
                raise
            except (DeviceCacheLost, RestoreFellShort) as exc:
                # the core's policy (kvpool.core.admission.retry): a later stage restarted and the cache was
                # forgotten (run_stage dropped it), planned again with no device hit; or a stage could not
                # restore what the forward was planned past, planned again without the pool
                if isinstance(exc, RestoreFellShort):
                    self.metrics.restores_fell_short.inc()
                await self.free(request.request_id)
                release = self._releasing.get(request.request_id)
                if release is not None:
                    await asyncio.shield(release)  # the first attempt's saves let go of its blocks
                how = retry_policy.replan(exc, replans)
                if how is None:
                    raise Unavailable(f"prefill: {exc}") from None
                replans += 1
                use_pool = use_pool and how is not retry_policy.Replan.WITHOUT_POOL
                bound.info("prefill_planned_again", reason=str(exc), how=how.value)
                continue
            except BaseException:
                await self.free(request.request_id)
                raise
            break
        await self.free(request.request_id)  # nothing is held after Prefill returns
        figures = PrefillFigures(
            num_prompt_tokens=request.num_tokens,
            num_device_tokens=request.num_device_tokens,
            num_pool_tokens=request.num_pool_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_pool_chunks_lost=request.num_pool_chunks_lost,
            restore=tuple(run.restore.stages),
            restore_wait_ms=run.restore.wait_ms,
            compute_ms=run.compute_ms,
            lookup_ms=run.restore.lookup_ms,
            total_ms=(time.perf_counter() - started) * 1e3,
            stage_compute_ms=tuple(run.forward.stage_compute_ms),
        )
        self.metrics.observe(figures, self.blocks.usage)
        if request.num_pool_tokens:
            self.prefetcher.observe_restore(request.num_pool_tokens // self.chunk_size, run.restore.wait_ms / 1e3)
        bound.info("prefill_done", tokens=request.num_tokens, device=figures.num_device_tokens,
                   pool=figures.num_pool_tokens, computed=figures.num_computed_tokens,
                   lost_chunks=figures.num_pool_chunks_lost, total_ms=round(figures.total_ms, 1))
        return PrefillResult(
            first_token=run.forward.first_token, request_id=request.request_id,
            logits=run.forward.logits if return_logits else b"", figures=figures,
            block_table=tuple(request.block_table), block_size=self.chunk_size, handoff=run.handoff,
        )

    async def _run(self, request: PrefillRequest, token_ids: Sequence[int], return_logits: bool,
                   target: HandoffTarget | None, tenant: str = "", use_pool: bool = True) -> RunResult:
        """Restore on every stage (on the forward's chain, or by Restore calls to older stages), compute through
        all stages (streaming into decode's region), collect the handoff."""
        chain: ChainRestore | None = None
        if all(s.restore_on_chain for s in self.stages):
            restore, chain = await self.restorer.begin_on_chain(request, use_pool)
        else:
            restore = await self.restorer.restore(request, use_pool)
        forward = StageForward(
            request_id=request.request_id, block_table=tuple(request.block_table),
            compute_start=request.compute_start, num_tokens=request.num_tokens,
            save_first_chunk=request.save_first_chunk, save_chunk_hashes=tuple(request.chunks_to_save),
            return_logits=return_logits, tenant=tenant, target=target,
        )
        inputs = torch.tensor(token_ids[request.compute_start:], dtype=torch.int64)
        saving = self.pool is not None and bool(forward.save_chunk_hashes)
        if saving:
            # every stage's put reads these pages: they are not reused until all puts ended
            self.blocks.hold(save_holder(request.request_id), request.save_block_ids)
        t0 = time.perf_counter()
        try:
            try:
                result = await run_stage(self.runner, self.link, forward, inputs, self.handoff,
                                         chain.local if chain is not None else None,
                                         tuple(chain.stages[1:]) if chain is not None else ())
            except BaseException as exc:
                if target is not None:  # every stage's writes read this request's pages: they end first
                    with contextlib.suppress(Exception):
                        await self.ends.handoff_done(request.request_id, target)
                if chain is not None:
                    self.restorer.end_on_chain(request, chain, restore, None,
                                               getattr(exc, "corrupt_chunk_indexes", ()))
                raise
            if chain is not None:
                self.restorer.end_on_chain(request, chain, restore, result.restore_stages)
            if request.phase is Phase.RESTORING:  # every stage must have restored all it was given
                counts = [s.num_chunks_restored for s in restore.stages]
                request.apply_restore(counts + [0] * (self.settings.num_stages - len(counts)) if chain else [],
                                      self.blocks)
            handoff = None
            if target is not None and len(result.handoff_stages) == self.settings.num_stages:
                handoff = self.ends.handoff_ended(request.request_id, target, result.handoff_stages)
            elif target is not None:  # a later stage of an older version answered without its figures
                handoff = await self.ends.handoff_done(request.request_id, target)
        except DeviceCacheLost as exc:
            # a later stage restarted: its device KV is gone, so no device hit holds on this pipeline
            forgotten = self.blocks.forget_cached()
            log.warning("device_cache_dropped", request_id=request.request_id, chunks=forgotten, reason=str(exc))
            raise
        finally:
            if saving:
                task = asyncio.ensure_future(self._release_after_saves(request.request_id))
                self._releases.add(task)
                self._releasing[request.request_id] = task
                task.add_done_callback(self._releases.discard)
                task.add_done_callback(self._forget_release)
        compute_ms = (time.perf_counter() - t0) * 1e3
        request.finish_compute(self.blocks)
        return RunResult(restore, result, compute_ms, handoff)

    def _forget_release(self, task: asyncio.Task[None]) -> None:
        for request_id, running in list(self._releasing.items()):
            if running is task:
                del self._releasing[request_id]

    async def _release_after_saves(self, request_id: str) -> None:
        """Wait for every stage's save of the request to end, then let its blocks go."""
        try:
            await self.ends.saves_done(request_id)
        finally:
            await self.free(save_holder(request_id))

    def _free_after(self, task: asyncio.Future[object], request_id: str) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.info("cancelled_prefill_failed", request_id=request_id, error=str(task.exception()))
        asyncio.ensure_future(self.free(request_id))

    async def _admit(self, request: PrefillRequest) -> None:
        """Take device blocks (device hits are ref'd first), waiting while others hold them."""
        started = time.monotonic()
        deadline = started + self.settings.admission_timeout_s
        if self.gate is not None:
            # the histories of this request and of those still waiting, in serving order: the next served is
            # the last evicted (arrival order alone made the oldest waiter, served next, the first evicted)
            waiting = [request.session] if request.session is not None else []
            self.blocks.touch_sessions(waiting + self.gate.waiting_sessions(started))
        async with self._freed:
            self.metrics.admission_waiting.inc()
            try:
                while not try_admit(request, self.blocks, time.monotonic(), deadline):
                    if self.prefetcher.unpin_all():  # held stagings yield to a real request
                        continue
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._freed.wait(), max(0.0, deadline - time.monotonic()))
            finally:
                self.metrics.admission_waiting.dec()
                self.metrics.admission_wait.observe(time.monotonic() - started)
        self.metrics.device_usage.set(self.blocks.usage)
        self.metrics.observe_tenants(self.blocks.tenant_blocks)

    # ---- freeing ----------------------------------------------------------

    async def free(self, request_id: str) -> None:
        """Let a holder's blocks go and wake the requests waiting for blocks."""
        self.blocks.free(request_id)
        self._blocks_freed([request_id])
        await self._wake_waiters()

    def blocks_released(self, holders: list[str]) -> None:
        """Holders the prefetch policy let go of itself (a held staging, to its turn or to a request short
        of blocks): log them as any free is logged, and wake the requests waiting for blocks."""
        self._blocks_freed(holders)
        task = asyncio.ensure_future(self._wake_waiters())  # the caller may hold the condition's lock
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _blocks_freed(self, holders: list[str]) -> None:
        for holder in holders:
            log.info("blocks_freed", holder=holder)  # with prefill_admitted: stage 0's block events in order
        self.metrics.device_usage.set(self.blocks.usage)  # freed blocks show at once
        self.metrics.observe_tenants(self.blocks.tenant_blocks)

    async def _wake_waiters(self) -> None:
        async with self._freed:
            self._freed.notify_all()
