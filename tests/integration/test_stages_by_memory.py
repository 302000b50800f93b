"""Prefill stages on one host move their bytes by memory, and can run with no transfer engine at all (issue 36).

One host: a pool (master, one store), one decode shard and two 2-stage pipelines on it, one with the
defaults and one with ``--no-transfer-engine`` on every stage. With the defaults, stage 1 copies each
piece's hidden states from stage 0's shared send arena (memory bytes counted, engine 0) and the logits are
the reference's; while that arena's socket is out of stage 1's reach, it reads them with the engine instead.
Without an engine, a prompt saved to the pool, evicted and prefilled again restores from the pool and hands
off into decode by memory, with decode's greedy output the reference's; a handoff target on another declared
host is refused UNAVAILABLE naming the target before any work; and each stage listens on no TCP port but its
gRPC and admin ports (the default pipeline's stages listen on their engine's as well).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvpool import service
from kvpool.model import InProcessPipeline, get_config, split_layers
from kvpool.rpc import decode_pb2, decode_pb2_grpc, pool_pb2, pool_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from kvpool.tools.cluster import LocalDecode, LocalPipeline, LocalPool
from tests.integration.conftest import eventually, listening_ports, metric, reserve

pytestmark = pytest.mark.cluster

CONFIG = get_config("tiny")
CHUNK = 256
SPLIT = split_layers(CONFIG.num_hidden_layers, 2)
STAGE_ARGS = ["--device-cache-tokens", str(4 * CHUNK), "--forward-piece-tokens", str(CHUNK)]
DECODE_ARGS = ["--num-pages", "256", "--page-size", "16"]
Cluster = tuple[LocalPool, LocalPipeline, LocalPipeline, LocalDecode]  # pool, defaults, no engine, decode


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


def activation_bytes(pipeline: LocalPipeline, path: str) -> float:
    """Stage 1's ``kvpool_prefill_activation_bytes_total{path}``: what it received from stage 0."""
    return metric(pipeline.stages[1], f'kvpool_prefill_activation_bytes_total{{path="{path}"}}')


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("stages-by-memory")
    with LocalPool(num_stores=1, segment_size="32MiB", workdir=workdir / "pool") as pool, \
            LocalPipeline(num_stages=2, master=pool.master_address, workdir=workdir / "defaults",
                          stage_args=STAGE_ARGS) as defaults, \
            LocalPipeline(num_stages=2, master=pool.master_address, workdir=workdir / "no-engine",
                          stage_args=[*STAGE_ARGS, "--no-transfer-engine"]) as no_engine, \
            LocalDecode(DECODE_ARGS, workdir=workdir / "decode") as decode:
        yield pool, defaults, no_engine, decode


async def prefill_moved(pipeline: LocalPipeline, seed: int) -> dict[str, float]:
    """Prefill a 700-token prompt (pieces of 256, 256 and 188 tokens: each over the inline limit), check its logits
    against the reference, and say how many bytes of hidden states stage 1 received by each path."""
    token_ids = prompt(seed, 700)
    before = {path: activation_bytes(pipeline, path) for path in ("memory", "engine", "inline")}
    async with grpc.aio.insecure_channel(pipeline.address, options=service.GRPC_OPTIONS) as channel:
        done = await prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
            token_ids=token_ids, session_key=f"moved-{seed}", return_logits=True), timeout=60)
    reference = InProcessPipeline(CONFIG, num_blocks=3, block_size=CHUNK)
    logits = torch.frombuffer(bytearray(done.logits), dtype=torch.float32)
    assert torch.allclose(logits, reference.forward(torch.tensor(token_ids), [0, 1, 2], 0)[-1], atol=1e-4)
    return {path: activation_bytes(pipeline, path) - b for path, b in before.items()}


PIECES_BYTES = 700 * CONFIG.hidden_size * 4


async def test_a_send_arena_out_of_the_next_stages_reach_goes_by_the_engine(cluster: Cluster) -> None:
    # first in this module: stage 1 has not mapped stage 0's arena yet, and its socket is not where it looks
    # (another container's folder, say): the hidden states go by the engine, with the same logits
    _, defaults, _, _ = cluster
    log = (defaults.workdir / "stage0.log").read_text().splitlines()
    offered = next(json.loads(line) for line in log if '"shared_memory_offered"' in line)
    socket_path = Path(offered["socket"])
    socket_path.rename(socket_path.with_suffix(".hidden"))
    try:
        moved = await prefill_moved(defaults, seed=11)
    finally:
        socket_path.with_suffix(".hidden").rename(socket_path)
    assert moved == {"memory": 0.0, "engine": PIECES_BYTES, "inline": 0.0}


async def test_hidden_states_move_by_memory_and_give_the_reference_logits(cluster: Cluster) -> None:
    _, defaults, _, _ = cluster
    assert await prefill_moved(defaults, seed=1) == {"memory": PIECES_BYTES, "engine": 0.0, "inline": 0.0}


async def test_without_an_engine_a_restore_and_a_handoff_go_by_memory_end_to_end(cluster: Cluster) -> None:
    pool, _, no_engine, decode_shard = cluster
    token_ids = prompt(2, 600)  # 2 full chunks (saved, then restored) + 88 tokens
    async with grpc.aio.insecure_channel(no_engine.address, options=service.GRPC_OPTIONS) as p, \
            grpc.aio.insecure_channel(decode_shard.address, options=service.GRPC_OPTIONS) as d, \
            grpc.aio.insecure_channel(pool.master_address) as m:
        front, decode, master = prefill_pb2_grpc.PrefillStub(p), decode_pb2_grpc.DecodeStub(d), \
            pool_pb2_grpc.PoolMasterStub(m)
        groups = (await master.Stats(pool_pb2.StatsRequest())).num_complete_groups
        first = await front.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key="s"), timeout=60)
        assert first.figures.num_computed_tokens == 600

        async def saved() -> bool:
            return (await master.Stats(pool_pb2.StatsRequest())).num_complete_groups >= groups + 2
        await eventually(saved, what="the 2 chunks saved by memory")
        # another prompt takes every device block: the first one's history must come back from the pool
        await front.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt(3, 4 * CHUNK - 10), session_key="other"),
                            timeout=60)
        target = await reserve(decode, token_ids, 8, SPLIT)
        again = await front.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key="s", target=target),
                                    timeout=60)
        assert (again.figures.num_pool_tokens, again.figures.num_computed_tokens) == (2 * CHUNK, 88)
        call = decode.Generate(decode_pb2.DecodeRequest(region_id=target.region_id, prompt_token_ids=token_ids,
                                                        max_tokens=8), timeout=60)
        tokens = [r.token_id async for r in call if r.HasField("token_id")]
        reference = InProcessPipeline(CONFIG, num_blocks=16, block_size=64)
        assert tokens == reference.generate_greedy(torch.tensor(token_ids), list(range(16)), 8)

        elsewhere = await reserve(decode, token_ids, 8, SPLIT)
        elsewhere.host = "another-host"  # decode on another declared host: only an engine reaches it
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await front.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, session_key="s", target=elsewhere),
                                timeout=60)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    assert "target.host" in refused.value.details() and "--no-transfer-engine" in refused.value.details()
    for stage in no_engine.stages:
        for direction in ("read", "write"):
            assert metric(stage, f'kvpool_prefill_pool_bytes_total{{direction="{direction}",path="engine"}}') == 0
        assert metric(stage, 'kvpool_prefill_pool_bytes_total{direction="read",path="memory"}') > 0
        assert metric(stage, 'kvpool_prefill_handoff_bytes_total{path="engine"}') == 0
    assert activation_bytes(no_engine, "memory") > 0 and activation_bytes(no_engine, "engine") == 0


def test_a_stage_without_an_engine_listens_on_its_grpc_and_admin_ports_only(cluster: Cluster) -> None:
    _, defaults, no_engine, _ = cluster
    for stage in no_engine.stages:
        assert stage.ready["endpoint"] == ""
        assert listening_ports(stage.proc.pid) == {stage.ready["port"], stage.ready["admin_port"]}
    for stage in defaults.stages:  # the check sees an engine's port where there is one
        assert listening_ports(stage.proc.pid) > {stage.ready["port"], stage.ready["admin_port"]}
