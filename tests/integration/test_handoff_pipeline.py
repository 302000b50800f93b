"""The prefill → decode handoff on real processes: a 2-stage pipeline writes into a region here.

This test process plays decode's receive side: a real transfer engine with a
registered region. Every byte that lands must be the KV the model computes
for the prompt (built here from the same seeded weights), and scattered into
token-major pages it must equal the prefill pages entry by entry. Bad input
is rejected by field and keeps the hold; a stage killed mid-handoff fails the
request with UNAVAILABLE naming it, and stage 0 releases the hold.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import torch

from kvpool import service
from kvpool.core.handoff_layout import HandoffLayout
from kvpool.handoff import scatter_region
from kvpool.tools.cluster import LocalPipeline
from kvpool.model import InProcessPipeline as ReferenceModel
from kvpool.model import get_config, pack_kv, split_layers
from kvpool.rpc import handoff_pb2, handoff_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from kvpool.transfer import HostBuffer, TransferEngine
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

CHUNK = 256
DEVICE_TOKENS = 4 * CHUNK
CONFIG = get_config("tiny")
SPLIT = split_layers(CONFIG.num_hidden_layers, 2)
ENTRY_BYTES = CONFIG.kv_entry_dim * 4  # float32 pages
REGION_BYTES = CONFIG.num_hidden_layers * DEVICE_TOKENS * ENTRY_BYTES


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


def reference_kv(token_ids: list[int]) -> torch.Tensor:
    """``[layers, tokens, entry bytes]``: the prompt's KV as the model computes it here, from
    the same seeded weights, packed by the cache's own ``pack_kv``."""
    blocks = -(-len(token_ids) // CHUNK)
    model = ReferenceModel(CONFIG, num_blocks=blocks, block_size=CHUNK, stage_bounds=SPLIT)
    model.forward(torch.tensor(token_ids), list(range(blocks)), 0)
    packed = [pack_kv(cache, list(range(blocks)), 0, len(token_ids)) for cache in model.kv_caches]
    return torch.cat(packed).view(CONFIG.num_hidden_layers, len(token_ids), ENTRY_BYTES)


def metric(stage, sample: str) -> float:  # type: ignore[no-untyped-def]
    """One sample from a stage's Prometheus page (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stage.ready['admin_port']}/metrics", timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    return 0.0


def handoff_metrics(pipeline: LocalPipeline) -> list[tuple[float, float, float]]:
    """Per stage: transfers and bytes it wrote, handoffs it timed (stage 0 only)."""
    return [(metric(s, "kvpool_handoff_transfers_total"), metric(s, "kvpool_handoff_bytes_total"),
             metric(s, "kvpool_handoff_seconds_count")) for s in pipeline.stages]


def target(region: HostBuffer, endpoint: str, num_tokens: int, /, **change: object) -> handoff_pb2.HandoffTarget:
    layout = handoff_pb2.HandoffLayout(
        num_tokens=num_tokens, entry_bytes=ENTRY_BYTES,
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
async def stubs(pipeline: LocalPipeline) -> AsyncIterator[tuple[prefill_pb2_grpc.PrefillStub, handoff_pb2_grpc.HandoffStub]]:
    async with grpc.aio.insecure_channel(pipeline.address, options=service.GRPC_OPTIONS) as channel:
        yield prefill_pb2_grpc.PrefillStub(channel), handoff_pb2_grpc.HandoffStub(channel)


async def prefill(stub: prefill_pb2_grpc.PrefillStub, token_ids: list[int]) -> prefill_pb2.PrefillResponse:
    return await stub.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key="h"), timeout=120)


def clear(region: HostBuffer) -> torch.Tensor:
    data = torch.frombuffer(region.view(), dtype=torch.uint8)
    data.zero_()
    return data


async def test_handoff_lands_the_models_kv_for_every_layer_and_token(stubs, receiver, pipeline) -> None:  # type: ignore[no-untyped-def]
    front, handoff = stubs
    engine, region = receiver
    received = clear(region)
    tokens = prompt(1, 600)  # 2 full blocks and 88 tokens
    done = await prefill(front, tokens)
    before = handoff_metrics(pipeline)
    response = await handoff.Handoff(
        handoff_pb2.HandoffRequest(request_id=done.request_id, target=target(region, engine.endpoint, 600)), timeout=60
    )
    layout = HandoffLayout.of(600, SPLIT, ENTRY_BYTES)
    assert [(s.stage, s.transfers, s.bytes) for s in response.stages] == [
        (k, len(layout.transfers(k)), layout.stage_nbytes(k)) for k in range(2)
    ]
    assert (response.transfers, response.bytes) == (2, layout.nbytes)  # each 0.9 MB slab is one write
    # every stage counted its own writes; stage 0 timed the handoff
    after = handoff_metrics(pipeline)
    assert [tuple(a - b for a, b in zip(x, y)) for x, y in zip(after, before)] == [
        (1, layout.stage_nbytes(0), 1), (1, layout.stage_nbytes(1), 0)]
    # and logged it as one event (JSON: stderr is a file here)
    def logged() -> list[dict[str, object]]:
        lines = pipeline.stages[0].log_file.read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        return [e for e in events if e.get("event") == "handoff_done" and e.get("request_id") == done.request_id]
    await eventually(logged, what="the handoff_done event")
    [event] = logged()
    assert (event["transfers"], event["bytes"], event["region_id"]) == (2, layout.nbytes, "r1")
    expected = reference_kv(tokens)
    assert torch.equal(received[: layout.nbytes], expected.view(-1))  # stages back to back, layer-major
    assert not received[layout.nbytes :].any()  # nothing past the layout

    # decode's side: scattered into token-major pages, every entry equals the prefill pages'
    page_size, page_ids = 16, list(range(37, -1, -1))  # 38 pages, reversed
    pages = torch.zeros(40, page_size, CONFIG.num_hidden_layers, CONFIG.kv_entry_dim)
    scatter_region(received, layout, pages, page_ids)
    got = torch.stack([pages[page_ids[t // page_size], t % page_size] for t in range(600)])
    assert torch.equal(got.view(torch.uint8), expected.transpose(0, 1))

    # the hold ended with the handoff
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await front.Release(prefill_pb2.ReleaseRequest(request_id=done.request_id), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("change", "code", "field"),
    [
        ({"layout_layer_split": [(0, 3), (3, 8)]}, grpc.StatusCode.INVALID_ARGUMENT, "target.layout.layer_split"),
        ({"layout_layer_split": [(0, 4), (5, 8)]}, grpc.StatusCode.INVALID_ARGUMENT, "target.layout.layer_split[1]"),
        ({"layout_entry_bytes": ENTRY_BYTES // 2}, grpc.StatusCode.INVALID_ARGUMENT, "target.layout.entry_bytes"),
        ({"layout_num_tokens": 301}, grpc.StatusCode.INVALID_ARGUMENT, "target.layout.num_tokens"),
        ({"size": 300 * CONFIG.num_hidden_layers * ENTRY_BYTES - 1}, grpc.StatusCode.INVALID_ARGUMENT, "target.size"),
        ({"endpoint": ""}, grpc.StatusCode.INVALID_ARGUMENT, "target.endpoint"),
        ({"deadline_unix_ms": 1}, grpc.StatusCode.FAILED_PRECONDITION, "target.deadline_unix_ms"),
    ],
)
async def test_bad_target_is_rejected_by_field_and_keeps_the_hold(stubs, receiver, change, code, field) -> None:  # type: ignore[no-untyped-def]
    front, handoff = stubs
    engine, region = receiver
    done = await prefill(front, prompt(2, 300))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await handoff.Handoff(handoff_pb2.HandoffRequest(
            request_id=done.request_id, target=target(region, engine.endpoint, 300, **change)), timeout=30)
    assert info.value.code() == code
    assert field in info.value.details()
    # nothing moved: the same handle still hands off
    clear(region)
    ok = await handoff.Handoff(
        handoff_pb2.HandoffRequest(request_id=done.request_id, target=target(region, engine.endpoint, 300)), timeout=30)
    assert ok.bytes == 300 * CONFIG.num_hidden_layers * ENTRY_BYTES


async def test_unknown_handle_is_not_found(stubs, receiver) -> None:  # type: ignore[no-untyped-def]
    _, handoff = stubs
    engine, region = receiver
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await handoff.Handoff(
            handoff_pb2.HandoffRequest(request_id="nope", target=target(region, engine.endpoint, 10)), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "request_id" in info.value.details()


async def test_unreachable_decode_fails_unavailable_and_ends_the_hold(stubs, receiver) -> None:  # type: ignore[no-untyped-def]
    front, handoff = stubs
    _, region = receiver  # nothing serves a transfer engine on port 1
    done = await prefill(front, prompt(3, 200))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await handoff.Handoff(handoff_pb2.HandoffRequest(
            request_id=done.request_id, target=target(region, "127.0.0.1:1", 200)), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert "127.0.0.1:1" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as released:
        await front.Release(prefill_pb2.ReleaseRequest(request_id=done.request_id), timeout=10)
    assert released.value.code() == grpc.StatusCode.NOT_FOUND


async def test_stage_killed_mid_handoff_fails_the_request_cleanly(tmp_path, receiver) -> None:  # type: ignore[no-untyped-def]
    engine, region = receiver
    received = clear(region)
    with start_pipeline(tmp_path) as local:
        async with grpc.aio.insecure_channel(local.address, options=service.GRPC_OPTIONS) as channel:
            front, handoff = prefill_pb2_grpc.PrefillStub(channel), handoff_pb2_grpc.HandoffStub(channel)
            done = await prefill(front, prompt(4, 500))
            layout = HandoffLayout.of(500, SPLIT, ENTRY_BYTES)
            stage1 = local.stages[1].proc
            assert stage1 is not None
            os.kill(stage1.pid, signal.SIGSTOP)  # stage 1 takes the request but never answers
            call = asyncio.ensure_future(handoff.Handoff(
                handoff_pb2.HandoffRequest(request_id=done.request_id, target=target(region, engine.endpoint, 500)),
                timeout=60))
            # mid-handoff: stage 0's part has landed, stage 1's has not
            await eventually(lambda: bool(received[: layout.stage_nbytes(0)].any()), what="stage 0's slab")
            assert not received[layout.stage_offset(1) : layout.nbytes].any()
            local.stages[1].kill()  # kill -9
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert "stage 1" in info.value.details()
            # stage 0 let the request go: its hold is over, its pages are free again
            with pytest.raises(grpc.aio.AioRpcError) as released:
                await front.Release(prefill_pb2.ReleaseRequest(request_id=done.request_id), timeout=10)
            assert released.value.code() == grpc.StatusCode.NOT_FOUND
            assert local.stages[0].alive
