"""What stage 0 asks every stage once a request's forward has passed: did your handoff writes
end (``HandoffDone``), did your saves end (``SaveDone``)? Stage 0 answers for itself in this
process; the later stages over RPC, all at once.

A forward that succeeded brings every stage's handoff figures back along the chain (each stage
answers only once its writes ended: ``run_stage``), so ``HandoffDone`` is asked only after a
failure (whatever still writes must end before the pages are reused) or of an older stage that
sends no figures.

The two answers differ in what a silent stage means. A handoff that a stage cannot confirm
fails the request (decode would read a region nobody vouched for). A save that a stage cannot
confirm is over for this purpose: that stage is gone (or stuck past every put's bounds), so its
puts no longer read the request's pages, and they may be reused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from kvpool.core.chunk_hash import ChunkHash, save_objects
from kvpool.core.errors import KvpoolError, Unavailable
from kvpool.pool.objects import ObjectLocation, PutResult
from kvpool.core.handoff.target import HandoffFigures, HandoffTarget, StageHandoffFigures
from kvpool.services.prefill.handoff import HandoffMetrics, StageHandoff
from kvpool.services.prefill.stage0.stage_clients import StageClient
from kvpool.services.prefill.stage_runner import ChunkToRestore, SaveFigures, StageRestore, StageRunner

log = structlog.get_logger(__name__)

# beyond every bound of a put (two 5 s RPCs and the engine's 30 s + 1 ns/byte)
SAVE_DONE_TIMEOUT_S = 120.0
STAGE_TIMEOUT_S = 120.0  # one stage's handoff writes after its forward, as stage 0 waits for them


@dataclass(frozen=True, slots=True)
class SavePlan:
    """A forward's save, when stage 0 reserves every stage's objects of it: chunks ``first_chunk`` on,
    their hashes and blocks, and whose chunks they are."""

    first_chunk: int
    chunk_hashes: tuple[ChunkHash, ...]
    block_ids: tuple[int, ...]
    tenant: str = ""


class StageEnds:
    def __init__(self, runner: StageRunner, handoff: StageHandoff, handoff_metrics: HandoffMetrics,
                 stages: Sequence[StageClient]) -> None:
        self.runner = runner
        self.handoff = handoff
        self.handoff_metrics = handoff_metrics
        self.stages = list(stages)  # stages 1..N-1

    @property
    def saves_together(self) -> bool:
        """Every stage writes its save where stage 0 tells it (``save_when_told``): one reservation and one
        commit for all stages' objects, not a put pair per stage. Off with an older stage, or no pool."""
        return self.runner.pool is not None and all(s.saves_when_told for s in self.stages)

    async def handoff_done(self, request_id: str, target: HandoffTarget) -> HandoffFigures:
        """Every stage's writes of the request ended: their figures, or the first failure."""
        started = time.perf_counter()
        results = await asyncio.gather(
            self.handoff.done(request_id),
            *(self._handoff_done_remote(stage, request_id) for stage in range(1, len(self.stages) + 1)),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            self.handoff_metrics.requests.labels("failed").inc()
            log.warning("handoff_failed", request_id=request_id, region_id=target.region_id,
                        endpoint=target.endpoint, errors=[str(e) for e in failed])
            error = failed[0]
            raise error if isinstance(error, KvpoolError) else Unavailable(f"handoff: {error}")
        return self.handoff_ended(request_id, target, [r for r in results if isinstance(r, StageHandoffFigures)],
                                  wait_ms=(time.perf_counter() - started) * 1e3)

    def handoff_ended(self, request_id: str, target: HandoffTarget, stages: Sequence[StageHandoffFigures],
                      wait_ms: float | None = None) -> HandoffFigures:
        """The request's handoff from every stage's figures: the chain's, or ``HandoffDone``'s after
        ``wait_ms`` of waiting for them."""
        bound = log.bind(request_id=request_id, region_id=target.region_id, endpoint=target.endpoint)
        forward_end = max(s.forward_end_unix_ms for s in stages)
        last_byte = max(s.last_write_end_unix_ms for s in stages)
        response = HandoffFigures(
            region_id=target.region_id, stages=tuple(stages), transfers=sum(s.transfers for s in stages),
            bytes=sum(s.bytes for s in stages), seconds=max(0.0, last_byte - forward_end) / 1e3,
        )
        self.handoff_metrics.requests.labels("ok").inc()
        self.handoff_metrics.seconds.observe(response.seconds)
        waited = {} if wait_ms is None else {"wait_ms": round(wait_ms, 2)}
        bound.info("handoff_done", transfers=response.transfers, bytes=response.bytes,
                   after_forward_ms=round(response.seconds * 1e3, 2), **waited)
        return response

    async def _handoff_done_remote(self, stage: int, request_id: str) -> StageHandoffFigures:
        return await self.stages[stage - 1].handoff_done(request_id, STAGE_TIMEOUT_S)

    async def saves_done(self, request_id: str, plan: SavePlan | None = None,
                         release: tuple[int, list[str]] | None = None) -> None:
        """Wait until every stage's save of the request ended (or the stage cannot say); with a ``plan`` (the
        stages were told to wait, ``saves_together``), make the save first: every stage's objects reserved
        in one call, each stage writing its own, all committed in one call; ``release``: the restore's
        lease, which that first call ends (the caller sends it on its own when there is no plan)."""
        if plan is not None and plan.chunk_hashes:
            await self._save_together(request_id, plan, release)
            return
        done = await asyncio.gather(
            self.runner.save_done(request_id),
            *(self._save_done_remote(stage, request_id) for stage in range(1, len(self.stages) + 1)),
        )
        log.debug("request_saved", request_id=request_id, stored=sum(d.num_stored for d in done),
                  not_stored=sum(d.num_not_stored for d in done))

    async def _save_done_remote(self, stage: int, request_id: str) -> SaveFigures:
        try:
            return await self.stages[stage - 1].save_done(request_id, SAVE_DONE_TIMEOUT_S)
        except Unavailable as exc:
            # a stage that cannot answer is gone (or stuck past every put's bounds): its puts no longer read
            log.warning("stage_save_done_failed", stage=stage, error=str(exc))
            return SaveFigures()

    async def _save_together(self, request_id: str, plan: SavePlan, release: tuple[int, list[str]] | None) -> None:
        pool, runner = self.runner.pool, self.runner  # each stage counts its bytes and write time itself
        assert pool is not None
        num_stages, count, ns = len(self.stages) + 1, len(plan.chunk_hashes), runner.namespace
        sizes = [runner.chunk_nbytes] + [s.chunk_bytes for s in self.stages]
        items = save_objects(ns, plan.chunk_hashes, sizes)
        reserved = await pool.reserve(items, plan.tenant, release)
        writes: list[list[ChunkToRestore]] = [[] for _ in range(num_stages)]
        group_of: dict[str, str] = {}  # each reserved object's group
        for index, (result, item) in enumerate(zip(reserved, items)):
            stage, i = divmod(index, count)
            if isinstance(result, ObjectLocation):
                writes[stage].append(ChunkToRestore(plan.first_chunk + i, plan.block_ids[i], result))
                group_of[item[0]] = item[1]
        accesses = tuple(pool.accesses_of({c.location.segment_id for chunks in writes for c in chunks}))
        # every stage is asked, with or without writes: its answer also says its forward ended
        results = await asyncio.gather(
            runner.write_told(StageRestore(tuple(writes[0]), accesses)),
            *(self._write_told_remote(stage, request_id, StageRestore(tuple(writes[stage]), accesses))
              for stage in range(1, num_stages)))
        written = {key: checksum for _, ws in results for key, checksum in ws if key in group_of}
        # a group with a member not written is not committed at all: its reservations go back
        lost = {group for key, group in group_of.items() if key not in written}
        keep = {key: checksum for key, checksum in written.items() if group_of[key] not in lost}
        await pool.revoke([key for key, group in group_of.items() if group in lost])
        exists = sum(r is PutResult.EXISTS for r in reserved)
        metrics = runner.metrics
        metrics.saves_stored.labels("exists").inc(exists)

        def committed(ok: bool) -> None:  # (the commit rides on stage 0's next message to the master)
            stored = len(keep) if ok else 0
            not_stored = len(reserved) - stored - exists
            metrics.saves_stored.labels("stored").inc(stored)
            if not_stored:
                metrics.saves_skipped.labels("not_stored").inc(not_stored)
                log.info("chunks_not_stored", request_id=request_id, stored=stored, exists=exists,
                         total=len(reserved))
            log.debug("request_saved", request_id=request_id, stored=stored, exists=exists, not_stored=not_stored)

        pool.commit_soon(list(keep.items()), committed)

    async def _write_told_remote(self, stage: int, request_id: str, writes: StageRestore
                                 ) -> tuple[SaveFigures, list[tuple[str, int]]]:
        try:
            return await self.stages[stage - 1].write_told(request_id, writes, SAVE_DONE_TIMEOUT_S)
        except Unavailable as exc:
            # a stage that cannot answer wrote nothing we can vouch for: its reservations go back
            log.warning("stage_save_done_failed", stage=stage, error=str(exc))
            return SaveFigures(num_not_stored=len(writes.chunks)), []
