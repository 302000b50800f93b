"""Session-aware prefill in the simulator (``sched=session``): retention by session, session end, prefetch.

Every decision is the core's: ``SessionPrefetch`` (one per pipeline, as stage 0 runs one) and a staging's
restore, ``Staging``, both as stage 0 runs them (services/prefill/stage0/prefetch.py). This module times
them on the event loop: a turn's end carries its hint (``session_end`` on a session's last turn, else
``expected_next_s``: the trace's next think time as the run plays it, so the hint is exact); a staging
looks up at the master's queue and reads as a prefill's restore does (``PipelineSim.read``), off every
request's path (the copy engines, not the SMs), and no real request cancels it (stage 0 cancels none).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.core.chunk_hash import group_id
from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.prefill.driver import Lookup, ReleaseLease, RestoreOnStages
from kvpool.core.sessions.prefetch import SessionPrefetch
from kvpool.core.sessions.staging import Staged, Staging, StagingEffect
from kvpool.core.sessions.table import SessionId
from kvpool.tools.sim.job import Job, session_of

if TYPE_CHECKING:
    from kvpool.tools.sim.prefill_sim import PipelineSim


@dataclass(slots=True)
class SessionAware:
    """One run's session prefetch policies (one per pipeline, made with it) and their counts."""

    chunk_bytes: int  # one chunk, every stage
    policies: dict[str, SessionPrefetch] = field(default_factory=dict)  # by pipeline (each pipeline's prefetch)
    outcomes: Counter[str] = field(default_factory=Counter)  # every staging's outcome (the services' hints)
    num_prefetches: int = 0  # stagings that read

    def policy(self, pipeline: str, blocks: BlockManager) -> SessionPrefetch:
        """A new pipeline's policy over its block table (``PipelineSim.prefetch``: its stage 0's)."""
        policy = self.policies[pipeline] = SessionPrefetch(blocks, self.chunk_bytes)
        return policy

    # ---- a turn's life --------------------------------------------------------

    def turn_ended(self, job: Job, pipeline: PipelineSim, expected_next_s: float | None, end: bool) -> None:
        policy, session, now = self.policies[pipeline.name], session_of(job), pipeline.loop.now
        policy.turn_ended(session, now, job.play.hashes)
        if not end and expected_next_s is None:
            return  # no hint: nothing is armed (the router sends none)
        result = policy.hint(session, now, end, expected_next_s)
        if end:
            pipeline.index.demote([group_id(job.play.namespace, h) for h in result.demote])  # the tail goes first
        elif result.armed is not None:
            pipeline.loop.at(result.armed.at, self._stage, session, result.armed.ticket, job.play.namespace, pipeline)

    # ---- staging: the core's ``Staging`` on a prefill's restore path ---------------------

    def _stage(self, session: SessionId, ticket: int, namespace: str, pipeline: PipelineSim) -> None:
        staging = Staging(self.policies[pipeline.name], session, ticket)
        effects = staging.start(pipeline.loop.now)
        self.num_prefetches += staging.request is not None
        self._carry(staging, namespace, pipeline, effects)

    def _carry(self, staging: Staging, namespace: str, pipeline: PipelineSim, effects: list[StagingEffect]) -> None:
        for effect in effects:
            if isinstance(effect, Lookup):
                pipeline.master.call(pipeline.cost.lookup_s(len(effect.candidates)), self._looked_up, staging,
                                     namespace, pipeline, effect)
            elif isinstance(effect, ReleaseLease):
                pipeline.master.call(pipeline.cost.release_s(), pipeline.index.release_lease, int(effect.lease_id))
            elif isinstance(effect, Staged):
                self.outcomes[effect.outcome] += 1
                if staging.request is not None:
                    pipeline.kick()  # blocks went back, or a held staging a waiting request may take back

    def _looked_up(self, staging: Staging, namespace: str, pipeline: PipelineSim, lookup: Lookup) -> None:
        result = pipeline.lookup(namespace, lookup.candidates, lookup.held)
        effects = staging.looked_up(result.num_found, str(result.lease_id) if result.lease_id else "")
        if not any(isinstance(e, RestoreOnStages) for e in effects):
            self._carry(staging, namespace, pipeline, effects)
            return
        assert staging.request is not None and staging.request.restore_plan is not None
        num_chunks, started = staging.request.restore_plan.num_pool_chunks, pipeline.loop.now

        def read(readable: int) -> None:
            effects = staging.read([readable] * pipeline.num_stages, pipeline.loop.now - started)
            self._carry(staging, namespace, pipeline, effects)

        pipeline.read(result.groups[:num_chunks], num_chunks, read)

    def figures(self) -> dict[str, Any]:
        ledgers = [p.ledger for p in self.policies.values()]
        prefetched = sum(ledger.prefetched_bytes for ledger in ledgers)
        wasted = sum(ledger.wasted_bytes for ledger in ledgers)
        return {"prefetched_bytes": prefetched, "prefetch_used_bytes": sum(ledger.used_bytes for ledger in ledgers),
                "prefetch_wasted_bytes": wasted,
                "prefetch_pending_bytes": sum(ledger.pending_bytes for ledger in ledgers),
                "wasted_prefetch_share": wasted / prefetched if prefetched else 0.0,
                "prefetches": self.num_prefetches, "prefetches_cancelled": self.outcomes["cancelled"],
                "prefetches_skipped_pressure": self.outcomes["pressure"],
                "prefetches_unpinned": sum(p.num_unpinned for p in self.policies.values()),
                "prefetch_outcomes": dict(sorted(self.outcomes.items()))}
