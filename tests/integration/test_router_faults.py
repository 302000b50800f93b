"""The router over gRPC, and what it does when pipelines and shards die: never a silent loss, never a hang.

Retry rule under test: a prefill pipeline that fails before the request has
produced anything is retried once on another pipeline, a decode shard that
is down before the first token (before its Reserve, or after it while the
prefill runs) moves the request to another shard; a failure
after a token reached the client ends the stream with UNAVAILABLE (over HTTP:
OpenAI's error event, then ``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvpool import service
from kvpool.core.api.public_errors import PIPELINE, SHARD, backend_label
from kvpool.rpc import decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster


def start_cluster(workdir: Path, health_interval_s: float = 0.2, pipelines: int = 2, stages: int = 2) -> Cluster:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "cluster.toml"
    config.write_text(f"[router]\nhealth_interval_s = {health_interval_s}\n")
    settings = UpSettings(pipelines=pipelines, stages=stages, decode_shards=2, stores=0, http_port=0, grpc_port=0,
                          device_cache_tokens=4096, workdir=str(workdir / "logs"))
    return up_cluster(settings, str(config)).start()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Shared by the tests that leave every pipeline and shard running."""
    up = start_cluster(tmp_path_factory.mktemp("router-faults"))
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture
def doomed(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of its own for a test that kills pipelines or shards."""
    up = start_cluster(tmp_path)
    try:
        yield up
    finally:
        up.stop()


def address(cluster: Cluster, name: str) -> str:
    return f"127.0.0.1:{cluster.find(name).ready['port']}"


def label(cluster: Cluster, kind: str, name: str) -> str:
    """How a response's usage names process ``name``: ``kind`` and its index in the router's configuration."""
    args = cluster.find("router").args
    configured = args[args.index("--pipelines" if kind == PIPELINE else "--shards") + 1].split(",")
    assert address(cluster, name) in configured, (name, configured)
    return backend_label(kind, configured, address(cluster, name))


async def generate(cluster: Cluster, request: router_pb2.GenerateRequest) -> tuple[list[int], str, router_pb2.GenerateUsage]:
    async with grpc.aio.insecure_channel(address(cluster, "router"), options=service.GRPC_OPTIONS) as channel:
        tokens, text, usage = [], "", router_pb2.GenerateUsage()
        async for response in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120):
            if response.HasField("usage"):
                usage = response.usage
            else:
                tokens.append(response.token_id)
                text += response.text
        return tokens, text, usage


def sampling(max_tokens: int, **kw: float) -> router_pb2.SamplingParams:
    return router_pb2.SamplingParams(max_tokens=max_tokens, **kw)


async def until_unhealthy(cluster: Cluster, target: str, timeout_s: float = 15.0) -> None:
    """Poll the router's /health until it has taken ``target`` out of rotation."""
    url = cluster.http_url.removeprefix("http://")
    host, port = url.split(":")

    async def out_of_rotation() -> bool:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.0\r\n\r\n")
        body = (await reader.read()).split(b"\r\n\r\n", 1)[1]
        writer.close()
        return json.loads(body)["targets"].get(target) is False

    await eventually(out_of_rotation, timeout_s, what=f"{target} to leave rotation")


async def pages_used(cluster: Cluster, shard: str) -> int:
    async with grpc.aio.insecure_channel(address(cluster, shard)) as channel:
        stats = await decode_pb2_grpc.DecodeStub(channel).Stats(decode_pb2.DecodeStatsRequest(), timeout=5)
        return stats.num_pages_used


async def test_generate_over_grpc_with_text_or_token_ids(cluster: Cluster) -> None:
    tokens, text, usage = await generate(cluster, router_pb2.GenerateRequest(text="hello world", sampling=sampling(8)))
    assert len(tokens) == usage.completion_tokens
    assert usage.completion_tokens == 8 or usage.finish_reason == "stop"
    assert usage.prompt_tokens == 11 and usage.computed_tokens == 11
    same, _, _ = await generate(cluster, router_pb2.GenerateRequest(token_ids=list(b"hello world"), sampling=sampling(8)))
    assert same == tokens  # greedy, same prompt
    seeded = [await generate(cluster, router_pb2.GenerateRequest(
        text="hello world", sampling=sampling(8, temperature=1.0, seed=7))) for _ in range(2)]
    assert seeded[0][0] == seeded[1][0]  # a seed makes sampling reproducible


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (router_pb2.GenerateRequest(sampling=sampling(4)), "token_ids"),
        (router_pb2.GenerateRequest(token_ids=[1, 99999], sampling=sampling(4)), "token_ids[1]"),
        (router_pb2.GenerateRequest(text="x", token_ids=[1], sampling=sampling(4)), "token_ids"),
        (router_pb2.GenerateRequest(text="x", sampling=sampling(40000)), "sampling.max_tokens"),
        (router_pb2.GenerateRequest(text="x", sampling=sampling(4, temperature=-1)), "sampling.temperature"),
        (router_pb2.GenerateRequest(text="x", sampling=sampling(4, top_p=1.5)), "sampling.top_p"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    cluster: Cluster, request_: router_pb2.GenerateRequest, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(cluster, request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field)


async def test_cancelling_mid_stream_frees_the_decode_pages(cluster: Cluster) -> None:
    async with grpc.aio.insecure_channel(address(cluster, "router"), options=service.GRPC_OPTIONS) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(text="tell me a long story " * 10, sampling=sampling(2000)), timeout=120)
        received = 0
        async for _ in call:
            received += 1
            if received == 3:
                break
        used = max([await pages_used(cluster, f"decode{i}") for i in range(2)])
        assert used > 0  # the sequence holds pages while it runs
        call.cancel()

    async def pages_freed() -> bool:
        return not any([await pages_used(cluster, f"decode{i}") for i in range(2)])

    await eventually(pages_freed, timeout_s=15, what="pages freed after the client cancelled")


async def test_dead_targets_are_retried_or_fail_loudly_and_leave_rotation(doomed: Cluster) -> None:
    cluster = doomed
    # a dead pipeline: retried elsewhere before any token
    cluster.find("p0-stage1").kill()  # p0's stage 0 still answers health checks; its pipeline is broken
    results = [await generate(cluster, router_pb2.GenerateRequest(text=f"prompt {i}", session_key=f"s{i}",
                                                                   sampling=sampling(4))) for i in range(4)]
    pipelines = {usage.pipeline for _, _, usage in results}
    assert pipelines == {label(cluster, PIPELINE, "p1-stage0")}  # every request answered, by the healthy pipeline
    # a decode shard dying mid-stream: the request fails with UNAVAILABLE, never a clean-looking end
    async with grpc.aio.insecure_channel(address(cluster, "router"), options=service.GRPC_OPTIONS) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(text="a long answer please", sampling=sampling(3000)), timeout=120)
        shard = ""
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                if not shard:
                    # the shard with pages in use is the one streaming to us
                    for i in range(2):
                        if await pages_used(cluster, f"decode{i}"):
                            shard = f"decode{i}"
                            cluster.find(shard).kill()
                            break
        assert shard, "the request ended before a shard could be killed"
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # the client reads which shard failed by its index, never an internal address
        details = info.value.details()
        assert details.startswith("decode shard ") and address(cluster, shard).rsplit(":", 1)[0] not in details, \
            details
    # the dead shard leaves rotation: the next requests are served by the other one
    await until_unhealthy(cluster, address(cluster, shard))
    _, _, usage = await generate(cluster, router_pb2.GenerateRequest(text="next", sampling=sampling(4)))
    assert usage.shard != label(cluster, SHARD, shard)
    # the broken pipeline comes back with a smaller device cache: the router asks its StageInfo again,
    # and the context it serves (the smallest prompt limit + 1) follows
    assert served_context(cluster) == 4096 + 1
    for name in ("p0-stage1", "p0-stage0"):
        stage = cluster.find(name)
        stage.args[stage.args.index("--device-cache-tokens") + 1] = "2048"
        stage.restart()
    await eventually(lambda: served_context(cluster) == 2048 + 1, timeout_s=30,
                     what="the router to take p0's new device cache")
    _, _, usage = await generate(cluster, router_pb2.GenerateRequest(text="again", sampling=sampling(4)))
    assert usage.completion_tokens == 4 or usage.finish_reason == "stop"


def served_context(cluster: Cluster) -> int:
    """The context the router's /v1/models advertises (it follows every pipeline's device cache)."""
    with urllib.request.urlopen(f"{cluster.http_url}/v1/models", timeout=10) as response:
        return int(json.loads(response.read())["data"][0]["max_model_len"])


def stream_http(cluster: Cluster, body: dict[str, object], on_first: Callable[[], None]) -> list[bytes]:
    """POST a streaming completion; ``on_first`` runs once the first token's event arrived; every SSE line."""
    host, port = cluster.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    lines = []
    for raw in response:
        line = raw.strip()
        if not line:
            continue
        lines.append(line)
        if len(lines) == 1:
            on_first()
    conn.close()
    return lines


async def num_reserved(cluster: Cluster, shard: str) -> int:
    """Requests holding a region and pages on ``shard`` before their Generate."""
    async with grpc.aio.insecure_channel(address(cluster, shard)) as channel:
        stats = await decode_pb2_grpc.DecodeStub(channel).Stats(decode_pb2.DecodeStatsRequest(), timeout=5)
        return stats.num_reserved


def shard_moves(cluster: Cluster) -> str:
    admin = cluster.find("router").ready["admin_port"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10).read().decode()
    return next(line for line in metrics.splitlines() if line.startswith("kvpool_router_shard_moves_total "))


async def test_a_dead_shard_before_the_first_token_moves_the_request(tmp_path: Path) -> None:
    # health checks far apart: the router still believes the killed shard is up, so its
    # requests find it dead themselves
    cluster = start_cluster(tmp_path, health_interval_s=600, pipelines=1, stages=1)
    try:
        request = router_pb2.GenerateRequest(text="the same question", sampling=sampling(6))
        before, _, first = await generate(cluster, request)
        dead = next(name for name in ("decode0", "decode1") if label(cluster, SHARD, name) == first.shard)
        alive = "decode1" if dead == "decode0" else "decode0"
        # the shard dies after its Reserve, before the first token: the prefill is held (its
        # stage frozen) while the region is reserved, the shard is killed, then prefill's
        # handoff finds it dead and the request moves with a new Reserve and Prefill
        stage = cluster.find("p0-stage0")
        stage.pause()
        try:
            call = asyncio.ensure_future(generate(cluster, request))
            await eventually(lambda: num_reserved(cluster, dead), what=f"a region reserved on {dead}")
            assert await num_reserved(cluster, alive) == 0
            cluster.find(dead).kill()
        finally:
            stage.resume()
        after_reserve, _, moved = await call
        assert moved.shard == label(cluster, SHARD, alive)
        assert after_reserve == before  # greedy: the same answer from the other shard
        assert shard_moves(cluster) == "kvpool_router_shard_moves_total 1.0"
        # an idle router places the same way: on the dead shard first (its Reserve fails), then moved
        after, _, moved = await generate(cluster, request)
        assert moved.shard == label(cluster, SHARD, alive)
        assert after == before
        assert shard_moves(cluster) == "kvpool_router_shard_moves_total 2.0"
        # a request already streaming when its shard dies ends with the error event, then [DONE]
        body = {"model": "tiny", "prompt": "go on and on " * 10, "max_tokens": 3000, "temperature": 0,
                "stream": True}
        lines = await asyncio.to_thread(stream_http, cluster, body, cluster.find(alive).kill)
        assert lines[-1] == b"data: [DONE]"
        error = json.loads(lines[-2].removeprefix(b"data: "))
        assert (error["error"]["type"], error["error"]["code"]) == ("server_error", "unavailable"), error
    finally:
        cluster.stop()
