"""The prefill benchmark's replay: a closed loop of sessions against a fresh cluster, pool on or off."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvpool import service
from kvpool.tools.bench.prefill_workload import BenchSettings, Prompt, Workload
from kvpool.core.chunk_hash import chunk_hashes
from kvpool.tools.cluster import LocalPipeline, LocalPool
from kvpool.rpc import pool_pb2, pool_pb2_grpc, prefill_pb2, prefill_pb2_grpc

NUM_STORES = 2
PREFILL_TIMEOUT_S = 600.0


def pool_segment_size(workload: Workload, settings: BenchSettings) -> int:
    """Per-store segment that holds every distinct chunk of the replay below the eviction watermark."""
    from kvpool.model import get_config, kv_chunk_nbytes, kv_dtype

    config = get_config(settings.model)
    chunk_bytes = kv_chunk_nbytes(config, config.num_hidden_layers, settings.chunk_size, kv_dtype(settings.kv_dtype))
    distinct = {h for p in workload.prompts for h in chunk_hashes("", p.token_ids, settings.chunk_size)}
    needed = len(distinct) * chunk_bytes * 2  # headroom: watermarks, per-segment placement
    return max(32 << 20, -(-needed // NUM_STORES // (1 << 20)) << 20)


# ---- replay --------------------------------------------------------------------------------------


@dataclass(slots=True)
class TurnResult:
    """One Prefill call as the client saw it."""

    prompt: Prompt
    issue_index: int
    latency_ms: float
    figures: prefill_pb2.PrefillFigures
    first_token: int
    logits: bytes


@dataclass(slots=True)
class Replay:
    """One pass over the workload."""

    mode: str
    wall_s: float
    results: list[TurnResult] = field(default_factory=list)
    pool_stats: dict[str, int] = field(default_factory=dict)


async def _send(stub: prefill_pb2_grpc.PrefillStub, prompt: Prompt, issue_index: int) -> TurnResult:
    """Prefill one turn (no decode: its blocks are free when Prefill returns)."""
    request = prefill_pb2.PrefillRequest(token_ids=prompt.token_ids, session_key=prompt.session_id,
                                         return_logits=prompt.is_last)
    t0 = time.perf_counter()
    response = await stub.Prefill(request, timeout=PREFILL_TIMEOUT_S)
    latency_ms = (time.perf_counter() - t0) * 1e3
    return TurnResult(prompt, issue_index, latency_ms, response.figures, response.first_token, response.logits)


async def replay(address: str, workload: Workload, concurrency: int, mode: str) -> Replay:
    """Closed loop: ``concurrency`` workers, each takes the next session and sends its turns in order."""
    pending = deque(workload.sessions)
    results: list[TurnResult] = []
    issued = 0

    async def worker(stub: prefill_pb2_grpc.PrefillStub) -> None:
        nonlocal issued
        while pending:
            for prompt in pending.popleft():
                issued += 1
                results.append(await _send(stub, prompt, issued - 1))

    async with service.channel(address) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(stub) for _ in range(min(concurrency, len(workload.sessions)))))
        wall_s = time.perf_counter() - t0
    results.sort(key=lambda r: r.issue_index)
    return Replay(mode, wall_s, results)


async def _pool_stats(master: str) -> dict[str, int]:
    async with service.channel(master) as channel:
        stats = await pool_pb2_grpc.PoolMasterStub(channel).Stats(pool_pb2.StatsRequest(), timeout=10)
    return {
        "capacity_bytes": stats.capacity_bytes, "used_bytes": stats.used_bytes,
        "num_complete_groups": stats.num_complete_groups, "num_puts_in_flight": stats.num_puts_in_flight,
        "evicted_groups": stats.evicted_groups, "revoked_puts": stats.revoked_puts,
    }


def _stage_args(settings: BenchSettings) -> list[str]:
    return ["--device-cache-tokens", str(settings.device_cache_tokens), "--chunk-size", str(settings.chunk_size),
            "--model", settings.model, "--kv-dtype", settings.kv_dtype, "--log-level", "warning"]


def run_pool_on(workload: Workload, settings: BenchSettings, workdir: Path) -> Replay:
    """A fresh master, two stores and pipeline; replay; pool figures after the replay."""
    segment = pool_segment_size(workload, settings)
    with LocalPool(num_stores=NUM_STORES, segment_size=str(segment), workdir=workdir / "pool",
                   master_args=["--log-level", "warning"], store_args=["--log-level", "warning"]) as pool:
        with LocalPipeline(num_stages=settings.num_stages, master=pool.master_address,
                           stage_args=_stage_args(settings), workdir=workdir / "stages-on") as pipeline:
            result = asyncio.run(replay(pipeline.address, workload, settings.concurrency, "pool_on"))
            result.pool_stats = asyncio.run(_pool_stats(pool.master_address))
    return result


def run_pool_off(workload: Workload, settings: BenchSettings, workdir: Path) -> Replay:
    """A fresh pipeline with ``--no-pool``; replay."""
    with LocalPipeline(num_stages=settings.num_stages, master="", stage_args=_stage_args(settings),
                       workdir=workdir / "stages-off") as pipeline:
        return asyncio.run(replay(pipeline.address, workload, settings.concurrency, "pool_off"))
