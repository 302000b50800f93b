"""One request, followed by its id through the log of every process it touches.

One small cluster of real processes for the module (``kvpool up``'s
topology at debug level, tiny model): a master, one store, one two-stage
prefill pipeline, one decode shard and the router. The request path is
router → stage 0 → stage 1 (forward, handoff) and stage 0/1 → master (lookup,
puts), router → decode. The store takes no call on that path (bytes move with
the transfer engine), so its log is the one that must not name the request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from kvpool.request_id import METADATA_KEY, is_sane
from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.tools.cluster.launcher import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

MODEL = "tiny"
PROMPT = "".join(chr(ord("a") + (i * 11) % 26) for i in range(700))  # two full 256-token chunks: lookup and save


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("reqid")
    settings = UpSettings(pipelines=1, stages=2, decode_shards=1, stores=1, segment_size="64MiB", http_port=0,
                          grpc_port=0, device_cache_tokens=4096, workdir=str(workdir))
    up = up_cluster(settings, log_level="debug").start()
    try:
        yield up
    finally:
        up.stop()


def events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a native library's line interleaved with ours
    return out


def about(cluster: Cluster, request_id: str) -> dict[str, list[dict[str, Any]]]:
    """Per process: its log lines that carry ``request_id``."""
    return {p.name: [e for e in events(p.log_file) if e.get("request_id") == request_id] for p in cluster.services}


async def test_one_request_is_named_in_the_log_of_every_process_it_touches(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "prompt_cache_key": "trace-me"}
    async with httpx.AsyncClient(timeout=300) as http:
        response = await http.post(f"{cluster.http_url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    assert response.json()["id"] == request_id and request_id.startswith("cmpl-") and is_sane(request_id)

    expected = {  # a line each process writes about the request, whatever else it writes
        "router": "generate_ended", "p0-stage0": "prefill_done", "p0-stage1": "handoff_stage_written",
        "decode0": "decode_done",
    }

    def master_saw_lookup_and_puts() -> bool:
        methods = {e.get("method", "").rsplit("/", 1)[-1] for e in about(cluster, request_id)["master"]}
        return {"Lookup", "PutStart", "PutEnd"} <= methods  # the puts end after the response: saves are async

    await eventually(master_saw_lookup_and_puts, timeout_s=60, what="the master's lines about the request")
    lines = about(cluster, request_id)
    for name, event in expected.items():
        assert event in {e["event"] for e in lines[name]}, (name, lines[name])
    assert {"handoff_done", "rpc_served"} <= {e["event"] for e in lines["p0-stage0"]}
    # stage 0's calls onward carried the id: stage 1 served them bound to it
    stage1_methods = {e["method"].rsplit("/", 1)[-1] for e in lines["p0-stage1"] if e["event"] == "rpc_served"}
    assert {"ForwardPieces", "SaveDone"} <= stage1_methods
    assert "HandoffDone" not in stage1_methods  # the handoff's figures came back with the forward's answer
    assert {n for n, found in lines.items() if found} == {"router", "p0-stage0", "p0-stage1", "decode0", "master"}
    assert lines["store0"] == []
    router = next(e for e in lines["router"] if e["event"] == "generate_ended")
    assert (router["ended"], router["session_key"], router["completion_tokens"]) == ("done", "trace-me", 4)
    assert router["queue_order"] == "fifo" and 0 <= router["queued_s"] <= router["ttft_s"]  # the default order


async def test_streamed_chunks_carry_the_id_and_a_client_id_is_kept_beside_it(cluster: Cluster) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "temperature": 0}
    ids = set()
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", f"{cluster.http_url}/v1/chat/completions", json=body,
                               headers={"X-Request-Id": "client-42"}) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    ids.add(json.loads(line[len("data: "):])["id"])
    assert request_id.startswith("chatcmpl-") and ids == {request_id}
    ended = [e for e in about(cluster, request_id)["router"] if e["event"] == "generate_ended"]
    assert [e["client_request_id"] for e in ended] == ["client-42"]


async def test_grpc_generate_gets_an_id_back_and_bad_input_keeps_its_header(cluster: Cluster) -> None:
    address = f"127.0.0.1:{cluster.find('router').ready['port']}"
    async with grpc.aio.insecure_channel(address) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(text="hello", sampling=router_pb2.SamplingParams(max_tokens=2)), timeout=300)
        responses = [r async for r in call]
        metadata = dict(await call.initial_metadata())
    assert responses[-1].HasField("usage")
    request_id = metadata[METADATA_KEY]
    assert request_id.startswith("req-")
    await eventually(lambda: any(e["event"] == "decode_done" for e in about(cluster, request_id)["decode0"]),
                     what="decode's line about the gRPC request")
    async with httpx.AsyncClient(timeout=30) as http:
        bad = await http.post(f"{cluster.http_url}/v1/completions", json={"model": MODEL, "max_tokens": 2})
    assert bad.status_code == 400 and bad.headers["x-request-id"].startswith("cmpl-")
