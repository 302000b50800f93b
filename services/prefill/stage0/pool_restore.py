"""Stage 0's restore of one request from the pool: look its chunks up at the master, have every
stage read its own objects of the planned chunks into their blocks, report the groups some stage
could not verify, and end the lease off the request's path. What is planned, and when a lease ends,
is the request driver's (``kvpool.core.prefill.driver``); this module does the I/O.

Two ways to reach the later stages:

- on the forward's chain (``begin_on_chain`` / ``end_on_chain``), a prefill's way when every later
  stage takes it (``StageInfoResponse.restore_on_chain``): each stage's part rides ``ForwardPieces``'
  first message, every stage starts its own read as that message passes and computes once it
  landed, and the figures come back with the chain's answer. No call of its own: a pool hit costs
  the lookup and nothing more before the forward. The forward is planned past every planned chunk
  before any stage has read it; a stage that falls short fails the forward (``RestoreFellShort``)
  and the driver plans the request again without the pool.
- by ``Restore`` calls, one per later stage at once (``on_stages``): later stages of an older version,
  and a session's staging (``prefetch.py``, the core's ``Staging`` deciding), which runs no forward.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import ChunkHash, group_id, object_key
from kvpool.core.errors import Unavailable
from kvpool.core.prefill.request import PrefillRequest
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import LookupResult
from kvpool.tracing import detached
from kvpool.services.prefill.stage0.stage_clients import StageClient
from kvpool.core.pool.paths import SegmentAccess
from kvpool.core.prefill.restore_figures import RestoreFigures, StageRestoreFigures
from kvpool.services.prefill.stage_runner import ChunkToRestore, StageRestore, StageRunner

log = structlog.get_logger(__name__)

RESTORE_TIMEOUT_S = 60.0


@dataclass(slots=True)
class ChainRestore:
    """A request's restore riding its forward's chain: each stage's part (stage 0's first) and stage 0's own
    read, running."""

    lease_id: str
    stages: list[StageRestore]
    local: asyncio.Future[RestoreFigures]


@dataclass(slots=True)
class RestoreReport:
    """What restoring one request cost, for its figures."""

    lookup_ms: float = 0.0
    wait_ms: float = 0.0
    stages: list[StageRestoreFigures] = field(default_factory=list)


class PoolRestore:
    """Restores a request's planned chunks on every stage: stage 0 in this process, the later
    stages over their ``Restore`` RPC. A stage that cannot restore makes its chunks computed."""

    def __init__(self, runner: StageRunner, stages: Sequence[StageClient],
                 pool: PoolClient | None, blocks: BlockManager) -> None:
        self.runner = runner
        self.stages = list(stages)  # stages 1..N-1
        self.pool = pool
        self.blocks = blocks
        self.namespace = runner.namespace
        self.num_stages = runner.settings.num_stages
        # lease releases in flight: off the request's path, kept so none is dropped unawaited
        self._releases: set[asyncio.Task[None]] = set()

    async def lookup(self, request: PrefillRequest, candidates: Sequence[ChunkHash], report: RestoreReport,
                     held: int = 0) -> LookupResult:
        """Look the candidates up at the master (its time into ``report``); the first ``held`` are the
        device's own (counted and touched, not leased or located: they are read from the device)."""
        assert self.pool is not None
        t0 = time.perf_counter()
        lookup = await self.pool.lookup([group_id(self.namespace, h) for h in candidates],
                                        held_prefix=min(held, len(candidates)))
        report.lookup_ms = (time.perf_counter() - t0) * 1e3
        return lookup

    def begin_on_chain(self, request: PrefillRequest, lookup: LookupResult) -> ChainRestore:
        """Every stage's part of the planned chunks, for the chain's first message, and stage 0's own read,
        started now."""
        stages = [StageRestore(tuple(chunks), tuple(self._accesses(chunks)))
                  for chunks in self._per_stage(request, lookup)]
        local = asyncio.ensure_future(self.runner.restore(stages[0].chunks))
        return ChainRestore(lookup.lease_id, stages, local)

    @staticmethod
    def end_on_chain(chain: ChainRestore, report: RestoreReport,
                     answered: Sequence[StageRestoreFigures] | None) -> None:
        """The chain answered (``answered``: every stage's figures, stage 0's first) or failed (None), with
        every stage's read ended: the figures into ``report``."""
        local = chain.local
        if answered is not None:
            report.stages = list(answered)
        elif local.done() and not local.cancelled() and local.exception() is None:
            report.stages = [StageRestoreFigures.of(0, local.result())]
        # the stages read at once, each while the earlier ones computed: the slowest read is the restore's time
        report.wait_ms = max((s.read_ms for s in report.stages), default=0.0)

    def release(self, lease_id: str, corrupt: list[str]) -> None:
        """End a lease off the request's path (nobody waits for it), naming the groups some stage could
        not verify."""
        assert self.pool is not None
        release = detached(self.pool.release(lease_id, corrupt))  # nobody waits for it
        self._releases.add(release)
        release.add_done_callback(self._releases.discard)

    def _accesses(self, chunks: Sequence[ChunkToRestore]) -> list[SegmentAccess]:
        """How to reach the segments ``chunks`` lie in, as the master told this stage."""
        assert self.pool is not None
        return self.pool.accesses_of({c.location.segment_id for c in chunks})

    def corrupt_groups(self, request: PrefillRequest, stages: Sequence[StageRestoreFigures],
                       more: Sequence[int] = ()) -> list[str]:
        """Groups of the lease with an object some stage got but could not verify: the master
        drops them when the lease ends, so this request's save stores them afresh."""
        found = {i for s in stages for i in s.corrupt_chunk_indexes} | set(more)
        indexes = sorted(i for i in found if 0 <= i < len(request.chunk_hashes))
        if not indexes:
            return []
        group_ids = [group_id(self.namespace, request.chunk_hashes[i]) for i in indexes]
        log.warning("corrupt_groups_reported", request_id=request.request_id, count=len(group_ids),
                    first_chunk_index=indexes[0], first_group_id=group_ids[0])
        return group_ids

    async def on_stages(self, request: PrefillRequest, lookup: LookupResult) -> list[StageRestoreFigures]:
        """Every stage reads its own objects of the planned chunks at once."""
        per_stage = self._per_stage(request, lookup)
        results = await asyncio.gather(
            self._local(per_stage[0]),
            *(self._remote(stage, request.request_id, per_stage[stage]) for stage in range(1, len(per_stage))),
        )
        return list(results)

    def _per_stage(self, request: PrefillRequest, lookup: LookupResult) -> list[list[ChunkToRestore]]:
        """Each stage's objects of the planned chunks, in stage order."""
        targets = request.restore_targets(self.blocks)  # private blocks only: objects land straight in them
        per_stage: list[list[ChunkToRestore]] = []
        for stage in range(self.num_stages):
            chunks = []
            for chunk_index, block_id in targets:
                group = lookup.group(chunk_index)  # the lookup started at chunk 0
                location = group.members.get(object_key(self.namespace, request.chunk_hashes[chunk_index], stage))
                if location is None:
                    break  # cannot happen for a complete group; stay safe
                chunks.append(ChunkToRestore(chunk_index, block_id, location))
            per_stage.append(chunks)
        return per_stage

    async def _local(self, chunks: list[ChunkToRestore]) -> StageRestoreFigures:
        figures = await self.runner.restore(chunks)
        return StageRestoreFigures.of(0, figures)

    async def _remote(self, stage: int, request_id: str, chunks: list[ChunkToRestore]) -> StageRestoreFigures:
        try:
            restore = StageRestore(tuple(chunks), tuple(self._accesses(chunks)))
            return await self.stages[stage - 1].restore(request_id, restore, RESTORE_TIMEOUT_S)
        except Unavailable as exc:
            # a stage that cannot restore makes those chunks computed, not the request failed
            log.warning("stage_restore_failed", stage=stage, error=str(exc))
            return StageRestoreFigures(stage=stage, num_chunks_requested=len(chunks))
