"""Stage 0's session-aware prefill: each session's last prompt, staging it ahead of the next turn, session end.

Every decision is the core's ``SessionPrefetch`` (``kvpool.core.sessions.prefetch``: when a
staging starts, which blocks it may take, holding staged blocks until the session's turn, giving
them all back to a real request short of blocks), ordered on the restore path by the core's
``Staging`` (``kvpool.core.sessions.staging``); the simulator runs both. This module times it and
does the I/O:

- every prefill names its session (``SessionId(tenant, session_key)``): its
  blocks are that session's cached blocks when freed, and its arrival touches
  them (retention by session);
- ``Prefetch`` (the router calls it when a hinted turn ends) either releases
  the session's cached blocks and demotes its pool groups to the front of
  eviction (``session_end``), or arms a staging just ahead of
  ``expected_next_s``: an asyncio task sleeps until the armed time, then
  carries the staging's effects out on the restore path a prefill takes
  (lookup, every stage's read, the lease's end, the blocks freed unless held).
  A staging waiting for its time is cancelled when the session's turn arrives,
  a new hint comes or it ends; one reading is never cancelled (the stages
  write straight into its blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter

from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import ChunkHash, group_id
from kvpool.core.prefill.driver import Freed, Lookup, ReleaseLease, RestoreOnStages
from kvpool.core.prefill.request import PrefillRequest
from kvpool.core.prefill.restore_figures import StageRestoreFigures
from kvpool.core.sessions.prefetch import SESSION_END, SessionPrefetch
from kvpool.core.sessions.staging import FAILED, Staged, Staging, StagingEffect
from kvpool.core.sessions.table import SessionId
from kvpool.core.tenancy.shares import tenant_name
from kvpool.core.prefill.work_scale import WorkScale
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import LookupResult
from kvpool.services.prefill.stage0.pool_restore import RestoreReport

log = structlog.get_logger(__name__)

MAX_SESSIONS = 10_000


class _Runner(Protocol):
    work_scale: WorkScale


class _Restorer(Protocol):
    async def lookup(self, request: PrefillRequest, candidates: Sequence[ChunkHash], report: RestoreReport,
                     held: int = 0) -> LookupResult: ...

    async def on_stages(self, request: PrefillRequest, lookup: LookupResult) -> list[StageRestoreFigures]: ...

    def release(self, lease_id: str, corrupt: list[str]) -> None: ...

    def corrupt_groups(self, request: PrefillRequest, stages: Sequence[StageRestoreFigures],
                       more: Sequence[int] = ()) -> list[str]: ...


class PrefillScheduler(Protocol):
    """What staging needs of stage 0's scheduler (``scheduler.PrefillScheduler``): its block table, the
    pool, its restore steps and the log of freed blocks, so a staging takes the very path a prefill's restore
    takes; and its stage's measured speed, for the gate's estimates."""

    blocks: BlockManager
    chunk_size: int
    namespace: str
    pool: PoolClient | None
    runner: _Runner

    restorer: _Restorer

    def blocks_released(self, holders: list[str]) -> None: ...


class PrefetchMetrics:
    """``kvpool_prefetch_bytes{kind}``: prefetched, used (a turn's device hit covered them), wasted."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Counter("kvpool_prefetch_bytes", "Session prefetch bytes (every stage) by kind",
                             ["kind"], registry=registry)
        self.hints = Counter("kvpool_prefetch_hints", "Session hints (Prefetch calls) by outcome: a staging's "
                             "(staged, on_device, pressure, pool_miss, turn_came, failed), session_end, unknown",
                             ["outcome"], registry=registry)
        self.released_blocks = Counter("kvpool_prefetch_released_blocks",
                                       "Cached device blocks session_end released", registry=registry)
        self.unpinned = Counter("kvpool_prefetch_unpinned", "Stagings held for their session's turn that a real "
                                "request short of blocks took back before the turn came", registry=registry)


class SessionPrefetcher:
    """Invariant: at most one staging task waiting per session, the one the policy armed last; the
    policy's invariants hold (``SessionPrefetch``)."""

    def __init__(self, scheduler: PrefillScheduler, metrics: PrefetchMetrics, chunk_bytes: int) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.policy = SessionPrefetch(scheduler.blocks, chunk_bytes, max_sessions=MAX_SESSIONS)
        self._waiting: dict[SessionId, asyncio.Task[None]] = {}  # stagings waiting for their time
        self._demotes: set[asyncio.Task[None]] = set()

    # ---- a prefill's life -----------------------------------------------------

    def turn_started(self, session: SessionId | None) -> None:
        """Its turn came first: a staging still waiting for its time is cancelled (the policy's part is
        ``Stage0Admission.arrived``)."""
        if session is not None:
            self._cancel_waiting(session)

    def took_back(self, released: list[str]) -> int:
        """Held stagings went back to the cache (still cached, now evictable) for a real request short of
        blocks: counted and logged as frees. Returns how many; the caller tries its admission again."""
        self.metrics.unpinned.inc(len(released))
        if released:
            self.scheduler.blocks_released(released)
        return len(released)

    def unpin_all(self) -> int:
        return self.took_back(self.policy.unpin_all())

    def admitted(self, used: int, wasted: int) -> None:
        """A turn got its blocks: bytes of its session's staged chunks it used, and those lost meanwhile."""
        self.metrics.bytes.labels("used").inc(used)
        self.metrics.bytes.labels("wasted").inc(wasted)

    def observe_restore(self, num_chunks: int, seconds: float) -> None:
        """A restore of ``num_chunks`` took ``seconds`` (first stage start to last end): the lead's estimate."""
        self.policy.observe_restore(num_chunks, seconds)

    def turn_ended(self, session: SessionId | None, chunk_hashes: list[ChunkHash]) -> None:
        self.policy.turn_ended(session, time.monotonic(), chunk_hashes)

    # ---- the RPC --------------------------------------------------------------

    def prefetch(self, session_key: str, tenant: str, session_end: bool,
                 expected_next_s: float | None) -> tuple[bool, int, bool]:
        """(known, blocks released, staging scheduled); InvalidArgument naming a bad hint."""
        session = SessionId(tenant_name(tenant), session_key)
        now = time.monotonic()
        result = self.policy.hint(session, now, session_end, expected_next_s)
        if not result.known:
            self.metrics.hints.labels(result.outcome).inc()
            return False, 0, False
        self._cancel_waiting(session)
        if result.outcome == SESSION_END:
            self.metrics.hints.labels(SESSION_END).inc()
            self.metrics.released_blocks.inc(result.released)
            self.metrics.bytes.labels("wasted").inc(result.wasted_bytes)
            if self.scheduler.pool is not None and result.demote:
                ns = self.scheduler.namespace
                task = asyncio.ensure_future(self._demote([group_id(ns, h) for h in result.demote]))
                self._demotes.add(task)
                task.add_done_callback(self._demotes.discard)
            return True, result.released, False
        armed = result.armed
        assert armed is not None
        task = asyncio.ensure_future(self._stage_later(session, armed.ticket, max(0.0, armed.at - now)))
        self._waiting[session] = task
        task.add_done_callback(lambda t: self._waiting.pop(session, None) if self._waiting.get(session) is t else None)
        return True, 0, True

    def _cancel_waiting(self, session: SessionId) -> None:
        waiting = self._waiting.pop(session, None)
        if waiting is not None:
            waiting.cancel()

    async def _demote(self, group_ids: list[str]) -> None:
        """The ended session's pool groups go first at the next eviction (the tail first); a failure
        leaves them in plain LRU order, nothing worse."""
        assert self.scheduler.pool is not None
        try:
            await self.scheduler.pool.demote(group_ids)
        except Exception as exc:
            log.info("pool_demote_failed", groups=len(group_ids), error=str(exc))

    async def close(self) -> None:
        self.unpin_all()
        for task in list(self._demotes):
            with contextlib.suppress(Exception):
                await task
        for task in list(self._waiting.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ---- staging --------------------------------------------------------------

    async def _stage_later(self, session: SessionId, ticket: int, delay: float) -> None:
        await asyncio.sleep(delay)
        self._waiting.pop(session, None)  # reading now: no longer cancellable
        try:
            outcome = await self._stage(session, ticket)
        except Exception as exc:  # low priority: a failed staging is a miss later, never an error
            outcome = "failed"
            log.info("prefetch_failed", session_key=session.key, error=str(exc))
        self.metrics.hints.labels(outcome).inc()

    async def _stage(self, session: SessionId, ticket: int) -> str:
        """Carry the core's staging (``kvpool.core.sessions.staging``) out on a prefill's restore path."""
        scheduler, restorer = self.scheduler, self.scheduler.restorer
        staging = Staging(self.policy, session, ticket)
        pending = deque(staging.start(time.monotonic(), scheduler.pool is not None))
        report, lookup = RestoreReport(), None
        try:
            while pending:
                effect = pending.popleft()
                if isinstance(effect, Lookup):
                    assert staging.request is not None
                    lookup = await restorer.lookup(staging.request, effect.candidates, report, effect.held)
                    pending.extend(staging.looked_up(lookup.num_complete, lookup.lease_id))
                elif isinstance(effect, RestoreOnStages):  # every stage reads its own objects into the blocks
                    assert staging.request is not None and lookup is not None
                    t1 = time.perf_counter()
                    report.stages = await restorer.on_stages(staging.request, lookup)
                    report.wait_ms = (time.perf_counter() - t1) * 1e3
                    corrupt = sorted({i for s in report.stages for i in s.corrupt_chunk_indexes})
                    pending.extend(staging.read([s.num_chunks_restored for s in report.stages],
                                                report.wait_ms / 1e3, corrupt))
                else:
                    self._carry_out(staging, effect, report)
        except BaseException:
            for effect in staging.failed():
                self._carry_out(staging, effect, report)
            raise
        return staging.outcome

    def _carry_out(self, staging: Staging, effect: StagingEffect, report: RestoreReport) -> None:
        """A staging's effect that needs no answer: a lease's end, blocks gone back, its end."""
        if isinstance(effect, ReleaseLease):  # off the staging's path: the bytes are in the blocks now
            assert staging.request is not None
            self.scheduler.restorer.release(effect.lease_id, self.scheduler.restorer.corrupt_groups(
                staging.request, report.stages, effect.corrupt_chunk_indexes))
        elif isinstance(effect, Freed):
            self.scheduler.blocks_released(list(effect.holders))
        elif isinstance(effect, Staged) and effect.outcome != FAILED and staging.request is not None:
            self.metrics.bytes.labels("prefetched").inc(effect.prefetched_bytes)
            log.info("prefetch_staged", session_key=staging.session.key, chunks=staging.request.num_restored_chunks,
                     bytes=sum(s.bytes for s in report.stages))
