"""The whole cluster through the OpenAI-compatible HTTP API, with the official openai client.

One cluster of real processes for the module: master, two stores, two
two-stage prefill pipelines, two decode shards and the router (``kvpool up``'s
own ``Cluster``). Tests use the SDK as coding agents do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from kvpool.pool.stats_client import fetch_stats
from kvpool.rpc import decode_pb2, decode_pb2_grpc
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.cluster

MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("up")
    config = workdir / "cluster.toml"
    # one request in flight is enough to move a session (the overload test)
    config.write_text("[router]\naffinity_max_queue = 1\n[decode]\nkv_bytes = \"64MiB\"\n")
    settings = UpSettings(pipelines=2, stages=2, decode_shards=2, stores=2, segment_size="64MiB", http_port=0,
                          grpc_port=0, device_cache_tokens=4096, workdir=str(workdir / "logs"))
    up = up_cluster(settings, str(config)).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=300)


def ext(usage: Any) -> dict[str, Any]:
    return usage.model_extra["kvpool"] if usage.model_extra else usage.kvpool


def test_second_send_of_a_prompt_is_served_from_cache(client: openai.OpenAI) -> None:
    prompt = "".join(chr(ord("a") + (i * 7) % 26) for i in range(3000))  # 3,000 bytes
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"prompt_cache_key": "cache-test"})
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"prompt_cache_key": "cache-test"})
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 3000
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 2816
    assert first.choices[0].text == second.choices[0].text  # greedy: same answer either way
    k = ext(second.usage)
    assert k["device_tokens"] + k["pool_tokens"] + k["computed_tokens"] == 3000


def test_a_first_token_before_the_prefills_answer_still_gets_its_figures_into_usage(
        client: openai.OpenAI, cluster: Cluster) -> None:
    """The router asks for the first token early: on a device hit it comes before the prefill's answer
    (decode counts it), and the answer's figures still reach the usage."""
    shards = [f"http://{cluster.topology.host}:{p.ready['admin_port']}" for p in cluster.services
              if "decode" in p.name]

    def early_starts() -> float:
        return sum(metric(get(url, "/metrics", raw=True)[1], "kvpool_decode_early_starts_total") for url in shards)

    prompt = "".join(chr(ord("a") + (i * 17) % 26) for i in range(1200))
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                              extra_body={"prompt_cache_key": "early"})
    before = early_starts()
    for i in range(4):
        again = client.completions.create(model=MODEL, prompt=prompt + str(i), max_tokens=2, temperature=0,
                                          extra_body={"prompt_cache_key": "early"})
        k = ext(again.usage)  # the cached prefix from the device (or the pool, had the session moved)
        assert k["device_tokens"] + k["pool_tokens"] == again.usage.prompt_tokens_details.cached_tokens == 1024
        assert k["computed_tokens"] == 1201 - 1024
    assert early_starts() > before


def test_streaming_and_not_agree_token_for_token(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primes."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]


def play_three_turns(client: openai.OpenAI, key: str) -> tuple[list[str], list[int]]:
    history = "Turn one: list the files in src/." * 20
    answers, cached = [], []
    for i in range(3):
        response = client.completions.create(model=MODEL, prompt=history, max_tokens=12, temperature=0,
                                             extra_body={"prompt_cache_key": key})
        answers.append(response.choices[0].text)
        cached.append(response.usage.prompt_tokens_details.cached_tokens)
        history += response.choices[0].text + f" Tool output {i}: ok." * 10
    return answers, cached


def test_three_turn_session_equals_the_same_run_without_the_pool(
    client: openai.OpenAI, tmp_path: Path
) -> None:
    answers, cached = play_three_turns(client, "three-turns")
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0  # later turns reuse earlier prompts
    settings = UpSettings(pipelines=1, stages=2, decode_shards=1, stores=0, http_port=0, grpc_port=0,
                          device_cache_tokens=4096, workdir=str(tmp_path))
    with_no_pool = up_cluster(settings).start()
    try:
        plain = openai.OpenAI(base_url=f"{with_no_pool.http_url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert play_three_turns(plain, "three-turns")[0] == answers
    finally:
        with_no_pool.stop()


def test_a_session_moved_to_another_pipeline_gets_its_history_from_the_pool(
    client: openai.OpenAI, cluster: Cluster
) -> None:
    history = "A long shared history. " * 60
    groups_before = complete_groups(cluster)
    first = client.completions.create(model=MODEL, prompt=history, max_tokens=2, temperature=0,
                                      extra_body={"prompt_cache_key": "mover"})
    home = ext(first.usage)["pipeline"]
    # saves are write-through, off the request's path: wait until the pool has the history's chunks
    wait_for_complete_groups(cluster, groups_before + len(history) // 256)
    # keep the session's pipeline busy (affinity_max_queue = 1), then send its next turn
    busy = client.completions.create(model=MODEL, prompt=history + " busy", max_tokens=400, temperature=0,
                                     stream=True, extra_body={"prompt_cache_key": "mover"})
    next(iter(busy))  # its first chunk: the request is in flight on the home pipeline
    try:
        moved = client.completions.create(model=MODEL, prompt=history + " next turn", max_tokens=2, temperature=0,
                                          extra_body={"prompt_cache_key": "mover"})
    finally:
        busy.close()
    k = ext(moved.usage)
    assert k["pipeline"] != home
    assert k["pool_tokens"] > 0 and k["device_tokens"] == 0  # a cold device: the history came from the pool


def test_a_seeded_request_is_reproducible_and_unseeded_ones_differ(client: openai.OpenAI) -> None:
    # under one chunk: nothing is cached, every answer is computed alike wherever it is placed
    prompt = "Sampling through the router: " * 3

    def sample(seed: int | None) -> str:
        extra = {} if seed is None else {"seed": seed}
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.5, **extra)
        assert answer.usage is not None and answer.usage.completion_tokens == 24
        return answer.choices[0].text

    assert sample(1234) == sample(1234)  # one stream of randomness per request, from its seed
    assert sample(None) != sample(None)  # unseeded: a fresh seed each, never the same default


def test_bad_requests_are_400s_naming_the_field(cluster: Cluster, client: openai.OpenAI) -> None:
    cases: list[tuple[str, Any, str | None]] = [
        ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 5000]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 40000}, "max_tokens"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, "model"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
        ("/v1/completions", b"{not json", None),
    ]
    for path, body, param in cases:
        status, answer = post(cluster.http_url, path, body)
        assert status == 400, (path, body, answer)
        assert answer["error"]["param"] == param, answer
        assert answer["error"]["message"]
    # and it keeps serving
    ok = client.completions.create(model=MODEL, prompt="still here", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_models_health_metrics(cluster: Cluster) -> None:
    status, models = get(cluster.http_url, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    status, health = get(cluster.http_url, "/health")
    assert status == 200 and health["status"] == "ok" and len(health["targets"]) == 4
    status, _ = get(cluster.http_url, "/metrics", raw=True)
    assert status == 404  # metrics are on the admin port only
    admin = f"http://{cluster.topology.host}:{cluster.find('router').ready['admin_port']}"
    status, text = get(admin, "/metrics", raw=True)
    assert status == 200 and "kvpool_router_placements_total" in text


def test_session_hints_reach_the_sessions_pipeline(cluster: Cluster, client: openai.OpenAI) -> None:
    prompt = "".join(chr(ord("a") + (i * 11) % 26) for i in range(1200))
    ask = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    router = f"http://{cluster.topology.host}:{cluster.find('router').ready['admin_port']}"
    stages = [f"http://{cluster.topology.host}:{p.ready['admin_port']}" for p in cluster.services
              if p.name.endswith("stage0")]

    def count(name: str, urls: list[str]) -> float:
        return sum(metric(get(url, "/metrics", raw=True)[1], name) for url in urls)

    client.completions.create(prompt=prompt, **ask, extra_body={"prompt_cache_key": "hints", "expected_next_s": 0})
    # the router sent the hint when the turn ended; the history was still on its pipeline's device: nothing staged
    wait_for(lambda: count('kvpool_router_prefetch_calls_total{kind="stage"}', [router]) == 1
             and count('kvpool_prefetch_hints_total{outcome="on_device"}', stages) == 1, what="the staging hint")
    second = client.completions.create(prompt=prompt + "more", **ask,
                                       extra_body={"prompt_cache_key": "hints", "session_end": True})
    assert second.usage.prompt_tokens_details.cached_tokens >= 1024
    wait_for(lambda: count('kvpool_router_prefetch_calls_total{kind="session_end"}', [router]) == 1
             and count('kvpool_prefetch_hints_total{outcome="session_end"}', stages) == 1, what="the session's end")
    for body, param in (({"expected_next_s": -1, "prompt_cache_key": "hints"}, "expected_next_s"),
                        ({"session_end": True}, "session_end")):
        status, answer = post(cluster.http_url, "/v1/completions", {"model": MODEL, "prompt": "hi", **body})
        assert status == 400 and answer["error"]["param"] == param, answer


def test_the_router_learns_the_pipelines_measured_speed(cluster: Cluster, client: openai.OpenAI) -> None:
    """Stage 0 measures its compute against the work estimates (kvpool.core.prefill.work_scale); the router asks every
    10 health rounds and scales its queue's estimates by it: the tiny model on a CPU is far slower than the
    reference GPUs, so the router's factor leaves 1."""
    router = f"http://{cluster.topology.host}:{cluster.find('router').ready['admin_port']}"
    for i in range(3):  # cold prompts of ~1,500 tokens: over the 10 ms of reference work each stage 0 waits for
        prompt = "".join(chr(ord("a") + (i * 7 + j * 13) % 26) for j in range(1500))
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_cache_key": f"speed-{i}"})
    wait_for(lambda: metric(get(router, "/metrics", raw=True)[1], "kvpool_router_work_scale") > 2.0,
             timeout_s=60, what="the router's work scale from the pipelines' StageInfo")


def metric(text: str, name: str) -> float:
    """A sample's value in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_eight_concurrent_sessions_over_two_pipelines_and_two_shards(client: openai.OpenAI) -> None:
    def session(i: int) -> set[tuple[str, str]]:
        seen = set()
        history = f"session {i}: " + "context " * 60
        for turn in range(2):
            response = client.completions.create(model=MODEL, prompt=history, max_tokens=6, temperature=0,
                                                 extra_body={"prompt_cache_key": f"conc-{i}"})
            k = ext(response.usage)
            seen.add((k["pipeline"], k["shard"]))
            history += response.choices[0].text + f" turn {turn} done."
        return seen

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(session, range(8)))  # raises on any error
    used = set().union(*results)
    # named as errors name them, never by address
    assert {p for p, _ in used} == {"prefill pipeline 0", "prefill pipeline 1"}
    assert {s for _, s in used} == {"decode shard 0", "decode shard 1"}


def complete_groups(cluster: Cluster) -> int:
    master = f"127.0.0.1:{cluster.find('master').ready['port']}"
    return int(asyncio.run(fetch_stats(master))["num_complete_groups"])


def wait_for_complete_groups(cluster: Cluster, count: int, timeout_s: float = 30.0) -> None:
    master = f"127.0.0.1:{cluster.find('master').ready['port']}"

    async def enough() -> bool:
        return int((await fetch_stats(master))["num_complete_groups"]) >= count

    wait_for(enough, timeout_s, what=f"{count} complete groups")


def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def get(url: str, path: str, raw: bool = False) -> tuple[int, Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        data = response.read().decode()
        return response.status, data if raw else json.loads(data)
    finally:
        conn.close()



async def decode_pages_used(cluster: Cluster) -> int:
    total = 0
    for proc in cluster.services:
        if proc.name.startswith("decode"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proc.ready['port']}") as channel:
                stats = await decode_pb2_grpc.DecodeStub(channel).Stats(decode_pb2.DecodeStatsRequest(), timeout=5)
                total += stats.num_pages_used
    return total


def test_a_client_that_disconnects_mid_stream_frees_its_pages(cluster: Cluster) -> None:
    host, port = cluster.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": MODEL, "prompt": "go on and on " * 20, "max_tokens": 3000, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(3):
        assert response.readline().startswith(b"data: ")
        response.readline()
    assert asyncio.run(decode_pages_used(cluster)) > 0  # the sequence is running
    conn.sock.close()  # the client goes away without a word
    conn.close()

    async def pages_freed() -> bool:
        return await decode_pages_used(cluster) == 0

    wait_for(pages_freed, timeout_s=20, what="decode pages freed after the client disconnected")


def test_kvpool_generate_prints_an_answer_and_its_figures(cluster: Cluster) -> None:
    router = f"127.0.0.1:{cluster.find('router').ready['port']}"
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "generate", "def fib(n):", "--router", router, "--max-tokens", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "[11 prompt tokens: device 0, pool 0, computed 11;" in result.stderr
    assert "5 generated" in result.stderr or "finish stop" in result.stderr


def test_kvpool_chat_resends_the_conversation_each_turn(cluster: Cluster) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "chat", "--url", cluster.http_url, "--max-tokens", "4"],
        input="first question\nsecond question\n\n", capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    cached = [int(line.split("cached ")[1].split(" of")[0]) for line in result.stderr.splitlines() if "cached" in line]
    prompts = [int(line.split(" of ")[1].split(" ")[0]) for line in result.stderr.splitlines() if "cached" in line]
    assert len(cached) == 2 and prompts[1] > prompts[0]  # the second turn carries the first
