"""A pipeline is healthy only while every stage is, and a restarted later stage never yields wrong output.

Stage 0 answers the router's health check for the whole pipeline by asking
every later stage. A later stage that restarts has lost its device KV: the
first request that would compute over a device hit is refused by that stage
(it never wrote those blocks), stage 0 forgets its cached chunks, and the
request fails with UNAVAILABLE before any token; the next one restores from
the pool and gives the same greedy answer as before the crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvpool import service
from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.integration.test_router_faults import until_unhealthy

pytestmark = pytest.mark.cluster

PROMPT = " ".join(f"def step_{i}(x): return x * {i} + {i * i}" for i in range(24))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    config = tmp_path / "cluster.toml"
    config.write_text("[router]\nhealth_interval_s = 0.2\n")
    settings = UpSettings(pipelines=1, stages=2, decode_shards=1, stores=1, http_port=0, grpc_port=0,
                          device_cache_tokens=4096, workdir=str(tmp_path / "logs"))
    up = up_cluster(settings, str(config)).start()
    try:
        yield up
    finally:
        up.stop()


async def generate(cluster: Cluster) -> tuple[list[int], router_pb2.GenerateUsage]:
    address = f"127.0.0.1:{cluster.find('router').ready['port']}"
    async with grpc.aio.insecure_channel(address, options=service.GRPC_OPTIONS) as channel:
        tokens, usage = [], router_pb2.GenerateUsage()
        request = router_pb2.GenerateRequest(text=PROMPT, sampling=router_pb2.SamplingParams(max_tokens=8))
        async for response in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120):
            if response.HasField("usage"):
                usage = response.usage
            else:
                tokens.append(response.token_id)
        return tokens, usage


async def until_healthy(cluster: Cluster, target: str) -> None:
    from tests.integration.conftest import eventually

    async def healthy() -> bool:
        return (await cluster_health(cluster)).get(target) is True

    await eventually(healthy, what=f"{target} back in rotation")


async def cluster_health(cluster: Cluster) -> dict[str, bool]:
    import httpx

    async with httpx.AsyncClient() as client:
        response = await client.get(f"{cluster.http_url}/health", timeout=5)
        return dict(response.json()["targets"])


async def test_a_restarted_later_stage_leaves_rotation_then_serves_the_same_answer(cluster: Cluster) -> None:
    pipeline = f"127.0.0.1:{cluster.find('p0-stage0').ready['port']}"
    expected, usage = await generate(cluster)
    assert usage.prompt_tokens > 512  # at least two chunks: a device hit to lose
    again, usage = await generate(cluster)
    assert again == expected and usage.device_tokens > 0  # a device hit now

    stage1 = cluster.find("p0-stage1")
    stage1.kill()
    await until_unhealthy(cluster, pipeline)  # stage 0 is alive, its pipeline is not
    stage1.restart()
    await until_healthy(cluster, pipeline)

    # stage 0 still believes its chunks are cached; the restarted stage refuses them
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(cluster)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "device cache" in (refused.value.details() or "")
    assert "device_cache_dropped" in cluster.find("p0-stage0").log_file.read_text()

    after, usage = await generate(cluster)
    assert after == expected  # never a wrong answer: restored from the pool or computed
    assert usage.device_tokens == 0 and usage.pool_tokens > 0  # the pool kept the history
