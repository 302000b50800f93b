"""One stage's forward of one request: compute, stream its KV to decode, start its save, go on.

Every stage runs it: the later stages when their ``Forward``/``ForwardPieces`` is served,
stage 0 from its scheduler. A stage waits on the next one exactly as long as its own caller
waits on it (``keep_deadline``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from kvpool.core.errors import RestoreFellShort
from kvpool.core.prefill.restore_figures import RestoreFigures, StageRestoreFigures
from kvpool.core.prefill.stage_forward import Activation, Piece, StageForward, StageForwardResult
from kvpool.model.sampling import greedy_token
from kvpool.services.prefill.handoff import StageHandoff
from kvpool.services.prefill.pieces import ActivationLink
from kvpool.services.prefill.stage_runner import StageRestore, StageRunner

FORWARD_TIMEOUT_S = 600.0  # only for a caller that set no deadline

# the deadline of the call being served (monotonic): a stage waits on the next one exactly as long as its own
# caller waits on it, so a long prompt on a busy host fails at the client's deadline, not at a fixed one
_deadline: ContextVar[float | None] = ContextVar("forward_deadline", default=None)


def keep_deadline(context: Any) -> None:
    """Carry the served call's deadline (if any) to the forwards this task makes."""
    remaining = context.time_remaining() if context is not None else None
    _deadline.set(None if remaining is None else time.monotonic() + remaining)


def forward_timeout_s() -> float:
    deadline = _deadline.get()
    return FORWARD_TIMEOUT_S if deadline is None else max(0.001, deadline - time.monotonic())


async def run_stage(
    runner: StageRunner, link: ActivationLink, request: StageForward,
    inputs: torch.Tensor | AsyncIterator[tuple[Piece, torch.Tensor]], handoff: StageHandoff,
    restoring: asyncio.Future[RestoreFigures] | None = None, restores_after: Sequence[StageRestore] = (),
) -> StageForwardResult:
    """Compute this stage, streaming its KV to decode as it becomes final, start saving, forward onward.

    ``inputs``: the hidden states (or token ids) of tokens [compute_start, num_tokens) at once, or the
    pieces of a ``ForwardPieces`` stream as they come. Each piece this stage computes goes on to the
    next stage as it ends (``PieceSender``), so the stages overlap; with ``--bench-forward stages-in-turn``
    the request goes on whole once this stage computed all of it.

    With a ``target`` (decode's region), the cached prefix is final at once and each forward piece
    when it ends; the last stage also writes the final logits. The bench's
    ``--bench-forward handoff-after-prefill`` writes the whole part only once every later
    stage has computed. The writes run in the background; the stage answers
    once they ended, its figures first in ``handoff_stages`` (the later
    stages' came with their answer), so stage 0 needs no ``HandoffDone``.

    ``restoring``: this stage's restore of the request, running (its part of the restore that rides the
    chain; ``restores_after``, the later stages' parts, go on first thing in the stream to the next stage).
    The stage computes, and writes its restored prefix, only once its restore landed, and fails with
    ``RestoreFellShort`` when it got less than it was given; its figures lead ``restore_stages``.
    """
    block_table = list(request.block_table)
    target = request.target
    writes = handoff.begin(request.request_id, block_table, target) if target is not None else None
    # the benchmarks' baselines (--bench-forward): the handoff after the last stage, the stages in turn
    after_prefill, in_turn = runner.settings.handoff_after_prefill, runner.settings.forward_after_stage
    stream = writes is not None and not after_prefill
    is_last = runner.model.is_last
    sender = None
    if not is_last and (restores_after or not in_turn):
        sender = link.open(request, forward_timeout_s(), restores_after)  # the later stages start restoring now
    send_pieces = sender.send if sender is not None and not in_turn else None
    pieces = one_piece(request, inputs) if isinstance(inputs, torch.Tensor) else inputs
    kept: list[torch.Tensor] = []  # what goes on after the last piece: its last row, or (bench) every output
    compute_ms = 0.0
    restored: StageRestoreFigures | None = None
    try:
        if restoring is not None:
            figures = await restoring  # the pages must hold the restored KV before it is computed over or sent
            restored = StageRestoreFigures.of(runner.settings.stage, figures)
            if figures.num_chunks_restored < figures.num_chunks_requested:
                raise RestoreFellShort(
                    f"stage {runner.settings.stage}: restored {figures.num_chunks_restored} of the "
                    f"{figures.num_chunks_requested} chunks the forward was planned past",
                    corrupt_chunk_indexes=tuple(figures.corrupt_chunk_indexes))
        if stream and request.compute_start:
            writes.write(0, request.compute_start)  # restored or device-cached: final already
        async for piece, piece_inputs in pieces:
            if sender is not None and sender.failed:
                break  # a later stage failed: finish() says how
            start = piece.start if piece.end else request.compute_start
            t0 = time.perf_counter()
            out = await runner.forward(piece_inputs, block_table, start, writes.write if stream else None,
                                       send_pieces, request.tenant)
            compute_ms += (time.perf_counter() - t0) * 1e3
            kept = kept + [out] if in_turn and not is_last else [out[-1:]]
        else:
            if writes is not None:
                writes.forward_ended()
            # the put reads the pages in the background; stage 0 keeps those blocks until save_done (told:
            # stage 0 reserves every stage's objects at once, and SaveDone says where to write them)
            if not request.save_when_told:
                runner.start_save(request.request_id, block_table, request.save_first_chunk,
                                  list(request.save_chunk_hashes), request.tenant)
        if is_last:
            last = kept[-1][-1]
            # the model's sampler picks among its output ids only; the logits go back as the model made them
            response = StageForwardResult(first_token=greedy_token(last, runner.config))
            logits = last.to(torch.float32).contiguous().numpy().tobytes()
            if request.return_logits:
                response.logits = logits
            if writes is not None:
                trailer = logits if writes.layout.trailer_bytes else b""
                writes.write(0, 0 if stream else request.num_tokens, trailer)
        else:
            if in_turn:  # bench: the whole request at once
                if sender is None:
                    sender = link.open(request, forward_timeout_s())
                sender.send(torch.cat(kept) if len(kept) > 1 else kept[0], request.compute_start, request.num_tokens)
            response = await sender.finish()
            sender = None
            if writes is not None and not stream:
                writes.write(0, request.num_tokens)  # every later stage has computed
        if writes is not None:  # mostly ended already: the later stages computed meanwhile
            response.handoff_stages.insert(0, await handoff.done(request.request_id))
    finally:
        if sender is not None:
            sender.abort()
        if restoring is not None and not restoring.done():
            # failed before its restore landed: the restore still writes the request's pages, and whoever
            # waits for this forward (HandoffDone, stage 0's free) must find it ended
            await asyncio.wait([restoring])
    response.stage_compute_ms.insert(0, compute_ms)
    if restored is not None:
        response.restore_stages.insert(0, restored)
    return response


async def one_piece(request: StageForward, inputs: torch.Tensor) -> AsyncIterator[tuple[Piece, torch.Tensor]]:
    """A whole forward as its one piece (``start == end == 0``: tokens [compute_start, num_tokens))."""
    yield Piece(request.request_id, request.num_tokens, request.compute_start, 0, 0, _NO_ACTIVATION), inputs


_NO_ACTIVATION = Activation(0, 0)  # the inputs are at hand
