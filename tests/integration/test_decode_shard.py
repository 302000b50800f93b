"""A real decode shard process: prompts' KV written into its regions over the real transfer engine."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import torch

from kvpool import service
from kvpool.tools.bench.decode_bench import Prepared, PromptFiller, decode_request
from kvpool.tools.cluster import LocalDecode
from kvpool.model import InProcessPipeline, get_config
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2
from kvpool.transfer import TransferEngine
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

TINY = get_config("tiny")
# 24 pages of 8 tokens: 192 KV entries, so a few long sequences fill it
SHARD_ARGS = ["--num-pages", "24", "--page-size", "8", "--max-batch-size", "8", "--region-deadline-s", "3",
              "--region-arena-bytes", "8MiB"]


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Iterator[LocalDecode]:  # type: ignore[no-untyped-def]
    with LocalDecode(SHARD_ARGS, workdir=tmp_path_factory.mktemp("decode")) as local:
        yield local


@pytest.fixture(scope="module")
def filler(engine: TransferEngine) -> Iterator[PromptFiller]:
    with PromptFiller(TINY, max_tokens=256, staging_bytes=4 << 20, engine=engine) as prompt_filler:
        yield prompt_filler


@pytest.fixture
async def stub(shard: LocalDecode) -> AsyncIterator[decode_pb2_grpc.DecodeStub]:
    async with grpc.aio.insecure_channel(shard.address, options=service.GRPC_OPTIONS) as channel:
        yield decode_pb2_grpc.DecodeStub(channel)
    # every test leaves the shard empty: nothing leaks between tests
    async with grpc.aio.insecure_channel(shard.address) as channel:
        stats_stub = decode_pb2_grpc.DecodeStub(channel)

        async def empty() -> bool:
            s = await stats_stub.Stats(decode_pb2.DecodeStatsRequest(), timeout=5)
            return s.num_pages_used == s.num_running == s.num_waiting == 0
        await eventually(empty, what="an empty shard")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Single-process generation: prefill the prompt, then one token at a time."""
    pipe = InProcessPipeline(TINY, num_blocks=32, block_size=16)
    return pipe.generate_greedy(torch.tensor(prompt_ids), list(range(32)), num_tokens)


async def collect(stream) -> tuple[list[int], decode_pb2.DecodeFigures]:  # type: ignore[no-untyped-def]
    tokens, figures = [], None
    async for reply in stream:
        if reply.HasField("token_id"):
            tokens.append(reply.token_id)
        else:
            figures = reply.figures
    assert figures is not None
    return tokens, figures


async def stats(stub: decode_pb2_grpc.DecodeStub) -> decode_pb2.DecodeStats:
    return await stub.Stats(decode_pb2.DecodeStatsRequest(), timeout=5)


def metric(shard: LocalDecode, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{shard.admin_port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_greedy_output_equals_the_single_process_reference(stub, filler) -> None:
    prompts = [prompt(n, seed=n) for n in (5, 23, 40)]
    prepared = [await filler.prepare(stub, p) for p in prompts]
    results = await asyncio.gather(*(collect(stub.Generate(decode_request(p, 12), timeout=60)) for p in prepared))
    for p, (tokens, figures) in zip(prompts, results):
        assert tokens == reference(p, 12)
        assert (figures.num_tokens, figures.finish_reason) == (12, "length")


async def test_sequences_join_and_leave_between_steps(stub, filler) -> None:
    long_prompt, short_prompts = prompt(30, seed=1), [prompt(9, seed=2), prompt(17, seed=3)]
    long = stub.Generate(decode_request(await filler.prepare(stub, long_prompt), 40), timeout=60)
    seen = []
    async for reply in long:  # the long one runs alone for a few steps ...
        seen.append(reply.token_id)
        if len(seen) == 4:
            break
    # ... then two short ones join, and leave well before it ends
    short = [await filler.prepare(stub, p) for p in short_prompts]
    short_results = await asyncio.gather(*(collect(stub.Generate(decode_request(p, 6), timeout=60)) for p in short))
    rest, figures = await collect(long)
    assert seen + rest == reference(long_prompt, 40) and figures.num_tokens == 40
    for p, (tokens, _) in zip(short_prompts, short_results):
        assert tokens == reference(p, 6)


async def test_full_shard_queues_then_cancel_frees_pages_at_once(stub, filler, shard) -> None:
    # a: 40 + 140 - 1 = 179 KV entries = 23 of the 24 pages; b needs 5 more
    a = stub.Generate(decode_request(await filler.prepare(stub, prompt(40, seed=4)), 140), timeout=60)
    first = await a.read()
    assert first.HasField("token_id")
    b_prompt = prompt(20, seed=5)
    b = asyncio.create_task(collect(stub.Generate(decode_request(await filler.prepare(stub, b_prompt), 8),
                                                  timeout=60)))

    async def b_waits() -> bool:
        s = await stats(stub)
        return (s.num_waiting, s.num_running, s.num_pages_used) == (1, 1, 23)
    await eventually(b_waits, what="b in the admission queue")
    assert metric(shard, "kvpool_decode_admission_queue_length") == 1
    assert metric(shard, "kvpool_decode_pages_used") == 23
    assert not b.done()  # queued, not failed
    a.cancel()
    tokens, figures = await b
    assert tokens == reference(b_prompt, 8) and figures.queue_seconds > 0
    assert metric(shard, "kvpool_decode_pages_used") == 0


async def test_cancel_mid_stream_frees_pages(stub, filler, shard) -> None:
    call = stub.Generate(decode_request(await filler.prepare(stub, prompt(16, seed=6)), 100), timeout=60)
    for _ in range(3):
        await call.read()
    assert (await stats(stub)).num_pages_used == 15  # 16 + 100 - 1 = 115 entries
    call.cancel()
    await eventually(lambda: metric(shard, "kvpool_decode_pages_used") == 0, what="pages freed")


async def test_seeded_sampling_is_reproducible(stub, filler) -> None:
    p = prompt(12, seed=7)
    runs = []
    for seed in (11, 11, 12):
        prepared = await filler.prepare(stub, p)
        request = decode_request(prepared, 16, temperature=1.0, top_p=0.95, top_k=50, seed=seed)
        runs.append((await collect(stub.Generate(request, timeout=60)))[0])
    assert runs[0] == runs[1] and runs[0] != runs[2]


async def test_pages_reserved_before_prefill_and_every_token_sampled_here(stub, filler, shard) -> None:
    p = prompt(5, seed=20)
    prepared = await filler.prepare(stub, p, max_tokens=12, with_logits=True)
    s = await stats(stub)
    # 5 + 12 - 1 = 16 entries: 2 pages of 8, held before Generate; the region holds KV then logits
    assert (s.num_reserved, s.num_pages_used, s.num_regions) == (1, 2, 1)
    assert s.region_trailer_bytes == TINY.vocab_size * 4
    assert metric(shard, "kvpool_decode_reserved_sequences") == 1
    request = decode_request(prepared, 12)
    request.first_token = 0  # ignored: decode draws the first token from the region's logits
    tokens, figures = await collect(stub.Generate(request, timeout=60))
    assert tokens == reference(p, 12) and figures.num_tokens == 12
    assert metric(shard, "kvpool_decode_reserved_sequences") == 0


async def test_a_reservation_given_back_frees_pages_and_region_at_once(stub, filler, shard) -> None:
    reply = await stub.Reserve(filler.reserve_request(30, max_tokens=50, with_logits=True), timeout=10)
    assert metric(shard, "kvpool_decode_pages_used") == 10  # 30 + 50 - 1 = 79 entries
    assert metric(shard, "kvpool_decode_region_bytes_used") > 0
    assert (await stub.ReleaseRegion(decode_pb2.ReleaseRegionRequest(region_id=reply.target.region_id))).released
    # at once: the metrics show it before any sweep could run
    assert metric(shard, "kvpool_decode_pages_used") == 0
    assert metric(shard, "kvpool_decode_reserved_sequences") == 0
    # the bytes once a prefill write that checked the region just before can no longer land
    # (services/decode/shard.py WRITER_GRACE_S, a fraction of a second)
    await eventually(lambda: metric(shard, "kvpool_decode_region_bytes_used") == 0, timeout_s=5,
                     what="the region's bytes after the writers' grace")
    with pytest.raises(grpc.aio.AioRpcError) as full:
        await stub.Reserve(filler.reserve_request(100, max_tokens=100, with_logits=True), timeout=10)
    assert full.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pages" in full.value.details()


async def test_a_generate_refused_after_its_reservation_frees_it_at_once(stub, filler, shard) -> None:
    prepared = await filler.prepare(stub, prompt(6, seed=30), max_tokens=10, with_logits=True)
    assert metric(shard, "kvpool_decode_pages_used") == 2  # 6 + 10 - 1 = 15 entries
    error = await rejected(stub.Generate(decode_request(prepared, 12), timeout=30))  # not what it reserved
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the field travels beside the message, never read out of its text
    assert dict(error.trailing_metadata())["kvpool-field"] == "max_tokens"
    assert metric(shard, "kvpool_decode_pages_used") == 0
    await eventually(lambda: metric(shard, "kvpool_decode_region_bytes_used") == 0, timeout_s=5,
                     what="the region's bytes after the writers' grace")


async def test_seeded_sampling_with_the_first_token_drawn_here(stub, filler) -> None:
    p = prompt(12, seed=21)
    runs = []
    for seed in (11, 11, 12):
        prepared = await filler.prepare(stub, p, max_tokens=16, with_logits=True)
        request = decode_request(prepared, 16, temperature=1.5, seed=seed)
        runs.append((await collect(stub.Generate(request, timeout=60)))[0])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len(runs[0]) == 16


async def test_stop_token_ends_the_sequence(stub, filler) -> None:
    p = prompt(10, seed=8)
    expected = reference(p, 10)
    prepared = await filler.prepare(stub, p)
    request = decode_request(prepared, 10)
    request.stop_token_ids.append(expected[3])
    tokens, figures = await collect(stub.Generate(request, timeout=60))
    stop_at = expected.index(expected[3])
    assert tokens == expected[: stop_at + 1] and figures.finish_reason == "stop"


async def rejected(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = await call if not hasattr(call, "read") else await collect(call)
        del result
    return info.value


@pytest.mark.parametrize("change,code,field", [
    ({"max_tokens": 0}, "INVALID_ARGUMENT", "max_tokens"),
    ({"max_tokens": 40000}, "INVALID_ARGUMENT", "max_tokens: a 8-token prompt plus 40000 tokens exceeds"),
    ({"temperature": -0.5}, "INVALID_ARGUMENT", "temperature"),
    ({"top_p": 1.5}, "INVALID_ARGUMENT", "top_p"),
    ({"region_id": "999999"}, "NOT_FOUND", "region_id"),
    ({"region_id": "abc"}, "INVALID_ARGUMENT", "region_id"),
    ({"prompt_token_ids": [1, 2, 3]}, "INVALID_ARGUMENT", "prompt_token_ids"),
    ({"first_token": 5000}, "INVALID_ARGUMENT", "first_token"),
])
async def test_bad_generate_is_invalid_argument_and_the_shard_keeps_serving(stub, filler, change, code, field) -> None:
    p = prompt(8, seed=9)
    prepared = await filler.prepare(stub, p)
    request = decode_request(prepared, 4)
    for key, value in change.items():
        if key in ("temperature", "top_p"):
            setattr(request.sampling, key, value)
        elif key == "prompt_token_ids":
            del request.prompt_token_ids[:]
            request.prompt_token_ids.extend(value)
        else:
            setattr(request, key, value)
    error = await rejected(stub.Generate(request, timeout=30))
    assert error.code().name == code and field in error.details()
    # the region is still usable (checks come before the claim) or was freed; the shard serves
    if change.get("prompt_token_ids") is None:
        tokens, _ = await collect(stub.Generate(decode_request(prepared, 4), timeout=30))
        assert tokens == reference(p, 4)
    else:
        again = await rejected(stub.Generate(decode_request(prepared, 4), timeout=30))
        assert again.code().name == "INVALID_ARGUMENT" and "region_id" in again.details()


async def test_a_region_used_twice_is_refused(stub, filler) -> None:
    prepared = await filler.prepare(stub, prompt(8, seed=10))
    await collect(stub.Generate(decode_request(prepared, 2), timeout=30))
    error = await rejected(stub.Generate(decode_request(prepared, 2), timeout=30))
    assert error.code().name == "INVALID_ARGUMENT" and "region_id" in error.details()


@pytest.mark.parametrize("change,field", [
    ({"layer_split": [(0, 4)]}, "layer_split"),
    ({"layer_split": [(0, 4), (5, 8)]}, "layer_split"),
    ({"entry_bytes": 192}, "entry_bytes"),
    ({"kv_dtype": "bfloat16"}, "kv_dtype"),
    ({"num_tokens": 0}, "num_tokens"),
])
async def test_reserve_refuses_a_layout_the_model_disagrees_with(stub, filler, change, field) -> None:
    request = filler.reserve_request(8)
    for key, value in change.items():
        if key == "layer_split":
            del request.layer_split[:]
            request.layer_split.extend(handoff_pb2.LayerRange(start=s, end=e) for s, e in value)
        else:
            setattr(request, key, value)
    error = await rejected(stub.Reserve(request, timeout=10))
    assert error.code().name == "INVALID_ARGUMENT" and field in error.details()
    reply = await stub.Reserve(filler.reserve_request(8), timeout=10)
    assert (await stub.ReleaseRegion(decode_pb2.ReleaseRegionRequest(region_id=reply.target.region_id))).released


async def test_an_unclaimed_region_is_reclaimed_at_its_deadline(stub, filler) -> None:
    reply = await stub.Reserve(filler.reserve_request(8), timeout=10)
    assert (await stats(stub)).num_regions >= 1
    await eventually(lambda: _no_regions(stub), timeout_s=20, what="the region's deadline")
    error = await rejected(stub.Generate(decode_request(Prepared(reply.target.region_id, prompt(8, 1), 1), 2),
                                         timeout=10))
    assert error.code().name == "INVALID_ARGUMENT" and "expired" in error.details()


async def _no_regions(stub: decode_pb2_grpc.DecodeStub) -> bool:
    return (await stats(stub)).num_regions == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
async def test_low_precision_shard_equals_the_same_dtype_reference(tmp_path, engine, dtype, request) -> None:  # type: ignore[no-untyped-def]
    p = prompt(20, seed=12)
    pipe = InProcessPipeline(TINY, num_blocks=32, block_size=16, kv_dtype=getattr(torch, dtype))
    expected = pipe.generate_greedy(torch.tensor(p), list(range(32)), 10)
    filler = PromptFiller(TINY, dtype, max_tokens=64, staging_bytes=1 << 20, engine=engine)
    request.addfinalizer(filler.close)
    with LocalDecode(["--kv-dtype", dtype, "--num-pages", "16", "--page-size", "8"], workdir=tmp_path) as shard:
        async with grpc.aio.insecure_channel(shard.address) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            assert (await stats(stub)).entry_bytes == TINY.kv_entry_dim * getattr(torch, dtype).itemsize
            tokens, _ = await collect(stub.Generate(decode_request(await filler.prepare(stub, p), 10), timeout=60))
    assert tokens == expected
