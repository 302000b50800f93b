"""A decode shard's ``Serve``: one call takes the request's room, has its pipeline prefill into it and decodes.

On real processes (a two-stage pipeline, decode shards with and without ``--pipelines``): the first message is
the prefill's answer, the tokens are the single-process reference's; bad input is refused naming the field
before any room is taken, and the shard serves on; a pipeline that is down comes back UNAVAILABLE naming the
field ``pipeline``; a router's call (``room_at_once``) that finds no room is refused at once and WatchRoom says
when room comes back, while an older router's call waits for the room a request is giving back, woken by it,
and gives up with RESOURCE_EXHAUSTED after ``--room-wait-s``; a call cancelled during its prefill leaves no region
and no pages behind. A router's call (``first_token_early``) gets its first token once the whole region landed,
before the prefill's answer.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
from collections.abc import Iterator

import grpc
import pytest
import torch

from kvpool import service
from kvpool.model import InProcessPipeline, get_config, split_layers
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2
from kvpool.status import FIELD_KEY, ROOM_EPOCH_KEY
from kvpool.tools.cluster import LocalDecode, LocalPipeline
from tests.integration.conftest import eventually, metric

pytestmark = pytest.mark.cluster

CONFIG = get_config("tiny")
SPLIT = split_layers(CONFIG.num_hidden_layers, 2)
# a small arena: two 600-token regions fill it (600 × 8 layers × 384 B + logits ≈ 1.9 MB each)
DECODE_ARGS = ["--num-pages", "256", "--page-size", "16", "--region-arena-bytes", "4MiB", "--room-wait-s", "2"]


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPipeline, LocalDecode, LocalDecode]]:
    workdir = tmp_path_factory.mktemp("serve")
    with LocalPipeline(num_stages=2, workdir=workdir / "pipeline",
                       stage_args=["--device-cache-tokens", "2048", "--forward-piece-tokens", "256"]) as pipeline, \
            LocalDecode([*DECODE_ARGS, "--pipelines", pipeline.address], workdir=workdir / "told") as told, \
            LocalDecode(DECODE_ARGS, workdir=workdir / "open") as open_shard:
        yield pipeline, told, open_shard


def serve_request(pipeline: str, token_ids: list[int], max_tokens: int = 6, **changes: object
                  ) -> decode_pb2.ServeRequest:
    request = decode_pb2.ServeRequest(
        prompt_token_ids=token_ids, max_tokens=max_tokens, prefill_address=pipeline, session_key="serve",
        layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in SPLIT], prefill_timeout_s=60)
    for name, value in changes.items():
        if name == "temperature":
            request.sampling.temperature = float(value)  # type: ignore[arg-type]
        elif name in ("layer_split", "prompt_token_ids"):
            del getattr(request, name)[:]
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    return request


async def serve(address: str, request: decode_pb2.ServeRequest) -> tuple[decode_pb2.PrefillResponse, list[int]]:
    async with service.channel(address) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Serve(request, timeout=60)
        responses = [r async for r in call]
    assert responses[0].HasField("prefilled") and responses[-1].HasField("figures")
    return responses[0].prefilled, [r.token_id for r in responses[1:-1]]


async def stats(address: str) -> decode_pb2.DecodeStats:
    async with service.channel(address) as channel:
        return await decode_pb2_grpc.DecodeStub(channel).Stats(decode_pb2.DecodeStatsRequest(), timeout=10)


def reference(token_ids: list[int], max_tokens: int) -> list[int]:
    return InProcessPipeline(CONFIG, num_blocks=16, block_size=64).generate_greedy(
        torch.tensor(token_ids), list(range(16)), max_tokens)


async def test_one_call_prefills_into_its_region_and_decodes(parts) -> None:  # type: ignore[no-untyped-def]
    pipeline, told, _ = parts
    token_ids = prompt(1, 600)
    prefilled, tokens = await serve(told.address, serve_request(pipeline.address, token_ids))
    assert prefilled.figures.num_computed_tokens == 600 and prefilled.handoff.bytes > 0
    assert tokens == reference(token_ids, 6)
    again, _ = await serve(told.address, serve_request(pipeline.address, token_ids))
    assert again.figures.num_device_tokens == 512  # the next turn's prefix is a device hit
    left = await stats(told.address)
    assert (left.num_regions, left.num_pages_used, left.num_reserved) == (0, 0, 0)


async def test_with_first_token_early_tokens_leave_once_the_region_landed(parts):  # type: ignore[no-untyped-def]
    """A router's call (``first_token_early``): on a device hit the whole region lands before the prefill's
    answer comes back along the stages, and the first token leaves then; the answer still comes once, before
    the figures, the tokens are the reference's and nothing is held afterwards."""
    pipeline, told, _ = parts
    token_ids = prompt(7, 600)
    await serve(told.address, serve_request(pipeline.address, token_ids))  # the next calls' prefix: a device hit
    early = metric(told.process, "kvpool_decode_early_starts_total")
    orders = []
    for extra in range(5):
        request = serve_request(pipeline.address, token_ids + [extra], first_token_early=True, room_at_once=True)
        async with service.channel(told.address) as channel:
            responses = [r async for r in decode_pb2_grpc.DecodeStub(channel).Serve(request, timeout=60)]
        events = [r.WhichOneof("event") for r in responses]
        assert events[0] == "reserved" and events[-1] == "figures" and events.count("prefilled") == 1
        tokens = [r.token_id for r in responses if r.WhichOneof("event") == "token_id"]
        assert tokens == reference(token_ids + [extra], 6)
        orders.append(events.index("prefilled") > events.index("token_id"))
    # the region lands by the doorbell, one hop; the answer comes back along two stages: some token went first
    assert any(orders) and metric(told.process, "kvpool_decode_early_starts_total") > early
    left = await stats(told.address)
    assert (left.num_regions, left.num_pages_used, left.num_reserved) == (0, 0, 0)


def free_port_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


BAD = {
    "an address that is not host:port": ({"prefill_address": "nowhere"}, "prefill_address",
                                         grpc.StatusCode.INVALID_ARGUMENT),
    "a pipeline the shard was not told of": ({"prefill_address": "127.0.0.1:1"}, "prefill_address",
                                             grpc.StatusCode.PERMISSION_DENIED),
    "a token outside the vocabulary": ({"prompt_token_ids": [1, CONFIG.vocab_size]}, "prompt_token_ids[1]",
                                       grpc.StatusCode.INVALID_ARGUMENT),
    "no tokens to make": ({"max_tokens": 0}, "max_tokens", grpc.StatusCode.INVALID_ARGUMENT),
    "a negative temperature": ({"temperature": -1.0}, "temperature", grpc.StatusCode.INVALID_ARGUMENT),
    "a split that does not tile the model": ({"layer_split": [handoff_pb2.LayerRange(start=0, end=3)]},
                                             "layer_split", grpc.StatusCode.INVALID_ARGUMENT),
    "a negative prefill timeout": ({"prefill_timeout_s": -1.0}, "prefill_timeout_s",
                                   grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_input_is_refused_naming_the_field_and_takes_no_room(parts, case: str) -> None:  # type: ignore[no-untyped-def]
    pipeline, told, _ = parts
    changes, field, code = BAD[case]
    async with service.channel(told.address) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Serve(serve_request(pipeline.address, prompt(2, 40), **changes),
                                                          timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in call]
    assert info.value.code() == code, (case, info.value.details())
    assert dict(await call.trailing_metadata() or ()).get(FIELD_KEY) == field, (case, info.value.details())
    assert (await stats(told.address)).num_regions == 0
    token_ids = prompt(3, 100)
    assert (await serve(told.address, serve_request(pipeline.address, token_ids)))[1] == reference(token_ids, 6)


async def test_a_pipeline_that_is_down_is_named_as_the_failed_part(parts) -> None:  # type: ignore[no-untyped-def]
    _, _, open_shard = parts  # told of no pipeline: any address
    async with service.channel(open_shard.address) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Serve(serve_request(free_port_address(), prompt(4, 40)),
                                                          timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in call]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert dict(await call.trailing_metadata() or ()).get(FIELD_KEY) == "pipeline"
    assert (await stats(open_shard.address)).num_regions == 0


async def hold_region(decode: decode_pb2_grpc.DecodeStub, address: str) -> handoff_pb2.HandoffTarget:
    """A 600-token region (half the arena) held for a minute."""
    shape = await stats(address)
    return (await decode.Reserve(decode_pb2.ReserveRequest(
        num_tokens=600, layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in SPLIT],
        entry_bytes=shape.entry_bytes, kv_dtype=shape.kv_dtype, with_logits=True, hold_s=60), timeout=10)).target


async def test_a_call_without_room_waits_for_room_given_back_then_gives_up(parts) -> None:  # type: ignore[no-untyped-def]
    pipeline, _, open_shard = parts
    token_ids = prompt(5, 600)
    async with service.channel(open_shard.address) as channel:
        decode = decode_pb2_grpc.DecodeStub(channel)
        held = [await hold_region(decode, open_shard.address) for _ in range(2)]  # the arena is full now
        waits = metric(open_shard.process, "kvpool_decode_room_waits_total")
        waiting = asyncio.ensure_future(serve(open_shard.address, serve_request(pipeline.address, token_ids)))
        await eventually(lambda: metric(open_shard.process, "kvpool_decode_room_waits_total") > waits,
                         what="the call waiting for room")
        assert not waiting.done()
        await decode.ReleaseRegion(decode_pb2.ReleaseRegionRequest(region_id=held[0].region_id), timeout=10)
        _, tokens = await asyncio.wait_for(waiting, 60)  # woken by the give-back
        assert tokens == reference(token_ids, 6)
        # with the other still held and nothing given back, the call gives up after --room-wait-s
        filler = await hold_region(decode, open_shard.address)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await serve(open_shard.address, serve_request(pipeline.address, token_ids))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        for target in (held[1], filler):
            await decode.ReleaseRegion(decode_pb2.ReleaseRegionRequest(region_id=target.region_id), timeout=10)


async def test_a_router_call_without_room_is_refused_at_once_and_told_of_room(parts):  # type: ignore[no-untyped-def]
    """With room_at_once (what the router sends): ``reserved`` comes first; no room is RESOURCE_EXHAUSTED at
    once naming the field and the give-backs so far, and WatchRoom says when one follows."""
    pipeline, _, open_shard = parts
    token_ids = prompt(8, 600)

    async def arena_empty() -> bool:  # what an earlier test gave back drains after the writers' grace
        return (await stats(open_shard.address)).region_bytes_used == 0

    await eventually(arena_empty, what="an empty arena")
    async with service.channel(open_shard.address) as channel:
        decode = decode_pb2_grpc.DecodeStub(channel)
        first = [r async for r in decode.Serve(serve_request(pipeline.address, token_ids, room_at_once=True),
                                                timeout=60)]
        assert first[0].HasField("reserved") and first[1].HasField("prefilled")
        assert [r.token_id for r in first[2:-1]] == reference(token_ids, 6)
        watch = decode.WatchRoom(decode_pb2.WatchRoomRequest(), timeout=60)
        epoch = (await watch.read()).epoch  # the count now, at once
        held = [await hold_region(decode, open_shard.address) for _ in range(2)]  # the arena is full now
        waits = metric(open_shard.process, "kvpool_decode_room_waits_total")
        call = decode.Serve(serve_request(pipeline.address, token_ids, room_at_once=True), timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        trailer = dict(await call.trailing_metadata() or ())
        assert trailer.get(FIELD_KEY) == "decode_room" and trailer.get(ROOM_EPOCH_KEY) == str(epoch)
        assert metric(open_shard.process, "kvpool_decode_room_waits_total") == waits  # it did not wait
        next_event = asyncio.ensure_future(watch.read())
        await asyncio.sleep(0.2)
        assert not next_event.done()  # nothing given back yet: the stream says nothing
        await decode.ReleaseRegion(decode_pb2.ReleaseRegionRequest(region_id=held[0].region_id), timeout=10)
        told = (await asyncio.wait_for(next_event, 10)).epoch
        assert told > epoch  # the give-back after the refusal
        # asked again each time it says so (its pages come back at once, the region's bytes after the
        # writers' grace: two give-backs, and asking after the first may be refused again)
        for _ in range(3):
            try:
                again = [r async for r in decode.Serve(
                    serve_request(pipeline.address, token_ids, room_at_once=True), timeout=60)]
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                told = (await asyncio.wait_for(watch.read(), 10)).epoch
        assert again[0].HasField("reserved") and again[0].reserved.room_epoch >= told
        watch.cancel()
        await decode.ReleaseRegion(decode_pb2.ReleaseRegionRequest(region_id=held[1].region_id), timeout=10)
    assert metric(open_shard.process, "kvpool_decode_room_refusals_total") >= 1


async def test_a_call_cancelled_during_its_prefill_leaves_nothing_held(parts) -> None:  # type: ignore[no-untyped-def]
    pipeline, told, _ = parts
    later = pipeline.stages[1].proc
    later.send_signal(signal.SIGSTOP)  # the prefill cannot end while stage 1 is stopped
    try:
        async with service.channel(told.address) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).Serve(serve_request(pipeline.address, prompt(6, 600)),
                                                              timeout=60)
            await eventually(lambda: metric(told.process, "kvpool_decode_regions") == 1.0,
                             what="the region reserved")
            call.cancel()
    finally:
        later.send_signal(signal.SIGCONT)

    async def nothing_held() -> bool:
        left = await stats(told.address)
        return (left.num_regions, left.num_pages_used, left.num_reserved) == (0, 0, 0)

    await eventually(nothing_held, what="the region and pages given back")
    token_ids = prompt(7, 300)
    assert (await serve(told.address, serve_request(pipeline.address, token_ids)))[1] == reference(token_ids, 6)


async def test_sigterm_drains_without_waiting_for_a_routers_room_watch(parts) -> None:  # type: ignore[no-untyped-def]
    """A router's WatchRoom stream lives as long as the router: a draining shard does not count it as a call
    in flight (counted, every drain lasted its whole grace, 20 s, and a rolling restart waited that long per
    shard). Last in this module: the shard is stopped."""
    _, _, open_shard = parts
    async with service.channel(open_shard.address) as channel:
        watch = decode_pb2_grpc.DecodeStub(channel).WatchRoom(decode_pb2.WatchRoomRequest(), timeout=60)
        await watch.read()  # the stream is open on the shard
        # SIGTERM, SIGKILL after 10 s: well inside the shard's 20 s drain, past its quiet 1.5 s
        code = await asyncio.to_thread(open_shard.process.stop, 10.0)
        watch.cancel()
    drained = [line for line in open_shard.process.log_file.read_text().splitlines() if '"drained"' in line]
    assert code == 0 and drained and '"calls_left": 0' in drained[-1], open_shard.process.log_tail()
