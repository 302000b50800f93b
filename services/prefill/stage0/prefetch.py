"""Stage 0's session-aware prefill: each session's last prompt, staging it ahead of the next turn, session end.

Every decision is the core's ``SessionPrefetch`` (``kvpool.core.sessions.prefetch``: when a
staging starts, which blocks it may take, holding staged blocks until the session's turn, giving
them all back to a real request short of blocks; the simulator runs the same policy). This module
times it and does the I/O:

- every prefill names its session (``SessionId(tenant, session_key)``): its
  blocks are that session's cached blocks when freed, and its arrival touches
  them (retention by session);
- ``Prefetch`` (the router calls it when a hinted turn ends) either releases
  the session's cached blocks and demotes its pool groups to the front of
  eviction (``session_end``), or arms a staging just ahead of
  ``expected_next_s``: an asyncio task sleeps until the armed time, then
  restores the staging request the policy admitted through the same restore
  path a prefill takes, and frees it unless the policy holds it for the turn.
  A staging waiting for its time is cancelled when the session's turn arrives,
  a new hint comes or it ends; one reading is never cancelled (the stages
  write straight into its blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter

from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import ChunkHash, group_id
from kvpool.core.prefill.request import PrefillRequest
from kvpool.core.sessions.prefetch import SESSION_END, SessionPrefetch
from kvpool.core.sessions.table import SessionId
from kvpool.core.tenancy.shares import tenant_name
from kvpool.core.prefill.work_scale import REFERENCE_WEIGHTS, WorkScale, host_work_s
from kvpool.pool.client import PoolClient

log = structlog.get_logger(__name__)

MAX_SESSIONS = 10_000


class _Runner(Protocol):
    work_scale: WorkScale


class _Restorer(Protocol):
    async def restore(self, request: PrefillRequest) -> Any: ...


class PrefillScheduler(Protocol):
    """What staging needs of stage 0's scheduler (``scheduler.PrefillScheduler``): its block table, the
    pool, and its restore and free, so a staging takes the very path a prefill's restore takes; and its
    stage's measured speed, for the gate's estimates."""

    blocks: BlockManager
    chunk_size: int
    namespace: str
    pool: PoolClient | None
    runner: _Runner

    restorer: _Restorer

    async def free(self, request_id: str) -> None: ...

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
        if session is None:
            return
        self._cancel_waiting(session)  # its turn came first
        released = self.policy.turn_started(session, time.monotonic())
        if released is not None:
            self.scheduler.blocks_released([released])  # its blocks are this turn's now, and evictable

    def unpin_all(self) -> int:
        """A real request is short of blocks: every held staging goes back to the cache (still cached,
        now evictable). Returns how many; the caller tries its admission again."""
        released = self.policy.unpin_all()
        self.metrics.unpinned.inc(len(released))
        if released:
            self.scheduler.blocks_released(released)
        return len(released)

    def admitted(self, request: PrefillRequest) -> None:
        used, wasted = self.policy.admitted(request)
        self.metrics.bytes.labels("used").inc(used)
        self.metrics.bytes.labels("wasted").inc(wasted)

    def observe_restore(self, num_chunks: int, seconds: float) -> None:
        """A restore of ``num_chunks`` took ``seconds`` (first stage start to last end): the lead's estimate."""
        self.policy.observe_restore(num_chunks, seconds)

    def turn_ended(self, session: SessionId | None, chunk_hashes: list[ChunkHash]) -> None:
        self.policy.turn_ended(session, time.monotonic(), chunk_hashes)

    def work_s(self, hashes: list[ChunkHash], num_tokens: int, session: SessionId | None) -> float:
        """The gate's estimate of a prompt's work: the device's cached prefix is free, what else the
        session's last prompt shares with it is restored (the pool holds it), the rest is computed."""
        chunk = self.scheduler.chunk_size
        num_device = self.scheduler.blocks.match_prefix(hashes)
        state = self.policy.sessions.get(session) if session is not None else None
        known = 0
        for a, b in zip(state.chunk_hashes if state is not None else (), hashes):
            if a != b:
                break
            known += 1
        cached = min(max(num_device, known) * chunk, num_tokens - 1)
        restore_chunks = -(-min(cached, max(0, known - num_device) * chunk) // chunk)
        # in this host's seconds: the compute at the measured speed, the restore as restores took here
        return host_work_s(num_tokens, cached, restore_chunks, REFERENCE_WEIGHTS,
                           self.scheduler.runner.work_scale.factor, self.policy.restore_s_per_chunk)

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
        scheduler = self.scheduler
        request = self.policy.begin(session, ticket, time.monotonic(), scheduler.pool is not None)
        if isinstance(request, str):
            return request
        holder = request.request_id
        try:
            report = await scheduler.restorer.restore(request)  # every stage reads its own objects into the blocks
        except BaseException:
            await scheduler.free(holder)
            raise
        result = self.policy.staged(session, request, report.wait_ms / 1e3)
        if not result.hold:
            await scheduler.free(holder)  # its turn came meanwhile (the blocks are its device hits), or nothing
        self.metrics.bytes.labels("prefetched").inc(result.prefetched_bytes)
        log.info("prefetch_staged", session_key=session.key, chunks=request.num_restored_chunks,
                 bytes=sum(s.bytes for s in report.stages))
        return result.outcome
