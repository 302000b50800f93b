"""Admission first, on real processes: decode room is reserved before prefill, requests beyond it
queue (holding nothing) instead of failing, and whatever a request held is free at once when it ends.

One cluster for the module: a two-stage pipeline, one decode shard whose receive
arena holds two 1,000-token prompts' regions, and the router (``kvpool up``'s own
``Cluster``). Each test leaves the cluster idle.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvpool import service
from kvpool.request_record import effects_by_request, read_records, recording_children
from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.integration.conftest import eventually
from tests.integration.conftest import metric as service_metric

pytestmark = pytest.mark.cluster

PROMPT_TOKENS = 1000
# a region: 1,000 tokens x 8 layers x 384-byte entries + 4 KiB of logits = 3,076,096 bytes; 2 fit, 3 do not
ARENA = "6656KiB"
MAX_QUEUE = 6


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the cluster's services record what each request saw (``kvpool.request_record``)."""
    return tmp_path_factory.mktemp("admission-records") / "requests.jsonl"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, records: Path) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("admission")
    config = workdir / "cluster.toml"
    # health checks far apart: the tests stop a stage (SIGSTOP) to hold requests in prefill, and a
    # pipeline whose stage does not answer would leave rotation; a request whose pipeline failed waits
    # 1 s (not 10) for it to serve again: the stage a test stops does not come back by itself
    config.write_text(f"[router]\nhealth_interval_s = 120\nhealth_wait_s = 1\nmax_queue = {MAX_QUEUE}\n"
                      "queue_timeout_s = 300\n"
                      "[decode]\nnum_pages = 1024\npage_size = 16\n")
    # kvpool up passes each shard's arena as a flag (flags win over the file): the shape says it
    settings = UpSettings(pipelines=1, stages=2, decode_shards=1, stores=0, http_port=0, grpc_port=0,
                          device_cache_tokens=4096, region_arena_bytes=ARENA, workdir=str(workdir / "logs"))
    with recording_children(records):  # each request's router driver effects, among others
        up = up_cluster(settings, str(config)).start()
    try:
        yield up
    finally:
        up.stop()


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(length)]


def metric(cluster: Cluster, name: str, sample: str) -> float:
    """One sample from a service's Prometheus page (0 when absent)."""
    return service_metric(cluster.find(name), sample)


def router_address(cluster: Cluster) -> str:
    return f"127.0.0.1:{cluster.find('router').ready['port']}"


async def generate(channel: grpc.aio.Channel, token_ids: list[int], max_tokens: int) -> list[int]:
    request = router_pb2.GenerateRequest(token_ids=token_ids, sampling=router_pb2.SamplingParams(max_tokens=max_tokens))
    return [r.token_id async for r in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=300)
            if not r.HasField("usage")]


# what a request may hold: the router's tickets, queue slots and device blocks, decode's pages and regions,
# prefill's blocks
HELD = (("router", "kvpool_router_admitted"), ("router", "kvpool_router_queue_length"),
        ("decode0", "kvpool_decode_pages_used"), ("decode0", "kvpool_decode_region_bytes_used"),
        ("p0-stage0", "kvpool_prefill_device_cache_usage"))


def held(cluster: Cluster) -> dict[tuple[str, str], float]:
    return {(name, sample): metric(cluster, name, sample) for name, sample in HELD}


def idle(cluster: Cluster) -> bool:
    """Nothing held anywhere."""
    return not any(held(cluster).values())


async def test_a_burst_beyond_the_arena_queues_and_completes_without_errors(cluster: Cluster) -> None:
    errors = metric(cluster, "router", 'kvpool_router_requests_total{api="grpc",outcome="error"}')
    queued = metric(cluster, "router", "kvpool_router_queued_total")
    async with grpc.aio.insecure_channel(router_address(cluster), options=service.GRPC_OPTIONS) as channel:
        results = await asyncio.gather(*(generate(channel, prompt(i), 8) for i in range(8)))
    assert [len(tokens) for tokens in results] == [8] * 8
    # two fit the arena at once: the other six waited for room, none failed. The shard, which alone counts
    # its room, refused them at once and said when room came back: nothing waited at the shard, nothing polled
    assert metric(cluster, "router", "kvpool_router_queued_total") - queued == 6
    assert metric(cluster, "decode0", "kvpool_decode_room_refusals_total") >= 6
    assert metric(cluster, "decode0", "kvpool_decode_room_waits_total") == 0
    shard = f'{{shard="127.0.0.1:{cluster.find("decode0").ready["port"]}"}}'
    assert metric(cluster, "router", "kvpool_router_room_watch" + shard) == 1
    assert metric(cluster, "router", "kvpool_router_shard_full" + shard) == 0
    assert metric(cluster, "router", 'kvpool_router_requests_total{api="grpc",outcome="error"}') == errors
    assert metric(cluster, "router", "kvpool_router_queue_expired_total") == 0
    assert idle(cluster)


async def test_the_router_records_each_requests_driver_effects_queued_refused_and_served(
        cluster: Cluster, records: Path) -> None:
    path = records
    before = len(read_records(path))
    async with grpc.aio.insecure_channel(router_address(cluster), options=service.GRPC_OPTIONS) as channel:
        await asyncio.gather(*(generate(channel, prompt(100 + i), 4) for i in range(4)))

    def router_records() -> dict[str, list[tuple[str, str]]]:
        return {request_id: [(e["event"], e["effect"]) for e in effects]
                for request_id, effects in effects_by_request(read_records(path)[before:], "router").items()}

    await eventually(lambda: len(router_records()) == 4)
    requests = router_records()
    # two regions fit the arena: two served at once, two waited (queued on arrival, or refused by the shard,
    # which only counts its room), each then ticketed and served; every one released at its end
    for events in requests.values():
        assert events[-1] == ("end", "Apply") and events.count(("reserved", "Apply")) == 1
        waited = ("admit", "WaitForTicket") in events or ("refused", "WaitForTicket") in events
        assert events[0] in (("admit", "Serve"), ("admit", "WaitForTicket"))
        assert (("ticketed", "Serve") in events) == waited
    assert sum(("ticketed", "Serve") in events for events in requests.values()) == 2


async def test_a_client_gone_while_queued_or_in_prefill_frees_everything_at_once(cluster: Cluster) -> None:
    async with grpc.aio.insecure_channel(router_address(cluster), options=service.GRPC_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        stage1 = cluster.find("p0-stage1").proc
        assert stage1 is not None
        os.kill(stage1.pid, signal.SIGSTOP)  # prefill takes requests but never finishes them
        try:
            calls = [stub.Generate(router_pb2.GenerateRequest(
                token_ids=prompt(100 + i), sampling=router_pb2.SamplingParams(max_tokens=8)), timeout=300)
                for i in range(3)]
            reads = [asyncio.ensure_future(call.read()) for call in calls]

            def two_in_prefill_one_queued() -> bool:
                return (metric(cluster, "router", "kvpool_router_admitted") == 2
                        and metric(cluster, "router", "kvpool_router_queue_length") == 1
                        and metric(cluster, "decode0", "kvpool_decode_reserved_sequences") == 2)
            await eventually(two_in_prefill_one_queued, what="2 requests in prefill, 1 queued")
            # decode room is taken before any prefill work: pages and both regions
            assert metric(cluster, "decode0", "kvpool_decode_region_bytes_used") == 2 * 3_076_096
            calls[2].cancel()  # gone while queued: its place in the queue is freed, nothing else was held
            await eventually(lambda: metric(cluster, "router", "kvpool_router_queue_length") == 0,
                             timeout_s=2, what="the queue slot freed")
            for call in calls[:2]:
                call.cancel()  # gone during prefill: region and pages back at once, the ticket released
            await eventually(lambda: metric(cluster, "decode0", "kvpool_decode_pages_used") == 0
                             and metric(cluster, "decode0", "kvpool_decode_region_bytes_used") == 0
                             and metric(cluster, "router", "kvpool_router_admitted") == 0,
                             timeout_s=2, what="decode room freed")
        finally:
            os.kill(stage1.pid, signal.SIGCONT)
        for read in reads:
            with pytest.raises(asyncio.CancelledError):
                await read
    # the prefill side frees the blocks once its stages are done writing them
    await eventually(lambda: idle(cluster), what="an idle cluster")


def post(cluster: Cluster, body: dict[str, object]) -> tuple[int, dict[str, str], dict[str, object]]:
    host, port = cluster.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read())
    headers = {k.lower(): v for k, v in response.getheaders()}
    conn.close()
    return status, headers, payload


async def test_a_full_queue_is_429_with_retry_after_and_a_request_that_never_fits_is_400(cluster: Cluster) -> None:
    status, _, body = post(cluster, {"model": "tiny", "prompt": prompt(7, 3000), "max_tokens": 4})
    error = body["error"]
    # the served context (2,218 tokens: the arena's room) is checked before any work, naming the limit
    assert status == 400 and error["param"] == "prompt" and "at most 2217 prompt tokens" in error["message"]  # type: ignore[index]
    async with grpc.aio.insecure_channel(router_address(cluster), options=service.GRPC_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        stage1 = cluster.find("p0-stage1").proc
        assert stage1 is not None
        os.kill(stage1.pid, signal.SIGSTOP)  # holds the two admitted requests in prefill
        try:
            calls = [stub.Generate(router_pb2.GenerateRequest(
                token_ids=prompt(200 + i), sampling=router_pb2.SamplingParams(max_tokens=4)), timeout=300)
                for i in range(2 + MAX_QUEUE)]
            reads = [asyncio.ensure_future(call.read()) for call in calls]
            await eventually(lambda: metric(cluster, "router", "kvpool_router_queue_length") == MAX_QUEUE,
                             what="a full queue")
            status, headers, body = await asyncio.to_thread(
                post, cluster, {"model": "tiny", "prompt": prompt(300), "max_tokens": 4})
            assert status == 429 and int(headers["retry-after"]) >= 1
            assert "queue is full" in body["error"]["message"]  # type: ignore[index]
            for call in calls:
                call.cancel()
        finally:
            os.kill(stage1.pid, signal.SIGCONT)
        await asyncio.gather(*reads, return_exceptions=True)
    await eventually(lambda: idle(cluster), what="an idle cluster")


async def test_a_request_failing_after_admission_frees_everything_before_its_answer(cluster: Cluster) -> None:
    # every field is validated at the front door, before admission (one validator, no input fails later):
    # what fails after admission is a part. Stage 1 is gone: the request got its ticket, its decode
    # region and pages and stage 0's blocks, then its Prefill failed; with one pipeline and one shard it
    # cannot move, and its own pipeline is not seen serving again within --health-wait-s, so it is a 503
    # before any byte, and all it held is free when that answer arrives
    errors = metric(cluster, "router", 'kvpool_router_requests_total{api="completions",outcome="error"}')
    stage1 = cluster.find("p0-stage1")
    stage1.stop()
    try:
        status, _, body = await asyncio.to_thread(
            post, cluster, {"model": "tiny", "prompt": prompt(400), "max_tokens": 4})
        assert status == 503, body
        # scraped once, right after the answer: nothing waits for a deadline or a sweep. The region left
        # decode's table at once; its bytes stay allocated for the writers' grace (0.5 s: a stage write
        # that passed its check just before lands in bytes nobody else holds yet)
        region_bytes = ("decode0", "kvpool_decode_region_bytes_used")
        assert {k: v for k, v in held(cluster).items() if k != region_bytes} == dict.fromkeys(
            [k for k in HELD if k != region_bytes], 0.0)
        assert metric(cluster, "decode0", "kvpool_decode_regions") == 0
        assert metric(cluster, "decode0", "kvpool_decode_reserved_sequences") == 0
        await eventually(lambda: metric(cluster, *region_bytes) == 0, timeout_s=2, what="the region's bytes")
        assert metric(cluster, "router", 'kvpool_router_requests_total{api="completions",outcome="error"}') == errors + 1
    finally:
        stage1.restart()

    async def serves_again() -> bool:  # once stage 0's channel to the new stage 1 reconnects
        status, _, _ = await asyncio.to_thread(post, cluster, {"model": "tiny", "prompt": prompt(401), "max_tokens": 4})
        return status == 200
    await eventually(serves_again, timeout_s=60, what="the pipeline serving again")
    await eventually(lambda: idle(cluster), what="an idle cluster")


def test_the_router_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvpool.services.router.server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "False"
