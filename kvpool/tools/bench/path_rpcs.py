"""``kvpool bench path``'s control RPCs per request: a cold request and a pool-hit one on 4 stages, each counted
from the RPC trace (``kvpool.tracing``; the figures: ``kvpool.tools.bench.path_counts``).

One cluster as deployed (4 stages of the tiny model, one decode shard, a pool
of one store) whose device cache holds one prompt and a chunk. Through the
router, one after another: prompt A (``cold``: a pool miss), prompt B (which
pushes A off the device), then A again (``pool_hit``: its full chunks are
restored from the pool), ``REPEATS`` times with fresh prompts. After each, the
bench waits until the request's trace stops growing, so the saves and the calls
after the first token are counted. Each figure is the median over the repeats
(the depth may vary by a call with timing: whether one call follows another's
answer); ``critical_path`` and ``rpcs_by_method`` are those of the repeat at
the median depth.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from kvpool import service
from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.tracing import REQUEST_ID_KEY, tracing_children
from kvpool.tools.bench.path_counts import request_counts
from kvpool.tools.clients import grpc_auth_metadata
from kvpool.tools.up import UpSettings, up_cluster

STAGES = 4
PROMPT_TOKENS = 1024  # four chunks: a hit restores three and computes the last
MAX_TOKENS = 2
QUIET_S = 1.5  # a request's trace is complete once it has not grown for this long
QUIET_LIMIT_S = 60.0
REPEATS = 3
FIGURES = ("rpcs_per_request", "save_rpcs", "round_trips_per_request", "critical_path_depth",
           "depth_beyond_stage_hops")


async def generate(stub: router_pb2_grpc.RouterStub, token_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One request through the router: its id (the router names it), start, first token and outcome."""
    request = router_pb2.GenerateRequest(token_ids=token_ids, sampling=router_pb2.SamplingParams(max_tokens=max_tokens))
    started, first_at, tokens, error, finish, pool_tokens = time.time(), 0.0, 0, None, "", 0
    call = stub.Generate(request, timeout=600, metadata=grpc_auth_metadata())
    try:
        async for response in call:
            if response.HasField("usage"):
                finish = response.usage.finish_reason  # "stop": an end token came before max_tokens
                pool_tokens = response.usage.pool_tokens
                continue
            tokens += 1
            first_at = first_at or time.time()
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    request_id = next((v for k, v in await call.initial_metadata() or () if k == REQUEST_ID_KEY), "")
    return {"request_id": request_id, "started": started, "first_token_at": first_at, "tokens": tokens,
            "finish_reason": finish, "error": error, "pool_tokens": pool_tokens}


def read_trace(trace: Path) -> dict[str, list[dict[str, Any]]]:
    """The trace's calls by request id (its spans less an HTTP request's own: the calls are its children)."""
    calls: dict[str, list[dict[str, Any]]] = {}
    for line in trace.read_text().splitlines() if trace.exists() else []:
        call = json.loads(line)
        if call.get("kind") != "http":
            calls.setdefault(call["request_id"], []).append(call)
    return calls


async def _settled(trace: Path, request_id: str) -> None:
    """Wait until the request's trace has not grown for ``QUIET_S``."""
    seen, since, deadline = -1, time.monotonic(), time.monotonic() + QUIET_LIMIT_S
    while time.monotonic() < deadline:
        count = len(read_trace(trace).get(request_id, []))
        if count != seen:
            seen, since = count, time.monotonic()
        elif time.monotonic() - since >= QUIET_S:
            return
        await asyncio.sleep(0.25)


async def _requests(address: str, trace: Path, vocab: int) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(37)
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "evict": [], "pool_hit": []}
    async with service.channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for _ in range(REPEATS):
            prompt_a, prompt_b = ([rng.randrange(1, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(2))
            for name, prompt in (("cold", prompt_a), ("evict", prompt_b), ("pool_hit", prompt_a)):
                run = await generate(stub, prompt, MAX_TOKENS)
                runs[name].append(run)
                await _settled(trace, run["request_id"])
    return runs


def summary(runs: list[dict[str, Any]], calls: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One kind of request's figures: the medians over its runs, and the chain of the run at the median depth."""
    counted = [request_counts(calls.get(r["request_id"], []), r["first_token_at"], STAGES)
               for r in runs if r["first_token_at"]]
    out: dict[str, Any] = {"stages": STAGES, "prompt_tokens": PROMPT_TOKENS, "requests": len(runs),
                           "errors": sum(1 for r in runs if r["error"] is not None)}
    if not counted:
        return out
    middle = sorted(counted, key=lambda c: c["critical_path_depth"])[len(counted) // 2]
    return out | {name: statistics.median(c[name] for c in counted) for name in FIGURES} | {
        "critical_path_depths": [c["critical_path_depth"] for c in counted],
        "critical_path": middle["critical_path"], "rpcs_by_method": middle["rpcs_by_method"],
        "restored": all(r["pool_tokens"] > 0 for r in runs if r["first_token_at"]),  # the router's usage says
        "ttft_s_p50": round(statistics.median(r["first_token_at"] - r["started"] for r in runs if r["first_token_at"]),
                            4)}


def run_rpcs(workdir: Path) -> dict[str, dict[str, Any]]:
    """Start the cluster, send the cold, evicting and pool-hit requests, stop it; the pool-hit and cold figures."""
    from kvpool.model.config import CONFIGS

    workdir.mkdir(parents=True, exist_ok=True)
    trace = workdir / "rpc-trace.jsonl"
    with tracing_children(trace):  # the services inherit it
        cluster = up_cluster(UpSettings(pipelines=1, stages=STAGES, decode_shards=1, stores=1, segment_size="64MiB",
                                        http_port=0, grpc_port=0, device_cache_tokens=PROMPT_TOKENS + 256,
                                        workdir=str(workdir / "logs"))).start()
    try:
        runs = asyncio.run(_requests(f"127.0.0.1:{cluster.find('router').ready['port']}", trace,
                                     CONFIGS["tiny"].vocab_size))
    finally:
        cluster.stop()
    calls = read_trace(trace)
    return {name: summary(runs[name], calls) for name in ("pool_hit", "cold")}
