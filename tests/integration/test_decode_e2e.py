"""Prefill → handoff → decode on real processes: a 2-stage pipeline, one decode shard.

Decode reserves a region and the sequence's pages first; Prefill takes the
region as its target, and every prefill stage writes its layers into it, stage
0 the final logits too; decode scatters it into its pages and samples every
token, the first included. Greedy output must equal the single-process
reference token for token. The stages run their forward in 256-token pieces,
each streamed to decode as it ends; the same requests with the handoff after
the last forward (the bench mode) give the same greedy tokens.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import torch

from kvpool import service
from kvpool.tools.cluster import LocalDecode, LocalPipeline
from kvpool.model import InProcessPipeline, get_config, split_layers
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2, prefill_pb2, prefill_pb2_grpc
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

CONFIG = get_config("tiny")
SPLIT = split_layers(CONFIG.num_hidden_layers, 2)


STAGE_ARGS = ["--device-cache-tokens", "1024", "--forward-piece-tokens", "256"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPipeline, LocalDecode, LocalPipeline]]:
    workdir = tmp_path_factory.mktemp("e2e")
    with LocalPipeline(num_stages=2, workdir=workdir, stage_args=STAGE_ARGS) as pipeline, \
            LocalDecode(["--num-pages", "64", "--page-size", "16"], workdir=workdir) as shard, \
            LocalPipeline(num_stages=2, workdir=workdir / "after-prefill",  # the bench's baseline
                          stage_args=[*STAGE_ARGS, "--bench-forward", "handoff-after-prefill"]) as after_prefill:
        yield pipeline, shard, after_prefill


@pytest.fixture
async def stubs(cluster):  # type: ignore[no-untyped-def]
    pipeline, shard, after_prefill = cluster
    async with grpc.aio.insecure_channel(pipeline.address, options=service.GRPC_OPTIONS) as front, \
            grpc.aio.insecure_channel(shard.address, options=service.GRPC_OPTIONS) as decode, \
            grpc.aio.insecure_channel(after_prefill.address, options=service.GRPC_OPTIONS) as late:
        yield prefill_pb2_grpc.PrefillStub(front), decode_pb2_grpc.DecodeStub(decode), prefill_pb2_grpc.PrefillStub(late)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


async def start(stubs, token_ids: list[int], max_tokens: int, tenant: str = "", after_prefill: bool = False,  # type: ignore[no-untyped-def]
                **sampling: float):
    """Reserve (region and pages), prefill into the region, and open the Generate stream."""
    front, decode, late = stubs
    front = late if after_prefill else front
    stats = await decode.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
    reserve = decode_pb2.ReserveRequest(num_tokens=len(token_ids), entry_bytes=stats.entry_bytes,
                                        kv_dtype=stats.kv_dtype, max_tokens=max_tokens, with_logits=True,
                                        layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in SPLIT])
    target = (await decode.Reserve(reserve, timeout=10)).target
    done = await front.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key="e2e", target=target,
                                                          tenant=tenant),
                               timeout=120)
    assert done.handoff.bytes == len(token_ids) * CONFIG.num_hidden_layers * stats.entry_bytes + CONFIG.vocab_size * 4
    assert not done.logits  # nobody asked: decode samples from the region's logits
    call = decode.Generate(decode_pb2.DecodeRequest(
        region_id=target.region_id, prompt_token_ids=token_ids, max_tokens=max_tokens,
        sampling=decode_pb2.DecodeSampling(**sampling)), timeout=120)
    return call, done


async def test_greedy_output_through_the_handoff_equals_the_reference(stubs) -> None:  # type: ignore[no-untyped-def]
    token_ids = prompt(1, 300)  # one full 256-token block and a partial one
    call, _ = await start(stubs, token_ids, 20)
    tokens = [r.token_id async for r in call if r.HasField("token_id")]
    reference = InProcessPipeline(CONFIG, num_blocks=8, block_size=64)
    assert tokens == reference.generate_greedy(torch.tensor(token_ids), list(range(8)), 20)


async def test_streamed_and_after_prefill_handoffs_give_the_same_greedy_output(stubs) -> None:  # type: ignore[no-untyped-def]
    outputs, ranges = {}, {}
    for mode in ("push", "after_prefill"):
        runs = []
        # a cold 700-token prompt (three forward pieces), then a turn whose first 512 tokens are device hits
        for turn, token_ids in enumerate((prompt(7, 700), prompt(7, 700)[:512] + prompt(8, 150))):
            call, done = await start(stubs, token_ids, 8, tenant=f"t-{mode}", after_prefill=mode == "after_prefill")
            runs.append([r.token_id async for r in call if r.HasField("token_id")])
            ranges[mode, turn] = ([s.ranges for s in done.handoff.stages], done.figures.num_device_tokens)
        outputs[mode] = runs
    assert outputs["push"] == outputs["after_prefill"] and all(len(r) == 8 for r in outputs["push"])
    # pushed: each stage one range a piece (the cached prefix one more), the last stage also the logits
    assert ranges["push", 0] == ([3, 4], 0)
    assert ranges["push", 1] == ([2, 3], 512)
    # after the last forward: each stage its whole part at once (the last with the logits)
    assert ranges["after_prefill", 0] == ([1, 1], 0)
    assert ranges["after_prefill", 1] == ([1, 1], 512)


async def test_one_random_stream_per_request_from_the_first_token(stubs) -> None:  # type: ignore[no-untyped-def]
    token_ids = prompt(3, 40)
    runs = []
    for seed in (5, 5, 6):
        call, _ = await start(stubs, token_ids, 12, temperature=1.5, seed=seed)
        runs.append([r.token_id async for r in call if r.HasField("token_id")])
    assert runs[0] == runs[1] and runs[0] != runs[2]


async def test_cancel_frees_pages_on_both_sides(stubs, cluster) -> None:  # type: ignore[no-untyped-def]
    _, decode, _ = stubs
    pipeline, _, _ = cluster
    call, _ = await start(stubs, prompt(2, 100), 500)
    for _ in range(3):
        assert (await call.read()).HasField("token_id")
    assert (await decode.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)).num_pages_used == 38  # 599 entries
    call.cancel()

    async def decode_empty() -> bool:
        s = await decode.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
        return s.num_pages_used == 0 and s.num_regions == 0
    await eventually(decode_empty, what="decode pages freed")
    # prefill held nothing past its call
    page = urllib.request.urlopen(f"http://127.0.0.1:{pipeline.stages[0].ready['admin_port']}/metrics", timeout=5)
    assert "kvpool_prefill_device_cache_usage 0.0" in page.read().decode()
