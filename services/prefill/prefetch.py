"""Stage 0's session-aware prefill: each session's last prompt, staging it ahead of the next turn, session end.

The decisions are the core's (``kvpool.core.sessions``: the session table, the
prefetch budget and its byte ledger; ``BlockManager.touch_session``/
``end_session``); this module times them and does the I/O:

- every prefill names its session (``SessionId(tenant, session_key)``): its
  blocks are that session's cached blocks when freed, and its arrival touches
  them (retention by session);
- ``Prefetch`` (the router calls it when a hinted turn ends) either releases
  the session's cached blocks and demotes its pool groups to the front of
  eviction (``session_end``), or schedules a staging just ahead of
  ``expected_next_s`` (``prefetch_lead_s``: the history's restore at the
  restore time per chunk this pipeline measured, plus ``LEAD_MARGIN_S``):
  what the device lost of the session's last prompt is restored from the
  pool on every stage, through the same restore path a prefill takes, into
  blocks that cache nothing or that sessions expected back later gave up
  (``SessionTable.donors``), at most the core's budget
  (``prefetch_budget``). The staged blocks stay held for the session's
  next turn (its arrival lets them go to the turn as device hits): the
  router queues a turn before stage 0 sees it, and unheld they were the
  next allocation's victims meanwhile. A real request short of blocks takes
  every held staging back first (``unpin_all``: they stay cached, evictable,
  so a prefetch never makes a real request wait). Low priority: a staging that finds no
  budget, or the session's next turn already here, does nothing; one waiting
  for its time is cancelled when the session's turn arrives or it ends; one
  reading is never cancelled (the stages write straight into its blocks), and
  holds its few blocks only for that read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter

from kvpool.core.chunk_hash import ChunkHash, group_id
from kvpool.core.errors import ResourceExhausted
from kvpool.core.prefill_queue import WorkWeights, prefill_work_s
from kvpool.core.prefill_request import PrefillRequest, try_admit
from kvpool.core.sessions import (
    PrefetchLedger,
    SessionId,
    SessionTable,
    check_expected_next_s,
    prefetch_budget,
    prefetch_lead_s,
)
from kvpool.core.block_manager import BlockManager
from kvpool.core.tenant_shares import tenant_name
from kvpool.pool.client import PoolClient

log = structlog.get_logger(__name__)

LEAD_MARGIN_S = 0.1  # a staging ends this long before the expected next turn (its lookup's RPCs, the hint's)
FIRST_RESTORE_S_PER_CHUNK = 0.02  # until this pipeline measured one (one chunk on every stage at once)
RESERVE_SHARE = 0.02  # of the device's blocks a staging always leaves free
MAX_SESSIONS = 10_000
WORK_WEIGHTS = WorkWeights()  # the gate orders by these (the seed's GPUs; only their ratios matter for an order)


class PrefillScheduler(Protocol):
    """What staging needs of stage 0's scheduler (``scheduler.PrefillScheduler``): its block table, the
    pool, and its restore and free, so a staging takes the very path a prefill's restore takes."""

    blocks: BlockManager
    chunk_size: int
    namespace: str
    pool: PoolClient | None

    async def _restore(self, request: PrefillRequest) -> Any: ...

    async def _free(self, request_id: str) -> None: ...


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
    """Invariant: at most one staging task per session; the ledger's used + wasted + pending bytes equal
    the prefetched bytes (``PrefetchLedger``)."""

    def __init__(self, scheduler: PrefillScheduler, metrics: PrefetchMetrics, chunk_bytes: int) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.sessions = SessionTable(MAX_SESSIONS)
        self.ledger = PrefetchLedger(chunk_bytes)
        self._waiting: dict[SessionId, asyncio.Task[None]] = {}  # stagings waiting for their time
        self._pinned: dict[SessionId, str] = {}  # staged blocks held (by this holder id) for the session's turn
        self._demotes: set[asyncio.Task[None]] = set()
        self._serial = 0
        self.restore_s_per_chunk = FIRST_RESTORE_S_PER_CHUNK  # a moving mean of what restores took here

    # ---- a prefill's life -----------------------------------------------------

    def turn_started(self, session: SessionId | None) -> None:
        if session is None:
            return
        waiting = self._waiting.pop(session, None)
        if waiting is not None:
            waiting.cancel()  # its turn came first
        self.sessions.turn_started(session, time.monotonic())
        self._unpin(session)  # its staged blocks go to this turn: cached, most recently used
        self.scheduler.blocks.touch_session(session)

    def _unpin(self, session: SessionId) -> bool:
        holder = self._pinned.pop(session, None)
        if holder is None:
            return False
        self.scheduler.blocks.free(holder)
        return True

    def unpin_all(self) -> int:
        """A real request is short of blocks: every held staging goes back to the cache (still cached,
        now evictable). Returns how many; the caller tries its admission again."""
        count = sum(self._unpin(session) for session in list(self._pinned))
        self.metrics.unpinned.inc(count)
        return count

    def admitted(self, request: PrefillRequest) -> None:
        if request.session is None:
            return
        used0, wasted0 = self.ledger.used_bytes, self.ledger.wasted_bytes
        cached = self.scheduler.blocks.cached_block_id
        self.ledger.turn_started(request.session, request.chunk_hashes[: request.num_device_chunks],
                                 lambda h: cached(h) is not None)
        self.metrics.bytes.labels("used").inc(self.ledger.used_bytes - used0)
        self.metrics.bytes.labels("wasted").inc(self.ledger.wasted_bytes - wasted0)

    def observe_restore(self, num_chunks: int, seconds: float) -> None:
        """A restore of ``num_chunks`` took ``seconds`` (first stage start to last end): the lead's estimate."""
        if num_chunks > 0:
            self.restore_s_per_chunk += 0.2 * (seconds / num_chunks - self.restore_s_per_chunk)

    def turn_ended(self, session: SessionId | None, chunk_hashes: list[ChunkHash]) -> None:
        if session is not None and self.sessions.get(session) is not None:
            self.sessions.turn_ended(session, time.monotonic(), chunk_hashes)

    def work_s(self, hashes: list[ChunkHash], num_tokens: int, session: SessionId | None) -> float:
        """The gate's estimate of a prompt's work: the device's cached prefix is free, what else the
        session's last prompt shares with it is restored (the pool holds it), the rest is computed."""
        chunk = self.scheduler.chunk_size
        num_device = self.scheduler.blocks.match_prefix(hashes)
        state = self.sessions.get(session) if session is not None else None
        known = 0
        for a, b in zip(state.chunk_hashes if state is not None else (), hashes):
            if a != b:
                break
            known += 1
        cached = min(max(num_device, known) * chunk, num_tokens - 1)
        restore = min(cached, max(0, known - num_device) * chunk)
        return prefill_work_s(num_tokens, cached, restore, WORK_WEIGHTS)

    # ---- the RPC --------------------------------------------------------------

    def prefetch(self, session_key: str, tenant: str, session_end: bool,
                 expected_next_s: float | None) -> tuple[bool, int, bool]:
        """(known, blocks released, staging scheduled); InvalidArgument naming a bad hint."""
        check_expected_next_s(expected_next_s)
        session = SessionId(tenant_name(tenant), session_key)
        state = self.sessions.get(session)
        if state is None or not session_key:
            self.metrics.hints.labels("unknown").inc()
            return False, 0, False
        waiting = self._waiting.pop(session, None)
        if waiting is not None:
            waiting.cancel()
        if session_end:
            self._unpin(session)
            released = self.scheduler.blocks.end_session(session)
            self.metrics.hints.labels("session_end").inc()
            self.metrics.released_blocks.inc(released)
            self.metrics.bytes.labels("wasted").inc(self.ledger.dropped(session))
            self.sessions.forget(session)
            if self.scheduler.pool is not None and state.chunk_hashes:
                ns = self.scheduler.namespace
                task = asyncio.ensure_future(self._demote([group_id(ns, h) for h in state.chunk_hashes]))
                self._demotes.add(task)
                task.add_done_callback(self._demotes.discard)
            return True, released, False
        delay = 0.0
        if expected_next_s is not None:
            self.sessions.expect(session, time.monotonic(), expected_next_s)
            lead = prefetch_lead_s(len(state.chunk_hashes), self.restore_s_per_chunk, LEAD_MARGIN_S)
            delay = max(0.0, expected_next_s - lead)
        task = asyncio.ensure_future(self._stage_later(session, delay))
        self._waiting[session] = task
        task.add_done_callback(lambda t: self._waiting.pop(session, None) if self._waiting.get(session) is t else None)
        return True, 0, True

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

    async def _stage_later(self, session: SessionId, delay: float) -> None:
        await asyncio.sleep(delay)
        self._waiting.pop(session, None)  # reading now: no longer cancellable
        try:
            outcome = await self._stage(session)
        except Exception as exc:  # low priority: a failed staging is a miss later, never an error
            outcome = "failed"
            log.info("prefetch_failed", session_key=session.key, error=str(exc))
        self.metrics.hints.labels(outcome).inc()

    async def _stage(self, session: SessionId) -> str:
        state = self.sessions.get(session)
        if state is None or state.turns_in_flight:
            return "turn_came"
        scheduler = self.scheduler
        blocks, chunk = scheduler.blocks, scheduler.chunk_size
        hashes = state.chunk_hashes
        num_device = blocks.match_prefix(hashes)
        if num_device >= len(hashes):
            return "on_device"
        # room: blocks that cache nothing, then those of idle sessions expected back after this one
        due_at = state.expected_at if state.expected_at is not None else time.monotonic()
        donors = self.sessions.donors(session, due_at, keep=self.ledger.is_pending)
        donor_blocks = [(d, len(blocks.session_blocks(d))) for d in donors]
        reserve = int(blocks.num_blocks * RESERVE_SHARE)
        # one extra block for the last position every request computes (it caches nothing)
        budget = prefetch_budget(blocks.num_uncached_free_blocks, 1, reserve, sum(n for _, n in donor_blocks))
        end = min(len(hashes), num_device + budget)
        if end <= num_device or scheduler.pool is None:
            return "pressure"
        short = (end - num_device) - max(0, blocks.num_uncached_free_blocks - 1 - reserve)
        for donor, owned in donor_blocks:  # the session wanted last gives first, its history's tail first
            if short <= 0:
                break
            short -= blocks.end_session(donor, min(owned, short))
        self._serial += 1
        holder = f"prefetch/{self._serial}"
        request = PrefillRequest(holder, end * chunk + 1, chunk, list(hashes[:end]), tenant=session.tenant,
                                 session=session)
        try:
            if not try_admit(request, blocks, time.monotonic(), time.monotonic() + 1.0):
                return "pressure"
        except ResourceExhausted:
            return "pressure"
        try:
            report = await scheduler._restore(request)  # every stage reads its own objects into the blocks
        except BaseException:
            await scheduler._free(holder)
            raise
        restored = request.num_restored_chunks
        state = self.sessions.get(session)
        if restored and state is not None and not state.turns_in_flight:
            self._unpin(session)
            self._pinned[session] = holder  # held for its turn (unpin_all takes it back under pressure)
        else:
            await scheduler._free(holder)  # its turn came meanwhile (the blocks are its device hits), or nothing
        self.observe_restore(restored, report.wait_ms / 1e3)
        staged = request.chunk_hashes[request.num_device_chunks: request.num_device_chunks + restored]
        added = self.ledger.staged(session, staged)
        self.metrics.bytes.labels("prefetched").inc(added * self.ledger.chunk_bytes)
        log.info("prefetch_staged", session_key=session.key, chunks=restored,
                 bytes=sum(s.bytes for s in report.stages))
        return "staged" if restored else "pool_miss"
