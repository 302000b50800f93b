"""Stage 0's scheduler: hash the prompt, plan device → pool → compute, restore
on every stage, run the pipeline (every stage streams its KV, the last stage
also the final logits, into decode's reserved region as its forward passes
them), collect the handoff's figures, free the blocks.

Every decision is the core's: the request's driver (``kvpool.core.prefill.driver``,
a sans-I/O state machine over the block manager, one block table for all
stages, and the hit planner) and stage 0's admission steps around it
(``kvpool.core.prefill.stage0_admission``: a turn's arrival, the gated touch
of the waiting histories, held stagings taken back for a request short of
blocks), which the simulator's pipeline runs too. This module carries its effects out (the
lookup, the restore, the forward, the lease's release, the saves' wait, the
wake-ups) and feeds the answers back; the restore from the pool is
``pool_restore.py``, the stages' handoff and save ends ``stage_ends.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import chunk_hashes, hash_root
from kvpool.core.errors import (
    DeviceCacheLost,
    FailedPrecondition,
    InvalidArgument,
    KvpoolError,
    RestoreFellShort,
    Unavailable,
)
from kvpool.core.prefill.driver import (
    Admitted,
    Effect,
    Failed,
    Forward,
    Freed,
    Lookup,
    PlannedAgain,
    PrefillDriver,
    Prefilled,
    ReleaseLease,
    RestoreOnStages,
    SavesThenFree,
    WaitForBlocks,
    effect_fields,
    save_holder,
)
from kvpool.core.prefill.queue_settings import queue_order
from kvpool.core.prefill.stage0_admission import Stage0Admission
from kvpool.core.sessions.table import SessionId
from kvpool.core.tenancy.shares import MAX_TENANT_BYTES, TenantShares, tenant_name
from kvpool.pool.client import PoolClient
from kvpool.request_record import RequestRecord
from kvpool.request_id import new_request_id
from kvpool.core.handoff.target import HandoffFigures, HandoffTarget
from kvpool.core.prefill.stage_forward import StageForward, StageForwardResult
from kvpool.core.prefill.work_scale import REFERENCE_WEIGHTS
from kvpool.services.prefill.handoff import HandoffMetrics, StageHandoff
from kvpool.services.prefill.stage0.gate import PrefillGate
from kvpool.services.prefill.metrics import GatePopsCollector, PrefillMetrics
from kvpool.pool.objects import LookupResult
from kvpool.services.prefill.stage0.pool_restore import PoolRestore, RestoreReport
from kvpool.services.prefill.stage0.prefill_result import PrefillFigures, PrefillResult
from kvpool.services.prefill.stage0.prefetch import PrefetchMetrics, SessionPrefetcher
from kvpool.services.prefill.stage0.stage_clients import StageClient
from kvpool.services.prefill.stage0.stage_ends import SavePlan, StageEnds
from kvpool.services.prefill.stage_runner import StageRunner
from kvpool.services.prefill.pieces import ActivationLink
from kvpool.services.prefill.forward import run_stage

log = structlog.get_logger(__name__)

MAX_SESSION_KEY_BYTES = 256


@dataclass(slots=True)
class _Flow:
    """One request's driver and the I/O state its effects carry between them."""

    driver: PrefillDriver
    token_ids: Sequence[int]
    return_logits: bool
    tenant: str
    target: HandoffTarget | None
    started: float
    bound: Any
    session_key: str
    pending: deque[Effect] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    restore: RestoreReport = field(default_factory=RestoreReport)
    lookup: LookupResult | None = None
    forward: StageForwardResult | None = None
    save: SavePlan | None = None  # the last forward's save, once it succeeded, when stage 0 makes it
    release: tuple[int, list[str]] | None = None  # the restore's lease, for the save's first call to end
    handoff: HandoffFigures | None = None
    compute_ms: float = 0.0
    waiting: bool = False  # the flow waits for blocks or for saves: nothing of the request is in flight
    waiting_blocks: bool = False  # not admitted yet (counted in kvpool_prefill_admission_waiting)
    done: bool = False  # the flow ended (its answer is out, or it failed)
    frees_seen: int = 0
    admission_started: float = 0.0  # when the current attempt began to wait for its device blocks

    def feed(self, effects: list[Effect], frees: int) -> None:
        """The driver's effects of one event; ``frees``: the scheduler's count of frees when it decided
        (a WaitForBlocks with frees since is answered at once: nothing waits for a wake-up it missed)."""
        self.pending.extend(effects)
        self.frees_seen = frees
        self.wake.set()


class PrefillScheduler:
    """Admits prefills against the device cache and runs them through all stages.

    The decisions are the core's (``PrefillDriver`` over ``PrefillRequest`` and ``BlockManager``); this
    class carries its effects out and feeds the answers back. A request's blocks are its own only
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
        self._frees = 0  # frees so far (a request that found no blocks waits only if none came since)
        self.record = RequestRecord("stage0")  # what each request saw (kvpool simulate --validate)
        self._releases: set[asyncio.Task[None]] = set()
        # the gate (--sched-slots) in --sched's order; session-aware prefill: retention by session, staging
        order = queue_order(self.settings)
        self.gate = (PrefillGate(self.settings.sched_slots, self.settings.sched_max_wait_s, order,
                                 self.settings.sched_max_bypass_s, self.settings.sched_reorder_below_s,
                                 TenantShares.parse(self.settings.tenant_weights), self.settings.tenant_fair)
                     if self.settings.sched_slots else None)
        if self.gate is not None:
            metrics.registry.register(GatePopsCollector(self.gate.queue))
        self.prefetcher = SessionPrefetcher(self, PrefetchMetrics(metrics.registry),
                                            runner.chunk_nbytes * self.settings.num_stages)
        self.admission = Stage0Admission(self.blocks, self.prefetcher.policy)  # the core's admission steps

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
        # the gate's estimate, in this host's seconds (the core's one decision, the simulator's too)
        work_s = self.admission.work_s(hashes, len(token_ids), session, REFERENCE_WEIGHTS,
                                       self.runner.work_scale.factor)
        self.prefetcher.turn_started(session)
        released = self.admission.arrived(session, time.monotonic())
        if released is not None:
            self.blocks_released([released])  # its blocks are this turn's now, and evictable
        # the session's cached blocks were touched: a block event (kvpool simulate --validate follows it)
        bound.debug("prefill_arrived")
        self.record.write("touch", request_id, session_key=session_key)
        queued = True
        try:
            async with (self.gate.slot(request_id, work_s, session, tenant) if self.gate
                        else contextlib.nullcontext()):
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
        """Run the core's driver (``kvpool.core.prefill.driver``) to the request's end: its effects carried
        out here, the answers fed back. Shielded: a caller that goes away ends it once what is in flight
        ended (the stages write this request's pages), and then everything it held goes back."""
        driver = PrefillDriver(request_id, len(token_ids), self.chunk_size, hashes, self.blocks,
                               self.settings.admission_timeout_s, tenant=tenant_name(tenant), session=session,
                               pool=self.pool is not None,
                               restore_on_chain=all(s.restore_on_chain for s in self.stages))
        flow = _Flow(driver, token_ids, return_logits, tenant, target, started, bound, session.key if session else "")
        # under the gate, the histories of this request and of those still waiting are touched in serving order
        serving = (([session] if session is not None else []) + self.gate.waiting_sessions(time.monotonic())
                   if self.gate is not None else None)
        self._admission_begins(flow)
        self._feed(flow, self.admission.admit(driver, time.monotonic(), serving))
        task = asyncio.ensure_future(self._drive(flow))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            self._cancelled(bound, "admission" if flow.waiting_blocks else "running")
            self._feed(flow, driver.cancel())
            if driver.ended and flow.waiting:  # nothing in flight but a wait: it ends now
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            else:
                task.add_done_callback(self._cancelled_ended)
            raise

    def _feed(self, flow: _Flow, effects: list[Effect]) -> None:
        """The driver's effects of one event, for the flow to carry out; the blocks it freed are logged and
        counted now, as they went back (stage 0's block events keep their order in the log)."""
        freed = [holder for e in effects if isinstance(e, Freed) for holder in e.holders]
        if freed:
            self._blocks_freed(freed)
        if self.record.on:  # what the request saw, in order (kvpool simulate --validate compares it)
            for effect in effects:
                self.record.write("effect", flow.driver.request_id, session_key=flow.session_key,
                                  **effect_fields(effect))
            if any(isinstance(e, Admitted) for e in effects):  # the device cache's evictions so far
                self.record.write("blocks", flow.driver.request_id, evicted=self.blocks.num_evicted)
        flow.feed(effects, self._frees)

    def _admission_begins(self, flow: _Flow) -> None:
        """An attempt starts to wait for its device blocks (``kvpool_prefill_admission_waiting``, ``_wait``)."""
        if not flow.waiting_blocks:
            flow.waiting_blocks = True
            self.metrics.admission_waiting.inc()
        flow.admission_started = time.perf_counter()

    def _cancelled_ended(self, task: asyncio.Task[PrefillResult]) -> None:
        if not task.cancelled() and task.exception() is not None \
                and not isinstance(task.exception(), asyncio.CancelledError):
            log.info("cancelled_prefill_failed", error=str(task.exception()))

    async def _drive(self, flow: _Flow) -> PrefillResult:
        """Carry the driver's effects out until it prefilled the request (the answer) or it failed."""
        try:
            while True:
                while flow.pending:
                    result = await self._carry_out(flow, flow.pending.popleft())
                    if result is not None:
                        return result
                flow.waiting = True  # for the last attempt's saves (a new attempt follows them)
                flow.wake.clear()
                await flow.wake.wait()
                flow.waiting = False
        finally:
            flow.done = True
            if flow.waiting_blocks:
                self.metrics.admission_waiting.dec()
                flow.waiting_blocks = False

    async def _carry_out(self, flow: _Flow, effect: Effect) -> PrefillResult | None:
        driver, bound = flow.driver, flow.bound
        if isinstance(effect, WaitForBlocks):
            flow.waiting = True
            try:
                await self._wait_for_blocks(effect.deadline, flow.frees_seen)
            finally:
                flow.waiting = False
            self._feed(flow, self.admission.admit(driver, time.monotonic()))
        elif isinstance(effect, Admitted):
            if flow.waiting_blocks:
                flow.waiting_blocks = False
                self.metrics.admission_waiting.dec()
                self.metrics.admission_wait.observe(time.perf_counter() - flow.admission_started)
            self.metrics.device_usage.set(self.blocks.usage)
            self.metrics.observe_tenants(self.blocks.tenant_blocks)
            # the admission order (kvpool simulate --validate replays the simulator in it)
            bound.info("prefill_admitted", attempt=effect.attempt, tokens=driver.request.num_tokens)
            self.prefetcher.admitted(*self.admission.admitted(driver.request))
            flow.restore = RestoreReport()
        elif isinstance(effect, Lookup):
            flow.lookup = await self.restorer.lookup(driver.request, effect.candidates, flow.restore, effect.held)
            self._feed(flow, driver.looked_up(flow.lookup.num_complete, flow.lookup.lease_id))
            if driver.request.num_write_back_chunks:
                bound.info("device_hits_written_back", chunks=driver.request.num_write_back_chunks)
        elif isinstance(effect, RestoreOnStages):
            assert flow.lookup is not None
            t1 = time.perf_counter()
            flow.restore.stages = await self.restorer.on_stages(driver.request, flow.lookup)
            flow.restore.wait_ms = (time.perf_counter() - t1) * 1e3
            corrupt = sorted({i for s in flow.restore.stages for i in s.corrupt_chunk_indexes})
            self._feed(flow, driver.restored([s.num_chunks_restored for s in flow.restore.stages], corrupt))
        elif isinstance(effect, Forward):
            await self._forward(flow, effect)
        elif isinstance(effect, ReleaseLease):
            corrupt = self.restorer.corrupt_groups(driver.request, flow.restore.stages, effect.corrupt_chunk_indexes)
            if flow.save is not None and flow.save.chunk_hashes and flow.pending \
                    and isinstance(flow.pending[0], SavesThenFree):
                flow.release = (int(effect.lease_id), corrupt)  # the save's first call ends it: one call fewer
            else:
                self.restorer.release(effect.lease_id, corrupt)
        elif isinstance(effect, SavesThenFree):
            task = asyncio.ensure_future(self._saves_then_free(flow, effect.holder))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        elif isinstance(effect, Freed):  # (logged and counted when the driver freed them: ``_feed``)
            await self._wake_waiters()
        elif isinstance(effect, PlannedAgain):
            bound.info("prefill_planned_again", reason=effect.reason, how=effect.how)
            self._admission_begins(flow)  # the next attempt is admitted afresh
        elif isinstance(effect, Prefilled):
            result = self._result(flow)
            self._feed(flow, driver.release())  # nothing is held after Prefill returns
            while flow.pending:
                await self._carry_out(flow, flow.pending.popleft())
            return result
        elif isinstance(effect, Failed):
            if effect.error is None:
                raise asyncio.CancelledError()
            raise effect.error
        return None

    async def _forward(self, flow: _Flow, effect: Forward) -> None:
        """Restore on the chain (when planned), compute through all stages (streaming into decode's region),
        collect the handoff; the driver hears how it ended."""
        driver, request, target = flow.driver, flow.driver.request, flow.target
        chain = self.restorer.begin_on_chain(request, flow.lookup) if effect.restore and flow.lookup else None
        forward = StageForward(
            request_id=request.request_id, block_table=tuple(request.block_table),
            compute_start=effect.compute_start, num_tokens=request.num_tokens,
            save_first_chunk=effect.save_first_chunk, save_chunk_hashes=tuple(effect.save_chunk_hashes),
            return_logits=flow.return_logits, tenant=flow.tenant, target=target,
            save_when_told=self.ends.saves_together,
        )
        flow.save = None
        inputs = torch.tensor(flow.token_ids[effect.compute_start:], dtype=torch.int64)
        t0 = time.perf_counter()
        try:
            result = await run_stage(self.runner, self.link, forward, inputs, self.handoff,
                                     chain.local if chain is not None else None,
                                     tuple(chain.stages[1:]) if chain is not None else ())
            if target is not None and len(result.handoff_stages) == self.settings.num_stages:
                flow.handoff = self.ends.handoff_ended(request.request_id, target, result.handoff_stages)
            elif target is not None:  # a later stage of an older version answered without its figures
                flow.handoff = await self.ends.handoff_done(request.request_id, target)
        except Exception as exc:
            if target is not None:  # every stage's writes read this request's pages: they end first
                with contextlib.suppress(Exception):
                    await self.ends.handoff_done(request.request_id, target)
            if chain is not None:
                self.restorer.end_on_chain(chain, flow.restore, None)
            error = exc if isinstance(exc, KvpoolError) else Unavailable(f"prefill: {exc}")
            if isinstance(error, DeviceCacheLost):
                log.warning("device_cache_dropped", request_id=request.request_id, reason=str(error))
            if isinstance(error, RestoreFellShort):  # counted whether or not it may be planned again
                self.metrics.restores_fell_short.inc()
            corrupt_indexes = getattr(exc, "corrupt_chunk_indexes", ())
            self._feed(flow, driver.forward_failed(error, time.monotonic(), corrupt_indexes))
            return
        if chain is not None:
            self.restorer.end_on_chain(chain, flow.restore, result.restore_stages)
        flow.forward = result
        if forward.save_when_told:
            first, hashes = effect.save_first_chunk, tuple(effect.save_chunk_hashes)
            flow.save = SavePlan(first, hashes, tuple(request.block_table[first:first + len(hashes)]), flow.tenant)
        flow.compute_ms = (time.perf_counter() - t0) * 1e3
        counts = [s.num_chunks_restored for s in flow.restore.stages] if chain is not None else []
        counts += [0] * (self.settings.num_stages - len(counts)) if chain is not None else []
        corrupt = sorted({i for s in flow.restore.stages for i in s.corrupt_chunk_indexes}) if chain else []
        self._feed(flow, driver.forward_ended(time.monotonic(), counts, corrupt))

    async def _saves_then_free(self, flow: _Flow, holder: str) -> None:
        """Wait for every stage's save of the request to end, then let its blocks go (and a new attempt that
        waits for them go on)."""
        try:
            release, flow.release = flow.release, None
            await self.ends.saves_done(flow.driver.request_id, flow.save, release)
        except Exception:  # a save is best effort, but a bug in it must be seen: its blocks still go back
            flow.bound.exception("saves_failed")
        finally:
            effects = flow.driver.saves_ended(holder, time.monotonic())
            self._feed(flow, effects)
            if flow.done:  # the request's answer is out: only the save's blocks were left to free
                await self._wake_waiters()

    def _result(self, flow: _Flow) -> PrefillResult:
        request, run = flow.driver.request, flow.forward
        assert run is not None
        figures = PrefillFigures(
            num_prompt_tokens=request.num_tokens,
            num_device_tokens=request.num_device_tokens,
            num_pool_tokens=request.num_pool_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_pool_chunks_lost=request.num_pool_chunks_lost,
            restore=tuple(flow.restore.stages),
            restore_wait_ms=flow.restore.wait_ms,
            compute_ms=flow.compute_ms,
            lookup_ms=flow.restore.lookup_ms,
            total_ms=(time.perf_counter() - flow.started) * 1e3,
            stage_compute_ms=tuple(run.stage_compute_ms),
        )
        self.metrics.observe(figures, self.blocks.usage)
        if request.num_pool_tokens:
            self.prefetcher.observe_restore(request.num_pool_tokens // self.chunk_size, flow.restore.wait_ms / 1e3)
        flow.bound.info("prefill_done", tokens=request.num_tokens, device=figures.num_device_tokens,
                        pool=figures.num_pool_tokens, computed=figures.num_computed_tokens,
                        lost_chunks=figures.num_pool_chunks_lost, total_ms=round(figures.total_ms, 1))
        return PrefillResult(
            first_token=run.first_token, request_id=request.request_id,
            logits=run.logits if flow.return_logits else b"", figures=figures,
            block_table=tuple(request.block_table), block_size=self.chunk_size, handoff=flow.handoff,
        )

    async def _wait_for_blocks(self, deadline: float, frees_seen: int) -> None:
        """Until blocks go back (held stagings yield to a real request first) or the deadline comes; at once
        when some went back since the driver found none (``frees_seen``: the count of frees then)."""
        if self.prefetcher.took_back(self.admission.short_of_blocks()):
            return
        async with self._freed:  # a free counts before it notifies, and notifies under this lock
            if self._frees != frees_seen:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), max(0.0, deadline - time.monotonic()))

    # ---- freeing ----------------------------------------------------------

    async def free(self, request_id: str) -> None:
        """Let a holder's blocks go and wake the requests waiting for blocks."""
        self.blocks.free(request_id)
        await self._freed_holders([request_id])

    async def _freed_holders(self, holders: list[str]) -> None:
        """Holders whose blocks went back: log them and wake the requests waiting for blocks."""
        self._blocks_freed(holders)
        await self._wake_waiters()

    def blocks_released(self, holders: list[str]) -> None:
        """Holders the prefetch policy let go of itself (a held staging, to its turn or to a request short
        of blocks): log them as any free is logged, and wake the requests waiting for blocks."""
        self._blocks_freed(holders)
        task = asyncio.ensure_future(self._wake_waiters())  # the caller may hold the condition's lock
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _blocks_freed(self, holders: list[str]) -> None:
        self._frees += 1
        for holder in holders:
            log.info("blocks_freed", holder=holder)  # with prefill_admitted: stage 0's block events in order
        self.metrics.device_usage.set(self.blocks.usage)  # freed blocks show at once
        self.metrics.observe_tenants(self.blocks.tenant_blocks)

    async def _wake_waiters(self) -> None:
        async with self._freed:
            self._freed.notify_all()
