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

import structlog

from kvpool.core.errors import KvpoolError, Unavailable
from kvpool.core.handoff.target import HandoffFigures, HandoffTarget, StageHandoffFigures
from kvpool.services.prefill.handoff import HandoffMetrics, StageHandoff
from kvpool.services.prefill.stage0.stage_clients import StageClient
from kvpool.services.prefill.stage_runner import SaveFigures, StageRunner

log = structlog.get_logger(__name__)

# beyond every bound of a put (two 5 s RPCs and the engine's 30 s + 1 ns/byte)
SAVE_DONE_TIMEOUT_S = 120.0
STAGE_TIMEOUT_S = 120.0  # one stage's handoff writes after its forward, as stage 0 waits for them


class StageEnds:
    def __init__(self, runner: StageRunner, handoff: StageHandoff, handoff_metrics: HandoffMetrics,
                 stages: Sequence[StageClient]) -> None:
        self.runner = runner
        self.handoff = handoff
        self.handoff_metrics = handoff_metrics
        self.stages = list(stages)  # stages 1..N-1

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

    async def saves_done(self, request_id: str) -> None:
        """Wait until every stage's save of the request ended (or the stage cannot say)."""
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
