"""The handoff's same-host path on real processes: stages copy into decode's shared receive arena.

One host, two 2-stage pipelines (``--handoff-path auto`` and ``engine``) and one decode shard. The same
prompts through both give greedy output identical to each other and to the single-process reference; the
auto pipeline's stages count every handoff byte as moved by memory (engine 0), the engine pipeline's as moved
by the engine (memory 0). A decode shard killed after its arena was mapped, or while a handoff into it runs,
fails that handoff with UNAVAILABLE naming the target, and the stages go on serving. The memory path makes no
call to decode (the region's control record and decode's doorbell instead), and writes nothing into a region
decode gave back.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvpool import service
from kvpool.model import InProcessPipeline, get_config, split_layers
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2, prefill_pb2, prefill_pb2_grpc
from kvpool.tools.cluster import LocalDecode, LocalPipeline
from tests.integration.conftest import listening_ports, metric, reserve

pytestmark = pytest.mark.cluster

CONFIG = get_config("tiny")
SPLIT = split_layers(CONFIG.num_hidden_layers, 2)
STAGE_ARGS = ["--device-cache-tokens", "1024", "--forward-piece-tokens", "256"]
Cluster = tuple[LocalPipeline, LocalPipeline, LocalDecode]  # auto and engine pipelines, one decode shard
DECODE_ARGS = ["--num-pages", "256", "--page-size", "16"]


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


def path_bytes(pipeline: LocalPipeline, path: str) -> list[float]:
    return [metric(s, f'kvpool_prefill_handoff_bytes_total{{path="{path}"}}') for s in pipeline.stages]


def landed(shard: LocalDecode) -> dict[str, float]:
    """How decode learned of the landed parts it scattered, so far."""
    return {by: metric(shard.process, f'kvpool_decode_landed_scatters_total{{by="{by}"}}')
            for by in ("doorbell", "call", "generate")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("same-host")
    with LocalPipeline(num_stages=2, workdir=workdir / "auto", stage_args=STAGE_ARGS) as auto, \
            LocalPipeline(num_stages=2, workdir=workdir / "engine",
                          stage_args=[*STAGE_ARGS, "--handoff-path", "engine"]) as engine, \
            LocalDecode(DECODE_ARGS, workdir=workdir / "decode") as shard:
        yield auto, engine, shard


async def prefill(front: prefill_pb2_grpc.PrefillStub, token_ids: list[int], target: handoff_pb2.HandoffTarget
                  ) -> prefill_pb2.PrefillResponse:
    return await front.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key="same-host",
                                                          target=target), timeout=60)


async def generate(pipeline_address: str, decode_address: str, token_ids: list[int], max_tokens: int
                   ) -> tuple[list[int], prefill_pb2.PrefillResponse]:
    """Reserve, prefill into the region, decode greedily: the tokens and the prefill's answer."""
    async with grpc.aio.insecure_channel(pipeline_address, options=service.GRPC_OPTIONS) as p, \
            grpc.aio.insecure_channel(decode_address, options=service.GRPC_OPTIONS) as d:
        decode = decode_pb2_grpc.DecodeStub(d)
        target = await reserve(decode, token_ids, max_tokens, SPLIT)
        done = await prefill(prefill_pb2_grpc.PrefillStub(p), token_ids, target)
        call = decode.Generate(decode_pb2.DecodeRequest(region_id=target.region_id, prompt_token_ids=token_ids,
                                                        max_tokens=max_tokens), timeout=60)
        return [r.token_id async for r in call if r.HasField("token_id")], done


async def test_same_host_moves_by_memory_and_engine_path_by_engine_with_identical_output(cluster: Cluster) -> None:
    auto, engine, shard = cluster
    token_ids = prompt(1, 600)  # three forward pieces: each stage several ranges, the last the logits too
    before = {name: (path_bytes(p, "memory"), path_bytes(p, "engine")) for name, p in (("auto", auto),
                                                                                       ("engine", engine))}
    told = landed(shard)
    by_memory, done_memory = await generate(auto.address, shard.address, token_ids, 12)
    # no call to decode: each stage read the fence before each copy, published its ranges and rang the doorbell,
    # and decode scattered them before the Generate (which may still find the last one unscattered)
    after_memory = landed(shard)
    assert after_memory["call"] == told["call"]
    assert after_memory["doorbell"] > told["doorbell"]
    by_engine, done_engine = await generate(engine.address, shard.address, token_ids, 12)
    assert landed(shard)["call"] > after_memory["call"]  # the engine path tells decode by Decode.Landed
    reference = InProcessPipeline(CONFIG, num_blocks=16, block_size=64)
    assert by_memory == by_engine == reference.generate_greedy(torch.tensor(token_ids), list(range(16)), 12)
    nbytes = len(token_ids) * CONFIG.num_hidden_layers * (CONFIG.kv_entry_dim * 4) + CONFIG.vocab_size * 4
    assert done_memory.handoff.bytes == done_engine.handoff.bytes == nbytes
    assert done_memory.handoff.transfers == 0 and done_engine.handoff.transfers > 0
    moved_memory = [a - b for a, b in zip(path_bytes(auto, "memory"), before["auto"][0])]
    assert all(m > 0 for m in moved_memory) and sum(moved_memory) == nbytes
    assert path_bytes(auto, "engine") == before["auto"][1] == [0.0, 0.0]
    moved_engine = [a - b for a, b in zip(path_bytes(engine, "engine"), before["engine"][1])]
    assert all(m > 0 for m in moved_engine) and sum(moved_engine) == nbytes
    assert path_bytes(engine, "memory") == before["engine"][0] == [0.0, 0.0]


async def test_decode_killed_fails_the_handoff_cleanly_and_the_stages_go_on(cluster: Cluster, tmp_path: Path) -> None:
    auto, _, shard = cluster
    token_ids = prompt(2, 700)
    with LocalDecode(DECODE_ARGS, workdir=tmp_path) as doomed:
        async with grpc.aio.insecure_channel(auto.address, options=service.GRPC_OPTIONS) as p, \
                grpc.aio.insecure_channel(doomed.address, options=service.GRPC_OPTIONS) as d:
            front, decode = prefill_pb2_grpc.PrefillStub(p), decode_pb2_grpc.DecodeStub(d)
            await prefill(front, token_ids, await reserve(decode, token_ids, 4, SPLIT))  # its arena is mapped now
            late = await reserve(decode, token_ids, 4, SPLIT)
            # killed while a handoff into it runs (if it has not ended yet: then it must fail as UNAVAILABLE)
            running = asyncio.ensure_future(
                prefill(front, prompt(3, 700), await reserve(decode, token_ids, 4, SPLIT)))
            await asyncio.sleep(0.05)
            doomed.process.kill()
            during = (await asyncio.gather(running, return_exceptions=True))[0]
            # killed after reserving: the stage's cached mapping of its arena belongs to a dead shard
            with pytest.raises(grpc.aio.AioRpcError) as after:
                await prefill(front, token_ids, late)
    assert after.value.code() == grpc.StatusCode.UNAVAILABLE, after.value.details()
    assert "mapping decode's arena" in after.value.details()  # at once, not at an RPC's deadline
    if isinstance(during, BaseException):
        assert isinstance(during, grpc.aio.AioRpcError) and during.code() == grpc.StatusCode.UNAVAILABLE, during
    assert all(s.alive for s in auto.stages)
    tokens, _ = await generate(auto.address, shard.address, token_ids, 6)
    reference = InProcessPipeline(CONFIG, num_blocks=16, block_size=64)
    assert tokens == reference.generate_greedy(torch.tensor(token_ids), list(range(16)), 6)


async def test_an_arena_out_of_the_stages_reach_goes_by_the_engine(cluster: Cluster, tmp_path: Path) -> None:
    # decode on the same declared host, but its socket is not where the stages look (another container's
    # /run, say): the handoff goes by the engine, with the same output, instead of failing
    auto, _, _ = cluster
    token_ids = prompt(4, 600)
    with LocalDecode(DECODE_ARGS, workdir=tmp_path) as fresh:  # no stage has mapped its arena yet
        async with grpc.aio.insecure_channel(auto.address, options=service.GRPC_OPTIONS) as p, \
                grpc.aio.insecure_channel(fresh.address, options=service.GRPC_OPTIONS) as d:
            decode = decode_pb2_grpc.DecodeStub(d)
            target = await reserve(decode, token_ids, 6, SPLIT)
            socket_path = Path(target.shared_memory.socket_path)
            socket_path.rename(socket_path.with_suffix(".hidden"))
            engine_before = sum(path_bytes(auto, "engine"))
            try:
                await prefill(prefill_pb2_grpc.PrefillStub(p), token_ids, target)
            finally:
                socket_path.with_suffix(".hidden").rename(socket_path)
            call = decode.Generate(decode_pb2.DecodeRequest(region_id=target.region_id, prompt_token_ids=token_ids,
                                                            max_tokens=6), timeout=60)
            tokens = [r.token_id async for r in call if r.HasField("token_id")]
    nbytes = len(token_ids) * CONFIG.num_hidden_layers * (CONFIG.kv_entry_dim * 4) + CONFIG.vocab_size * 4
    assert sum(path_bytes(auto, "engine")) - engine_before == nbytes
    reference = InProcessPipeline(CONFIG, num_blocks=16, block_size=64)
    assert tokens == reference.generate_greedy(torch.tensor(token_ids), list(range(16)), 6)


async def test_a_decode_shard_without_an_engine_opens_no_engine_port_and_takes_the_handoff_by_memory(
        cluster: Cluster, tmp_path: Path) -> None:
    auto, engine, _ = cluster
    token_ids = prompt(5, 600)
    with LocalDecode([*DECODE_ARGS, "--no-transfer-engine"], workdir=tmp_path) as portless:
        ready = portless.process.ready
        assert ready["endpoint"] == ""
        assert listening_ports(portless.process.proc.pid) == {ready["port"], ready["admin_port"]}
        tokens, done = await generate(auto.address, portless.address, token_ids, 6)
        reference = InProcessPipeline(CONFIG, num_blocks=16, block_size=64)
        assert tokens == reference.generate_greedy(torch.tensor(token_ids), list(range(16)), 6)
        assert done.handoff.transfers == 0  # every byte a copy
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # a stage told to use the engine has none to write to
            await generate(engine.address, portless.address, token_ids, 6)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    assert "target" in refused.value.details()


async def test_a_region_given_back_is_never_written_by_memory(cluster: Cluster) -> None:
    auto, _, shard = cluster
    token_ids = prompt(6, 600)
    async with grpc.aio.insecure_channel(auto.address, options=service.GRPC_OPTIONS) as p, \
            grpc.aio.insecure_channel(shard.address, options=service.GRPC_OPTIONS) as d:
        decode = decode_pb2_grpc.DecodeStub(d)
        await generate(auto.address, shard.address, prompt(7, 300), 2)  # the stages have mapped the arena
        target = await reserve(decode, token_ids, 6, SPLIT)
        assert target.control_offset > 0
        released = await decode.ReleaseRegion(decode_pb2.ReleaseRegionRequest(region_id=target.region_id),
                                              timeout=10)
        assert released.released
        before = sum(path_bytes(auto, "memory"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await prefill(prefill_pb2_grpc.PrefillStub(p), token_ids, target)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    assert "region" in refused.value.details()
    assert sum(path_bytes(auto, "memory")) == before  # not one byte copied into it
    tokens, _ = await generate(auto.address, shard.address, token_ids, 6)  # and the stages serve on
    reference = InProcessPipeline(CONFIG, num_blocks=16, block_size=64)
    assert tokens == reference.generate_greedy(torch.tensor(token_ids), list(range(16)), 6)


async def test_a_region_written_again_holds_the_second_writing(cluster: Cluster) -> None:
    # a retried request writes its region again (a lost device cache, a dead stage, another pipeline): decode,
    # having scattered the first writing already, must end up with the second one's KV
    auto, _, shard = cluster
    first, second = prompt(8, 600), prompt(9, 600)
    async with grpc.aio.insecure_channel(auto.address, options=service.GRPC_OPTIONS) as p, \
            grpc.aio.insecure_channel(shard.address, options=service.GRPC_OPTIONS) as d:
        decode, front = decode_pb2_grpc.DecodeStub(d), prefill_pb2_grpc.PrefillStub(p)
        target = await reserve(decode, second, 6, SPLIT)
        await prefill(front, first, target)
        told = landed(shard)
        await prefill(front, second, target)
        assert landed(shard)["doorbell"] > told["doorbell"]
        call = decode.Generate(decode_pb2.DecodeRequest(region_id=target.region_id, prompt_token_ids=second,
                                                        max_tokens=6), timeout=60)
        tokens = [r.token_id async for r in call if r.HasField("token_id")]
    assert landed(shard)["generate"] > told["generate"]  # scattered whole once more: it was written twice
    reference = InProcessPipeline(CONFIG, num_blocks=16, block_size=64)
    assert tokens == reference.generate_greedy(torch.tensor(second), list(range(16)), 6)
