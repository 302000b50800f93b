"""Stage 0's ``Prefill`` service: checks at the edge, one scheduler call, the answer as a message.

The scheduler answers in :class:`PrefillResult`; ``result_message`` is the one
place it becomes a ``PrefillResponse``.
"""

from __future__ import annotations

from typing import Any

from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.request_id import bound_request_id, current_request_id, new_request_id
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from kvpool.handoff_messages import handoff_message, target_from_message
from kvpool.services.prefill.forward import keep_deadline
from kvpool.services.prefill.stage0.prefill_result import PrefillFigures, PrefillResult
from kvpool.services.prefill.stage0.scheduler import PrefillScheduler
from kvpool.services.prefill.stage_client import restore_figures_message
from kvpool.status import status_errors


def figures_message(figures: PrefillFigures) -> prefill_pb2.PrefillFigures:
    return prefill_pb2.PrefillFigures(
        num_prompt_tokens=figures.num_prompt_tokens, num_device_tokens=figures.num_device_tokens,
        num_pool_tokens=figures.num_pool_tokens, num_computed_tokens=figures.num_computed_tokens,
        num_pool_chunks_lost=figures.num_pool_chunks_lost,
        restore=[restore_figures_message(s) for s in figures.restore],
        restore_wait_ms=figures.restore_wait_ms, compute_ms=figures.compute_ms, lookup_ms=figures.lookup_ms,
        total_ms=figures.total_ms, stage_compute_ms=figures.stage_compute_ms,
    )


def result_message(result: PrefillResult) -> prefill_pb2.PrefillResponse:
    return prefill_pb2.PrefillResponse(
        first_token=result.first_token, request_id=result.request_id, logits=result.logits,
        figures=figures_message(result.figures), block_table=result.block_table, block_size=result.block_size,
        handoff=handoff_message(result.handoff) if result.handoff is not None else None,
    )


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """The front of the pipeline; UNAVAILABLE until the later stages have been checked."""

    def __init__(self) -> None:
        self.scheduler: PrefillScheduler | None = None

    def _ready(self) -> PrefillScheduler:
        if self.scheduler is None:
            raise Unavailable("prefill: stage 0 is still waiting for the later stages")
        return self.scheduler

    @status_errors
    async def Prefetch(self, request: prefill_pb2.PrefetchRequest, context: Any) -> prefill_pb2.PrefetchResponse:
        expected = request.expected_next_s if request.HasField("expected_next_s") else None
        scheduler = self._ready()
        if not request.session_key:
            raise InvalidArgument("session_key: a prefetch needs the session", field="session_key")
        scheduler.validate([0], request.session_key, request.tenant, request.cache_salt)
        known, released, scheduled = scheduler.prefetcher.prefetch(
            request.session_key, request.tenant, request.session_end, expected)
        return prefill_pb2.PrefetchResponse(known=known, num_blocks_released=released, scheduled=scheduled)

    @status_errors
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        target = target_from_message(request.target) if request.HasField("target") else None
        keep_deadline(context)
        # a caller that named no id (a test, a benchmark) gets a fresh one, bound: its calls carry it
        request_id = current_request_id() or new_request_id("prefill")
        with bound_request_id(request_id):
            result = await self._ready().prefill(list(request.token_ids), request.session_key, request.return_logits,
                                                 request_id, request.tenant, request.cache_salt, target)
        return result_message(result)
