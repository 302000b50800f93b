"""The prefill side of the handoff: every stage writes its layers, stage 0 fans out.

``HandoffStageServicer`` (every stage): gather this stage's layers of a
request's tokens from its pages into one slab of its registered handoff
arena, then write the slab in the layout's transfers (at most 8 MiB each)
into its part of decode's region (``kvpool.handoff``). The arena holds at
most the stage's whole device cache, so concurrent handoffs wait for room
rather than grow memory.

``HandoffFront`` (stage 0, inside its Prefill): check the target against
the request and the pipeline before any prefill work, then, after the
compute, run every stage's write at once (its own locally, with the final
position's logits after the KV). Invariants: nothing is written before the
whole target checked out; a slab is freed only after the engine stopped
reading it (the write is shielded from a caller that gives up).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc
import structlog
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvpool.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvpoolError,
    ResourceExhausted,
    Unavailable,
)
from kvpool.core.handoff_layout import HandoffLayout, transfer_plan
from kvpool.handoff import WriteReport, gather_stage, write_slab
from kvpool.rpc import handoff_pb2, handoff_pb2_grpc
from kvpool.status import from_status, status_errors
from kvpool.transfer import TransferError
from services.prefill.arena import Arena
from services.prefill.stage_runner import StageRunner

log = structlog.get_logger(__name__)

ARENA_WAIT_S = 30.0  # for room in the handoff arena, at most
STAGE_TIMEOUT_S = 120.0  # one stage's gather + write, as stage 0 waits for it
_SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class HandoffMetrics:
    """Per stage: the writes it issued and their bytes; stage 0 also times whole handoffs."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.transfers = Counter("kvpool_handoff_transfers", "Writes this stage issued into decode regions",
                                 registry=registry)
        self.bytes = Counter("kvpool_handoff_bytes", "Bytes this stage wrote into decode regions", registry=registry)
        self.seconds = Histogram("kvpool_handoff_seconds", "Handoff time at stage 0, request to the last byte",
                                 buckets=_SECONDS_BUCKETS, registry=registry)
        self.requests = Counter("kvpool_handoff_requests", "Handoffs stage 0 ran, by outcome", ["outcome"],
                                registry=registry)


def target_layout(target: handoff_pb2.HandoffTarget) -> HandoffLayout:
    """The target's layout, checked on its own (tiling, positive sizes)."""
    if not target.HasField("layout"):
        raise InvalidArgument("target.layout: missing")
    layout = target.layout
    try:
        return HandoffLayout.of(layout.num_tokens, [(r.start, r.end) for r in layout.layer_split], layout.entry_bytes,
                                layout.trailer_bytes)
    except InvalidArgument as exc:
        raise InvalidArgument(f"target.layout.{exc}") from None


def check_target(
    target: handoff_pb2.HandoffTarget, layout: HandoffLayout, layer_split: Sequence[tuple[int, int]],
    entry_bytes: int, now_unix_ms: int,
) -> None:
    """Raise unless the target fits this pipeline and its reservation is still live."""
    if not target.endpoint:
        raise InvalidArgument("target.endpoint: must name decode's transfer engine")
    if target.address == 0:
        raise InvalidArgument("target.address: must not be 0")
    split = tuple((int(s), int(e)) for s, e in layer_split)
    if layout.layer_split != split:
        raise InvalidArgument(f"target.layout.layer_split: {list(layout.layer_split)} is not the pipeline's {list(split)}")
    if layout.entry_bytes != entry_bytes:
        raise InvalidArgument(f"target.layout.entry_bytes: {layout.entry_bytes}, the pipeline's entries are {entry_bytes}")
    if target.size < layout.nbytes:
        raise InvalidArgument(f"target.size: {target.size} bytes, the layout needs {layout.nbytes}")
    if target.deadline_unix_ms and target.deadline_unix_ms <= now_unix_ms:
        raise FailedPrecondition(
            f"target.deadline_unix_ms: the reservation expired {now_unix_ms - target.deadline_unix_ms} ms ago"
        )


def now_unix_ms() -> int:
    return time.time_ns() // 1_000_000


class HandoffStageServicer(handoff_pb2_grpc.HandoffStageServicer):
    """Gathers and writes this stage's layers of a request (see the module doc)."""

    def __init__(self, runner: StageRunner, metrics: HandoffMetrics) -> None:
        self.runner = runner
        self.metrics = metrics
        self.settings = runner.settings
        self.stage = runner.settings.stage
        self.entry_bytes = runner.kv_cache.shape[-1] * runner.kv_cache.element_size()
        # a request never holds more than the device cache: one such slab at a time at most, plus the
        # final logits the last stage writes after its KV
        self.arena = Arena("handoff", self.settings.handoff_arena_bytes, runner.engine)

    @status_errors
    async def WriteLayers(self, request: handoff_pb2.WriteLayersRequest, context: Any) -> handoff_pb2.StageHandoffFigures:
        return await self.write_layers(request.request_id, list(request.block_table), request.target)

    async def write_layers(
        self, request_id: str, block_table: list[int], target: handoff_pb2.HandoffTarget, trailer: bytes = b""
    ) -> handoff_pb2.StageHandoffFigures:
        layout = target_layout(target)
        check_target(target, layout, self.settings.layer_split, self.entry_bytes, now_unix_ms())
        block_size, num_blocks = self.settings.chunk_size, self.settings.num_blocks
        needed = -(-layout.num_tokens // block_size)
        if len(block_table) < needed or any(not 0 <= b < num_blocks for b in block_table[:needed]):
            raise InvalidArgument(f"block_table: {layout.num_tokens} tokens need {needed} block ids in 0..{num_blocks - 1}")
        if len(set(block_table[:needed])) != needed:
            raise InvalidArgument("block_table: repeats a block id")
        # shielded: if the caller goes away, the engine may still be reading the slab
        if trailer and len(trailer) != layout.trailer_bytes:
            raise InvalidArgument(f"target.layout.trailer_bytes: {layout.trailer_bytes}, the logits are {len(trailer)}")
        work = asyncio.ensure_future(self._gather_and_write(request_id, block_table[:needed], target, layout, trailer))
        return await asyncio.shield(work)

    async def _gather_and_write(
        self, request_id: str, block_table: list[int], target: handoff_pb2.HandoffTarget, layout: HandoffLayout,
        trailer: bytes,
    ) -> handoff_pb2.StageHandoffFigures:
        nbytes = layout.stage_nbytes(self.stage) + len(trailer)
        try:
            slab = await self.arena.allocate_wait(nbytes, ARENA_WAIT_S)
        except TimeoutError:
            raise ResourceExhausted(f"stage {self.stage}: no room for a {nbytes}-byte handoff slab "
                                    f"in {ARENA_WAIT_S}s") from None
        except ValueError as exc:
            raise InvalidArgument(f"target.layout.num_tokens: {exc}") from None
        try:
            t0 = time.perf_counter()
            slab_tensor = self.arena.tensor(slab, 0, nbytes)
            await asyncio.to_thread(gather_stage, self.runner.kv_cache, block_table, layout.num_tokens,
                                    slab_tensor[: layout.stage_nbytes(self.stage)])
            if trailer:  # the final logits go right after the KV, from the same slab
                slab_tensor[layout.stage_nbytes(self.stage):].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
            gather_s = time.perf_counter() - t0
            if target.deadline_unix_ms and target.deadline_unix_ms <= now_unix_ms():
                raise FailedPrecondition("target.deadline_unix_ms: the reservation expired before the write")
            try:
                report = await asyncio.to_thread(
                    write_slab, self.runner.engine, slab.address, target.endpoint,
                    target.address + layout.stage_offset(self.stage), layout.transfers(self.stage),
                )
                if trailer:
                    tail = await asyncio.to_thread(
                        write_slab, self.runner.engine, slab.address + layout.stage_nbytes(self.stage),
                        target.endpoint, target.address + layout.trailer_offset, transfer_plan(len(trailer)),
                    )
                    report = WriteReport(report.transfers + tail.transfers, report.nbytes + tail.nbytes,
                                          report.seconds + tail.seconds)
            except TransferError as exc:
                # field "target": the decode shard failed, not this pipeline (the router moves the request)
                raise Unavailable(f"stage {self.stage}: writing to decode at {target.endpoint} failed: {exc}",
                                  field="target") from exc
        finally:
            self.arena.free(slab)
        self.metrics.transfers.inc(report.transfers)
        self.metrics.bytes.inc(report.nbytes)
        log.info("handoff_stage_written", request_id=request_id, stage=self.stage, region_id=target.region_id,
                 transfers=report.transfers, bytes=report.nbytes, gather_ms=round(gather_s * 1e3, 2),
                 write_ms=round(report.seconds * 1e3, 2))
        return handoff_pb2.StageHandoffFigures(stage=self.stage, transfers=report.transfers, bytes=report.nbytes,
                                               gather_seconds=gather_s, write_seconds=report.seconds)


class HandoffFront:
    """Stage 0's side of a request's handoff: every stage writes at once (see the module doc)."""

    def __init__(self, local: HandoffStageServicer, metrics: HandoffMetrics,
                 channels: Sequence[grpc.aio.Channel]) -> None:
        self.local = local
        self.metrics = metrics
        self.stages = [handoff_pb2_grpc.HandoffStageStub(c) for c in channels]  # stages 1..N-1, in order

    def check(self, target: handoff_pb2.HandoffTarget, num_tokens: int, num_logits: int) -> HandoffLayout:
        """The target's layout, checked against this request and pipeline before any work."""
        layout = target_layout(target)
        if layout.num_tokens != num_tokens:
            raise InvalidArgument(f"target.layout.num_tokens: {layout.num_tokens}, the prompt has {num_tokens}")
        if layout.trailer_bytes not in (0, num_logits * 4):
            raise InvalidArgument(f"target.layout.trailer_bytes: {layout.trailer_bytes}, the final logits take "
                                  f"{num_logits * 4}")
        check_target(target, layout, self.local.settings.layer_split, self.local.entry_bytes, now_unix_ms())
        return layout

    async def write(self, request_id: str, block_table: list[int], target: handoff_pb2.HandoffTarget,
                    trailer: bytes) -> handoff_pb2.HandoffResponse:
        """Every stage writes its layers (stage 0 also ``trailer`` after the KV); raises the first failure."""
        started = time.perf_counter()
        bound = log.bind(request_id=request_id, region_id=target.region_id, endpoint=target.endpoint)
        results = await asyncio.gather(
            self.local.write_layers(request_id, block_table, target, trailer),
            *(self._remote(stage, request_id, block_table, target) for stage in range(1, len(self.stages) + 1)),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        seconds = time.perf_counter() - started
        if failed:
            self.metrics.requests.labels("failed").inc()
            bound.warning("handoff_failed", ms=round(seconds * 1e3, 2), errors=[str(e) for e in failed])
            error = failed[0]
            raise error if isinstance(error, KvpoolError) else Unavailable(f"handoff: {error}")
        stages = [r for r in results if isinstance(r, handoff_pb2.StageHandoffFigures)]
        response = handoff_pb2.HandoffResponse(
            region_id=target.region_id, stages=stages, transfers=sum(s.transfers for s in stages),
            bytes=sum(s.bytes for s in stages), seconds=seconds,
        )
        self.metrics.requests.labels("ok").inc()
        self.metrics.seconds.observe(seconds)
        bound.info("handoff_done", transfers=response.transfers, bytes=response.bytes, ms=round(seconds * 1e3, 2),
                   stages=len(stages))
        return response

    async def _remote(
        self, stage: int, request_id: str, block_table: list[int], target: handoff_pb2.HandoffTarget
    ) -> handoff_pb2.StageHandoffFigures:
        request = handoff_pb2.WriteLayersRequest(request_id=request_id, block_table=block_table, target=target)
        try:
            return await self.stages[stage - 1].WriteLayers(request, timeout=STAGE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc, f"stage {stage}", (InvalidArgument, FailedPrecondition)) from None
