"""The prefill → decode handoff on real processes: a 2-stage pipeline writes into a region here.

This test process plays decode's receive side: a real transfer engine with a
registered region, reserved before the prefill and passed in it. Every byte
that lands must be the KV the model computes for the prompt (built here from
the same seeded weights), then the final position's logits; scattered into
token-major pages the KV must equal the prefill pages entry by entry. A bad
target is rejected by field before any work; a stage killed mid-request fails
it with UNAVAILABLE naming the stage, and stage 0's blocks are free at once.
(This receiver names no notify address: no stage sends Decode.Landed.)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import torch

from kvpool import service
from kvpool.core.handoff.layout import HandoffLayout
from kvpool.handoff import scatter_region
from kvpool.tools.cluster import LocalPipeline
from kvpool.model import InProcessPipeline as ReferenceModel
from kvpool.model import get_config, pack_kv, split_layers
from kvpool.model.sampling import greedy_token
from kvpool.rpc import handoff_pb2, prefill_pb2, prefill_pb2_grpc
from kvpool.transfer import HostBuffer, TransferEngine
from tests.integration.conftest import eventually, metric

pytestmark = pytest.mark.cluster

CHUNK = 256
DEVICE_TOKENS = 4 * CHUNK
CONFIG = get_config("tiny")
SPLIT = split_layers(CONFIG.num_hidden_layers, 2)
ENTRY_BYTES = CONFIG.kv_entry_dim * 4  # float32 pages
LOGITS_BYTES = CONFIG.vocab_size * 4
REGION_BYTES = CONFIG.num_hidden_layers * DEVICE_TOKENS * ENTRY_BYTES + LOGITS_BYTES


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


def reference(token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, tokens, entry bytes]``: the prompt's KV as the model computes it here, from
    the same seeded weights, packed by the cache's own ``pack_kv``; and the final logits."""
    blocks = -(-len(token_ids) // CHUNK)
    model = ReferenceModel(CONFIG, num_blocks=blocks, block_size=CHUNK, stage_bounds=SPLIT)
    logits = model.forward(torch.tensor(token_ids), list(range(blocks)), 0)
    packed = [pack_kv(cache, list(range(blocks)), 0, len(token_ids)) for cache in model.kv_caches]
    return torch.cat(packed).view(CONFIG.num_hidden_layers, len(token_ids), ENTRY_BYTES), logits[-1]


def handoff_metrics(pipeline: LocalPipeline) -> list[tuple[float, float, float]]:
    """Per stage: transfers and bytes it wrote, handoffs it timed (stage 0 only)."""
    return [(metric(s, "kvpool_handoff_transfers_total"), metric(s, "kvpool_handoff_bytes_total"),
             metric(s, "kvpool_handoff_seconds_count")) for s in pipeline.stages]


def target(region: HostBuffer, endpoint: str, num_tokens: int, /, **change: object) -> handoff_pb2.HandoffTarget:
    layout = handoff_pb2.HandoffLayout(
        num_tokens=num_tokens, entry_bytes=ENTRY_BYTES, trailer_bytes=LOGITS_BYTES,
        layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in SPLIT],
    )
    t = handoff_pb2.HandoffTarget(region_id="r1", endpoint=endpoint, address=region.address, size=region.size,
                                  deadline_unix_ms=time.time_ns() // 1_000_000 + 60_000, layout=layout)
    for name, value in change.items():
        if name.startswith("layout_"):
            field = name.removeprefix("layout_")
            if field == "layer_split":
                del t.layout.layer_split[:]
                t.layout.layer_split.extend(handoff_pb2.LayerRange(start=s, end=e) for s, e in value)  # type: ignore[attr-defined]
            else:
                setattr(t.layout, field, value)
        else:
            setattr(t, name, value)
    return t


@pytest.fixture(scope="module")
def receiver() -> tuple[TransferEngine, HostBuffer]:
    engine = TransferEngine()
    region = HostBuffer(REGION_BYTES)
    engine.register(region.address, region.size)
    return engine, region


def start_pipeline(workdir) -> LocalPipeline:  # type: ignore[no-untyped-def]
    return LocalPipeline(num_stages=2, workdir=workdir, stage_args=["--device-cache-tokens", str(DEVICE_TOKENS)])


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPipeline]:
    with start_pipeline(tmp_path_factory.mktemp("handoff")) as local:
        yield local


@pytest.fixture
async def front(pipeline: LocalPipeline) -> AsyncIterator[prefill_pb2_grpc.PrefillStub]:
    async with grpc.aio.insecure_channel(pipeline.address, options=service.GRPC_OPTIONS) as channel:
        yield prefill_pb2_grpc.PrefillStub(channel)


async def prefill(stub: prefill_pb2_grpc.PrefillStub, token_ids: list[int],
                  to: handoff_pb2.HandoffTarget | None = None) -> prefill_pb2.PrefillResponse:
    return await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key="h", target=to), timeout=120)


def clear(region: HostBuffer) -> torch.Tensor:
    data = torch.frombuffer(region.view(), dtype=torch.uint8)
    data.zero_()
    return data


async def test_handoff_lands_the_models_kv_and_final_logits(front, receiver, pipeline) -> None:  # type: ignore[no-untyped-def]
    engine, region = receiver
    received = clear(region)
    tokens = prompt(1, 600)  # 2 full blocks and 88 tokens
    before = handoff_metrics(pipeline)
    done = await prefill(front, tokens, target(region, engine.endpoint, 600))
    response = done.handoff
    assert not done.logits  # the caller never gets logits unasked: decode samples from the region's
    layout = HandoffLayout.of(600, SPLIT, ENTRY_BYTES, LOGITS_BYTES)
    # each stage writes its layers of the one forward piece, one write per layer; the last stage then the logits
    per_stage = [(e - b, layout.stage_nbytes(k)) for k, (b, e) in enumerate(SPLIT)]
    assert [(s.stage, s.ranges, s.transfers, s.bytes) for s in response.stages] == [
        (0, 1, *per_stage[0]), (1, 2, per_stage[1][0] + 1, per_stage[1][1] + LOGITS_BYTES)]
    assert (response.transfers, response.bytes) == (CONFIG.num_hidden_layers + 1, layout.nbytes)
    # every stage counted its own writes; stage 0 timed the handoff
    after = handoff_metrics(pipeline)
    assert [tuple(a - b for a, b in zip(x, y)) for x, y in zip(after, before)] == [
        (per_stage[0][0], per_stage[0][1], 1), (per_stage[1][0] + 1, per_stage[1][1] + LOGITS_BYTES, 0)]
    # and logged it as one event (JSON: stderr is a file here)
    def logged() -> list[dict[str, object]]:
        lines = pipeline.stages[0].log_file.read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        return [e for e in events if e.get("event") == "handoff_done" and e.get("request_id") == done.request_id]
    await eventually(logged, what="the handoff_done event")
    [event] = logged()
    assert (event["transfers"], event["bytes"], event["region_id"]) == (CONFIG.num_hidden_layers + 1, layout.nbytes, "r1")
    expected, logits = reference(tokens)
    assert torch.equal(received[: layout.kv_nbytes], expected.view(-1))  # stages back to back, layer-major
    landed = received[layout.trailer_offset: layout.nbytes].clone().view(torch.float32)
    assert torch.allclose(landed, logits, atol=1e-4) and greedy_token(landed, CONFIG) == done.first_token
    assert not received[layout.nbytes:].any()  # nothing past the layout

    # decode's side: scattered into token-major pages, every entry equals the prefill pages'
    page_size, page_ids = 16, list(range(37, -1, -1))  # 38 pages, reversed
    pages = torch.zeros(40, page_size, CONFIG.num_hidden_layers, CONFIG.kv_entry_dim)
    scatter_region(received, layout, pages, page_ids)
    got = torch.stack([pages[page_ids[t // page_size], t % page_size] for t in range(600)])
    assert torch.equal(got.view(torch.uint8), expected.transpose(0, 1))
    # nothing is held once Prefill returned
    assert metric(pipeline.stages[0], "kvpool_prefill_device_cache_usage") == 0.0


@pytest.mark.parametrize(
    ("change", "code", "field"),
    [
        ({"layout_layer_split": [(0, 3), (3, 8)]}, grpc.StatusCode.INVALID_ARGUMENT, "target.layout.layer_split"),
        ({"layout_layer_split": [(0, 4), (5, 8)]}, grpc.StatusCode.INVALID_ARGUMENT, "target.layout.layer_split[1]"),
        ({"layout_entry_bytes": ENTRY_BYTES // 2}, grpc.StatusCode.INVALID_ARGUMENT, "target.layout.entry_bytes"),
        ({"layout_num_tokens": 301}, grpc.StatusCode.INVALID_ARGUMENT, "target.layout.num_tokens"),
        ({"layout_trailer_bytes": 12}, grpc.StatusCode.INVALID_ARGUMENT, "target.layout.trailer_bytes"),
        ({"size": 300 * CONFIG.num_hidden_layers * ENTRY_BYTES - 1}, grpc.StatusCode.INVALID_ARGUMENT, "target.size"),
        ({"endpoint": ""}, grpc.StatusCode.INVALID_ARGUMENT, "target.endpoint"),
        ({"deadline_unix_ms": 1}, grpc.StatusCode.FAILED_PRECONDITION, "target.deadline_unix_ms"),
    ],
)
async def test_bad_target_is_rejected_by_field_before_any_work(front, receiver, pipeline, change, code, field) -> None:  # type: ignore[no-untyped-def]
    engine, region = receiver
    computed = metric(pipeline.stages[0], "kvpool_prefill_requests_total")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await prefill(front, prompt(2, 300), target(region, engine.endpoint, 300, **change))
    assert info.value.code() == code
    assert field in info.value.details()
    assert metric(pipeline.stages[0], "kvpool_prefill_requests_total") == computed  # no prefill work
    assert metric(pipeline.stages[0], "kvpool_prefill_device_cache_usage") == 0.0


async def test_unreachable_decode_fails_unavailable_and_frees_the_blocks(front, receiver, pipeline) -> None:  # type: ignore[no-untyped-def]
    _, region = receiver  # nothing serves a transfer engine on port 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await prefill(front, prompt(3, 200), target(region, "127.0.0.1:1", 200))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert "127.0.0.1:1" in info.value.details()
    assert metric(pipeline.stages[0], "kvpool_prefill_device_cache_usage") == 0.0


async def test_stage_killed_mid_request_fails_it_cleanly(tmp_path, receiver) -> None:  # type: ignore[no-untyped-def]
    engine, region = receiver
    received = clear(region)
    with start_pipeline(tmp_path) as local:
        async with grpc.aio.insecure_channel(local.address, options=service.GRPC_OPTIONS) as channel:
            front = prefill_pb2_grpc.PrefillStub(channel)
            stage1 = local.stages[1].proc
            assert stage1 is not None
            os.kill(stage1.pid, signal.SIGSTOP)  # stage 1 takes the request but never answers
            call = asyncio.ensure_future(prefill(front, prompt(4, 500), target(region, engine.endpoint, 500)))
            await eventually(lambda: metric(local.stages[0], "kvpool_prefill_device_cache_usage") > 0,
                             what="the request holding blocks")
            local.stages[1].kill()  # kill -9
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            # stage 0 let the request go at once: its blocks are free; only stage 0's part (streamed right
            # after its forward) reached the region, which is the failed request's own
            assert metric(local.stages[0], "kvpool_prefill_device_cache_usage") == 0.0
            layout = HandoffLayout.of(500, SPLIT, ENTRY_BYTES, LOGITS_BYTES)
            assert not received[layout.stage_offset(1):].any()
            assert local.stages[0].alive
