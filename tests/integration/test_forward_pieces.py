"""A request's hidden states go from stage to stage in pieces (``ForwardPieces``), so the stages overlap.

On four real stage processes with 256-token forward pieces: the answer is the
one the stages give one after another (``--bench-forward stages-in-turn``, the
bench's baseline) and the one computed from scratch in this process; every later stage
receives each piece on its own; and a stream that breaks the rules (another
request's piece, a gap, a piece past the last, a stream ending early, bytes that
do not parse, a restore plan that does not fit the stage) is refused INVALID_ARGUMENT naming the field, with the stage
serving on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import torch

from kvpool import service
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from kvpool.status import FIELD_KEY
from kvpool.tools.cluster import LocalPipeline
from tests.integration.conftest import eventually, metric
from tests.integration.test_prefill_pipeline import CHUNK, CONFIG, prompt, reference_logits

pytestmark = pytest.mark.cluster

PIECE = 256  # one chunk a piece: a 1,000-token prompt goes on in four pieces


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPipeline]:
    with LocalPipeline(num_stages=4, workdir=tmp_path_factory.mktemp("pieces"),
                       stage_args=["--device-cache-tokens", str(8 * CHUNK),
                                   "--forward-piece-tokens", str(PIECE)]) as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def in_turn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPipeline]:
    """The bench's baseline: each stage passes a request on whole (``--bench-forward stages-in-turn``)."""
    with LocalPipeline(num_stages=4, workdir=tmp_path_factory.mktemp("in-turn"),
                       stage_args=["--device-cache-tokens", str(8 * CHUNK), "--forward-piece-tokens", str(PIECE),
                                   "--bench-forward", "stages-in-turn"]) as pipeline:
        yield pipeline


@pytest.fixture
async def front(pipeline: LocalPipeline) -> AsyncIterator[prefill_pb2_grpc.PrefillStub]:
    async with grpc.aio.insecure_channel(pipeline.address, options=service.GRPC_OPTIONS) as channel:
        yield prefill_pb2_grpc.PrefillStub(channel)


def stage_address(pipeline: LocalPipeline, stage: int) -> str:
    return f"127.0.0.1:{pipeline.stages[stage].ready['port']}"


def pieces_received(pipeline: LocalPipeline, stage: int) -> float:
    """The stage's ``kvpool_prefill_pieces_received_total``."""
    return metric(pipeline.stages[stage], "kvpool_prefill_pieces_received_total")


async def test_pieces_give_the_answer_of_the_stages_one_after_another_and_from_scratch(
    pipeline: LocalPipeline, in_turn: LocalPipeline, front: prefill_pb2_grpc.PrefillStub,
) -> None:
    token_ids = prompt(1, 1000)  # 4 pieces: 256, 256, 256, 232
    before = [pieces_received(pipeline, s) for s in (1, 2, 3)]
    piecewise = await front.Prefill(prefill_pb2.PrefillRequest(
        token_ids=token_ids, session_key="a", return_logits=True), timeout=300)
    after_piecewise = [pieces_received(pipeline, s) for s in (1, 2, 3)]
    assert [a - b for a, b in zip(after_piecewise, before)] == [4, 4, 4]
    assert piecewise.figures.num_computed_tokens == 1000
    before = [pieces_received(in_turn, s) for s in (1, 2, 3)]
    async with grpc.aio.insecure_channel(in_turn.address, options=service.GRPC_OPTIONS) as channel:
        whole = await prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
            token_ids=token_ids, session_key="b", return_logits=True), timeout=300)
    assert whole.figures.num_computed_tokens == 1000
    assert [pieces_received(in_turn, s) for s in (1, 2, 3)] == [n + 1 for n in before]  # each stage's at once
    assert piecewise.first_token == whole.first_token
    assert piecewise.logits == whole.logits  # bit for bit: every stage computed the same pieces
    logits = torch.frombuffer(bytearray(piecewise.logits), dtype=torch.float32)
    assert torch.allclose(logits, reference_logits(token_ids), atol=1e-4)


def forward(request_id: str, num_tokens: int, start: int, end: int, hidden_tokens: int | None = None
            ) -> prefill_pb2.ForwardRequest:
    """A piece of tokens [start, end) of a request computing [0, num_tokens), with ``hidden_tokens`` (by
    default ``end - start``) tokens' hidden states inline."""
    n = end - start if hidden_tokens is None else hidden_tokens
    hidden = torch.zeros(n, CONFIG.hidden_size, dtype=torch.float32).numpy().tobytes()
    return prefill_pb2.ForwardRequest(
        request_id=request_id, block_table=[7] * -(-num_tokens // CHUNK), compute_start=0, num_tokens=num_tokens,
        activation=prefill_pb2.Activation(inline=hidden, num_tokens=n, hidden_size=CONFIG.hidden_size),
        piece_start=start, piece_end=end)


def plan(request_id: str, num_tokens: int, restores: list[prefill_pb2.RestoreRequest]) -> prefill_pb2.ForwardRequest:
    """The first message of a request whose restore rides the chain: the request and its restores, no piece."""
    return prefill_pb2.ForwardRequest(request_id=request_id, block_table=[7] * -(-num_tokens // CHUNK),
                                      compute_start=0, num_tokens=num_tokens, plan_only=True, restores=restores)


NO_CHUNKS = prefill_pb2.RestoreRequest(request_id="x")
FAR_BLOCK = prefill_pb2.RestoreRequest(request_id="x", chunks=[prefill_pb2.RestoreChunk(block_id=1 << 20)])

BROKEN_STREAMS = {
    "another request's piece": ([forward("x", 48, 0, 16), forward("y", 48, 16, 48)], "request_id"),
    "a gap": ([forward("x", 48, 0, 16), forward("x", 48, 32, 48)], "piece_start"),
    "a piece past the last": ([forward("x", 32, 0, 32), forward("x", 32, 32, 40)], "piece_start"),
    "the stream ends early": ([forward("x", 48, 0, 16)], "piece_end"),
    "a piece beyond num_tokens": ([forward("x", 32, 0, 48)], "piece_end"),
    "the first piece not at compute_start": ([forward("x", 48, 16, 48)], "piece_start"),
    "a piece whose size disagrees with its hidden states": (
        [forward("x", 48, 0, 16), forward("x", 48, 16, 48, hidden_tokens=8)],
        "activation"),
    "no piece at all": ([], "request"),
    "a plan without this stage's restore": ([plan("x", 48, []), forward("x", 48, 0, 48)], "restores"),
    "a plan for more stages than follow": ([plan("x", 48, [NO_CHUNKS, NO_CHUNKS]), forward("x", 48, 0, 48)],
                                           "restores"),
    "a plan and no piece": ([plan("x", 48, [NO_CHUNKS])], "request"),
    "a restore into a block outside the cache": ([plan("x", 48, [FAR_BLOCK]), forward("x", 48, 0, 48)],
                                                 "restores[0].chunks[0].block_id"),
}


@pytest.mark.parametrize("case", list(BROKEN_STREAMS))
async def test_a_broken_stream_of_pieces_is_refused_naming_the_field(
    pipeline: LocalPipeline, front: prefill_pb2_grpc.PrefillStub, case: str,
) -> None:
    messages, field = BROKEN_STREAMS[case]
    async with grpc.aio.insecure_channel(stage_address(pipeline, 3)) as channel:  # the last: nothing onward
        call = prefill_pb2_grpc.PrefillStageStub(channel).ForwardPieces(iter(messages), timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, error.code(), error.details())
    assert (error.details() or "").startswith(f"{field}: "), (case, error.details())
    assert dict(await call.trailing_metadata() or ()).get(FIELD_KEY) == field
    # the stage serves on: a whole prompt through all four stages
    token_ids = prompt(2, 300)
    done = await front.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key=f"after {case}",
                                                          tenant=case, return_logits=True), timeout=300)
    assert done.figures.num_computed_tokens == 300


async def test_bytes_that_do_not_parse_in_a_later_piece_are_refused_naming_the_request(
    pipeline: LocalPipeline,
) -> None:
    first = forward("x", 48, 0, 16).SerializeToString()
    with grpc.insecure_channel(stage_address(pipeline, 3)) as channel:
        pieces = channel.stream_unary("/kvpool.rpc.PrefillStage/ForwardPieces")
        with pytest.raises(grpc.RpcError) as info:
            pieces(iter([first, b"\xff"]), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("request: not a kvpool.rpc.ForwardRequest (")


async def test_the_whole_request_forward_refuses_a_piece(pipeline: LocalPipeline) -> None:
    """``Forward`` (an older stage's call) takes [compute_start, num_tokens) whole; pieces go by ForwardPieces."""
    async with grpc.aio.insecure_channel(stage_address(pipeline, 3)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefill_pb2_grpc.PrefillStageStub(channel).Forward(forward("x", 48, 0, 16), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith("piece_end: Forward takes tokens [compute_start, num_tokens)")


async def test_an_older_callers_whole_request_forward_is_still_served_through_the_later_stages(
    pipeline: LocalPipeline,
) -> None:
    """A stage of an earlier version calls ``Forward`` with the whole request (docs/operations.md, upgrades):
    stage 1 computes it and passes it on in pieces; the last stage answers for all three."""
    whole = forward("old", 48, 0, 48)
    whole.piece_start = whole.piece_end = 0
    before = [pieces_received(pipeline, s) for s in (2, 3)]
    async with grpc.aio.insecure_channel(stage_address(pipeline, 1)) as channel:
        done = await prefill_pb2_grpc.PrefillStageStub(channel).Forward(whole, timeout=120)
    assert len(done.stage_compute_ms) == 3  # stages 1, 2 and 3
    assert 0 <= done.first_token < CONFIG.vocab_size
    assert [pieces_received(pipeline, s) - b for s, b in zip((2, 3), before)] == [1, 1]


async def test_a_caller_that_goes_away_mid_stream_leaves_nothing_waiting(pipeline: LocalPipeline) -> None:
    """Stage 0 asks every stage for its handoff and save once a request failed; a stage whose caller cancelled
    its stream after one piece must answer those at once, not wait for pieces that will never come."""
    async with grpc.aio.insecure_channel(stage_address(pipeline, 3)) as channel:
        stub = prefill_pb2_grpc.PrefillStageStub(channel)
        for ends in ("cancelled", "deadline"):
            request_id = f"gone-{ends}"
            received = pieces_received(pipeline, 3)
            call = stub.ForwardPieces(timeout=60 if ends == "cancelled" else 5)
            await call.write(forward(request_id, 48, 0, 16))
            # the stage took the first piece (computed, then waits for the next) before the caller goes
            await eventually(lambda: pieces_received(pipeline, 3) == received + 1, what="the first piece taken")
            if ends == "cancelled":
                call.cancel()
            with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
                await call
            # both answer within their deadline: the stage's task for the request ended
            await stub.HandoffDone(prefill_pb2.HandoffDoneRequest(request_id=request_id), timeout=10)
            await stub.SaveDone(prefill_pb2.SaveDoneRequest(request_id=request_id), timeout=10)


async def test_stage_zero_measures_its_speed_against_the_estimates_and_says_it(
    pipeline: LocalPipeline, front: prefill_pb2_grpc.PrefillStub,
) -> None:
    """kvpool.core.prefill.work_scale on a real stage: the tiny model on this CPU computes a chunk many times slower
    than the reference GPUs' estimate, and StageInfo and the metric carry the measured factor."""
    for seed in (5, 6):  # 16 cold pieces: ~21 ms of reference work, over the 10 ms the factor waits for
        await front.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt(seed, 2000), session_key="speed",
                                                       tenant=f"speed{seed}"), timeout=300)
    async with grpc.aio.insecure_channel(pipeline.address) as channel:
        info = await prefill_pb2_grpc.PrefillStageStub(channel).StageInfo(prefill_pb2.StageInfoRequest(), timeout=30)
    assert info.work_scale > 2.0, info.work_scale
    assert metric(pipeline.stages[0], "kvpool_prefill_work_scale") > 2.0


async def test_a_told_save_into_a_block_outside_the_cache_is_refused_naming_the_field(
    pipeline: LocalPipeline, front: prefill_pb2_grpc.PrefillStub,
) -> None:
    """Stage 0 tells a stage where to write its save (``SaveDone`` with ``told``): a write naming a block the
    stage does not have is refused before anything moves, and the stage serves on."""
    bad = prefill_pb2.SaveDoneRequest(request_id="x", told=True, writes=[prefill_pb2.RestoreChunk(
        block_id=1 << 20, key="ns/h/1", endpoint="127.0.0.1:1", address=4096, size=64)])
    async with grpc.aio.insecure_channel(stage_address(pipeline, 1)) as channel:
        stub = prefill_pb2_grpc.PrefillStageStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SaveDone(bad, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith("writes[0].block_id: 1048576 is outside 0..")
        nothing = await stub.SaveDone(prefill_pb2.SaveDoneRequest(request_id="y", told=True), timeout=30)
        assert (list(nothing.written_keys), nothing.num_stored) == ([], 0)
    done = await front.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt(3, 300), session_key="after save",
                                                          return_logits=True), timeout=300)
    assert done.figures.num_computed_tokens == 300
