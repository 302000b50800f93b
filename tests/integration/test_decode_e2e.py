"""Prefill → handoff → decode on real processes: a 2-stage pipeline, one decode shard.

Prefill computes the prompt and its first token; decode reserves a region;
every prefill stage writes its layers into it (the Handoff RPC); decode
scatters it into its pages and generates. Greedy output must equal the
single-process reference token for token.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest
import torch

from kvpool import service
from kvpool.tools.cluster import LocalDecode, LocalPipeline
from kvpool.model import InProcessPipeline, get_config, split_layers
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2, handoff_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

CONFIG = get_config("tiny")
SPLIT = split_layers(CONFIG.num_hidden_layers, 2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPipeline, LocalDecode]]:
    workdir = tmp_path_factory.mktemp("e2e")
    with LocalPipeline(num_stages=2, workdir=workdir, stage_args=["--device-cache-tokens", "1024"]) as pipeline, \
            LocalDecode(["--num-pages", "64", "--page-size", "16"], workdir=workdir) as shard:
        yield pipeline, shard


@pytest.fixture
async def stubs(cluster):  # type: ignore[no-untyped-def]
    pipeline, shard = cluster
    async with grpc.aio.insecure_channel(pipeline.address, options=service.GRPC_OPTIONS) as front, \
            grpc.aio.insecure_channel(shard.address, options=service.GRPC_OPTIONS) as decode:
        yield (prefill_pb2_grpc.PrefillStub(front), handoff_pb2_grpc.HandoffStub(front),
               decode_pb2_grpc.DecodeStub(decode))


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


async def start(stubs, token_ids: list[int], max_tokens: int):  # type: ignore[no-untyped-def]
    """Prefill, reserve, hand off, and open the Generate stream; the stream and the prefill answer."""
    front, handoff, decode = stubs
    done = await front.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key="e2e"), timeout=120)
    stats = await decode.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
    reserve = decode_pb2.ReserveRequest(num_tokens=len(token_ids), entry_bytes=stats.entry_bytes,
                                        kv_dtype=stats.kv_dtype,
                                        layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in SPLIT])
    target = (await decode.Reserve(reserve, timeout=10)).target
    written = await handoff.Handoff(handoff_pb2.HandoffRequest(request_id=done.request_id, target=target), timeout=60)
    assert written.bytes == len(token_ids) * CONFIG.num_hidden_layers * stats.entry_bytes
    call = decode.Generate(decode_pb2.DecodeRequest(region_id=target.region_id, prompt_token_ids=token_ids,
                                                    first_token=done.first_token, max_tokens=max_tokens), timeout=120)
    return call, done


async def test_greedy_output_through_the_handoff_equals_the_reference(stubs) -> None:  # type: ignore[no-untyped-def]
    token_ids = prompt(1, 300)  # one full 256-token block and a partial one
    call, _ = await start(stubs, token_ids, 20)
    tokens = [r.token_id async for r in call if r.HasField("token_id")]
    reference = InProcessPipeline(CONFIG, num_blocks=8, block_size=64)
    assert tokens == reference.generate_greedy(torch.tensor(token_ids), list(range(8)), 20)


async def test_cancel_frees_pages_on_both_sides(stubs, cluster) -> None:  # type: ignore[no-untyped-def]
    front, _, decode = stubs
    call, done = await start(stubs, prompt(2, 100), 500)
    for _ in range(3):
        assert (await call.read()).HasField("token_id")
    assert (await decode.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)).num_pages_used == 38  # 599 entries
    call.cancel()

    async def decode_empty() -> bool:
        s = await decode.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
        return s.num_pages_used == 0 and s.num_regions == 0
    await eventually(decode_empty, what="decode pages freed")
    # prefill: the handoff ended the request's hold, so its blocks are no longer held
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await front.Release(prefill_pb2.ReleaseRequest(request_id=done.request_id), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
