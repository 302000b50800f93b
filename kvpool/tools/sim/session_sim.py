"""Session-aware prefill in the simulator (``sched=session``): retention by session, session end, prefetch.

The decisions are the core's (``kvpool.core.sessions``, ``BlockManager.touch_session``/
``end_session``, ``PoolIndex.demote``); this module times them on the event loop:

- a turn arriving touches its session's cached blocks (they are the most
  recently used while it waits) and is queued by its work (``prefill_queue``);
- a session's last turn carries ``session_end``: its cached device blocks are
  released and its pool groups demoted;
- any other turn's end carries ``expected_next_s`` (the client's hint; here the
  trace's next think time times the run's think scale, so the hint is exact:
  a harness that knows what its tool call waits on could give it); the
  session's history is staged from the pool ``LEAD_S`` plus its restore time
  before it (``prefetch_at``) when the device lost part of it, into blocks that cache
  nothing (``prefetch_budget``: never a live session's cached chunk, never
  blocks a queued request wants). The read uses the pipeline's restore path
  while it is idle and overlaps compute (the copy engines, not the SMs); a
  real request's restore starting, or a request waiting for blocks, cancels it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvpool.core.block_manager import BlockManager
from kvpool.core.chunk_hash import group_id
from kvpool.core.pool_index import PoolIndex
from kvpool.core.sessions import PrefetchLedger, SessionId, SessionTable, plan_prefetch, prefetch_at, prefetch_budget
from kvpool.tools.sim.cost_model import CostModel
from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.job import SIM_TENANT, Job, session_of
from kvpool.tools.sim.network import MasterQueue

LEAD_S = 1.0  # start this long, plus the whole history's restore time, before the expected next turn
RESERVE_SHARE = 0.02  # of the device's blocks a prefetch always leaves free


@dataclass(slots=True)
class Prefetch:
    session: SessionId
    holder: str
    first_chunk: int
    num_chunks: int
    nbytes: int
    started: float
    duration_s: float
    lease: int = 0
    cancelled: bool = False


@dataclass(slots=True)
class SessionAware:
    """One run's session table, prefetch ledger and prefetches in flight (one per pipeline at most)."""

    chunk_bytes: int  # one chunk, every stage
    sessions: SessionTable = field(default_factory=SessionTable)
    ledger: PrefetchLedger = field(init=False)
    in_flight: dict[str, Prefetch] = field(default_factory=dict)  # by pipeline
    num_prefetches: int = 0
    num_cancelled: int = 0
    num_skipped_pressure: int = 0
    _serial: int = 0

    def __post_init__(self) -> None:
        self.ledger = PrefetchLedger(self.chunk_bytes)

    # ---- a turn's life --------------------------------------------------------

    def arrived(self, job: Job, pipeline: PipelineSim) -> None:
        session = session_of(job)
        self.sessions.turn_started(session, pipeline.loop.now, pipeline.name)  # the pipeline touches its blocks

    def admitted(self, job: Job, pipeline: PipelineSim) -> None:
        request = job.request
        assert request is not None
        cached = pipeline.blocks.cached_block_id
        self.ledger.turn_started(session_of(job), request.chunk_hashes[: request.num_device_chunks],
                                 lambda h: cached(h) is not None)

    def turn_ended(self, job: Job, pipeline: PipelineSim, expected_next_s: float | None, end: bool) -> None:
        session = session_of(job)
        hashes = job.play.hashes
        now = pipeline.loop.now
        self.sessions.turn_ended(session, now, hashes, expected_next_s, end)
        if end:
            pipeline.blocks.end_session(session)
            pipeline.index.demote([group_id(job.play.namespace, h) for h in hashes])  # the tail goes first
            self.ledger.dropped(session)
            self.sessions.forget(session)
            return
        if expected_next_s is not None:
            lead = LEAD_S + pipeline.cost.restore_s(len(hashes), pipeline.stage_bytes_per_token)
            pipeline.loop.at(prefetch_at(now, expected_next_s, lead), self._prefetch, job, pipeline)

    # ---- prefetch ---------------------------------------------------------------

    def _prefetch(self, job: Job, pipeline: PipelineSim) -> None:
        session = session_of(job)
        state = self.sessions.get(session)
        if state is None or state.turns_in_flight or pipeline.name in self.in_flight:
            return  # its turn came (or it ended) first, or the restore path is taken
        blocks, hashes = pipeline.blocks, state.chunk_hashes
        num_device = blocks.match_prefix(hashes)
        num_pool = 0
        for h in hashes[num_device:]:
            group = pipeline.index.groups.get(group_id(job.play.namespace, h))
            if group is None or not group.complete:
                break
            num_pool += 1
        budget = prefetch_budget(blocks.num_uncached_free_blocks, pipeline.blocks_wanted(),
                                 int(blocks.num_blocks * RESERVE_SHARE))
        plan = plan_prefetch(len(hashes), num_device, num_pool, budget)
        if not plan.num_chunks:
            if num_pool > 0 and num_device < len(hashes):
                self.num_skipped_pressure += 1
            return
        end = plan.first_chunk + plan.num_chunks
        self._serial += 1
        holder = f"prefetch{self._serial}"
        # device hit shared, fresh blocks for the staged chunks: only uncached ones (within the budget)
        blocks.allocate(holder, hashes[:end], end * blocks.chunk_size, plan.first_chunk, SIM_TENANT, session)
        groups = [group_id(job.play.namespace, h) for h in hashes[:end]]
        lookup = pipeline.index.lookup(groups)
        pipeline.master.call(pipeline.cost.lookup_s(len(groups)), _served)  # the master's time; the read waits not
        duration = pipeline.cost.restore_s(plan.num_chunks, pipeline.stage_bytes_per_token)
        prefetch = Prefetch(session, holder, plan.first_chunk, plan.num_chunks, plan.num_chunks * self.chunk_bytes,
                            pipeline.loop.now, duration, lookup.lease_id)
        self.in_flight[pipeline.name] = prefetch
        self.num_prefetches += 1
        pipeline.loop.after(duration, self._staged, prefetch, pipeline, hashes[plan.first_chunk:end])

    def _staged(self, prefetch: Prefetch, pipeline: PipelineSim, staged: list) -> None:
        if prefetch.cancelled:
            return
        del self.in_flight[pipeline.name]
        pipeline.index.release_lease(prefetch.lease)
        pipeline.blocks.commit_chunks(prefetch.holder, prefetch.first_chunk, staged)
        pipeline.blocks.free(prefetch.holder)
        self.ledger.staged(prefetch.session, staged)
        pipeline.kick()

    def cancel(self, pipeline: PipelineSim) -> None:
        """A real request needs the restore path or the blocks: the prefetch stops, its blocks go back
        uncached, the bytes it read so far are wasted."""
        prefetch = self.in_flight.pop(pipeline.name, None)
        if prefetch is None:
            return
        prefetch.cancelled = True
        self.num_cancelled += 1
        pipeline.index.release_lease(prefetch.lease)
        pipeline.blocks.free(prefetch.holder)
        done = (pipeline.loop.now - prefetch.started) / prefetch.duration_s if prefetch.duration_s else 1.0
        self.ledger.cancelled(int(prefetch.nbytes * min(1.0, done)))

    def figures(self) -> dict[str, float]:
        ledger = self.ledger
        return {"prefetched_bytes": ledger.prefetched_bytes, "prefetch_used_bytes": ledger.used_bytes,
                "prefetch_wasted_bytes": ledger.wasted_bytes, "prefetch_pending_bytes": ledger.pending_bytes,
                "wasted_prefetch_share": ledger.wasted_share, "prefetches": self.num_prefetches,
                "prefetches_cancelled": self.num_cancelled, "prefetches_skipped_pressure": self.num_skipped_pressure}


class PipelineSim(Protocol):
    """What prefetch needs of a simulated pipeline (``prefill_sim.PipelineSim``)."""

    name: str
    loop: EventLoop
    cost: CostModel
    blocks: BlockManager
    index: PoolIndex
    master: MasterQueue

    @property
    def stage_bytes_per_token(self) -> float: ...

    def blocks_wanted(self) -> int: ...

    def kick(self) -> None: ...


def _served() -> None:
    """A master operation whose caller does not wait for it."""
