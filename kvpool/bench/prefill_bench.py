"""``kvpool bench prefill``: replay real coding-agent sessions through the prefill pipeline.

One run on one host. The first ``--sessions`` weka traces, their first
``--turns`` turns each, become token ids at ``--scale`` (deterministic, see
``kvpool.workload.tokens``). They are replayed as a closed loop of
``--concurrency`` concurrent sessions (each session's turns in order, the next
turn sent as soon as the previous answered; think time is ignored) twice, on
fresh clusters each time:

- pool on: a master, two stores and a four-stage pipeline saving to and
  restoring from the pool;
- pool off: the same pipeline with ``--no-pool`` (device cache only).

The device cache is smaller than the sessions' working set, so the device
alone cannot keep every history. Reported next to each other: prompt-token
reuse and the bounds an unlimited cache would reach, the share of prompt
tokens served by device / pool / compute, restore times, TTFT, prompt
throughput, and the logits of each session's last turn (pool on) against a
from-scratch computation in this process. Every number is measured in this run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

import kvpool
from kvpool import service
from kvpool.bench.stats import percentile
from kvpool.local_cluster import LocalPipeline, LocalPool, ServiceFailed
from kvpool.rpc import pool_pb2, pool_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from kvpool.sizes import format_size
from kvpool.workload import Session, chunk_prefix_bound, load_sessions, trace_block_bound, turn_token_ids
from kvpool.workload.bounds import chunk_hashes

CHUNK_SIZE = 256  # the system's chunk size (the stages' default)
NUM_STAGES = 4
NUM_STORES = 2
MODEL = "tiny"
PREFILL_TIMEOUT_S = 600.0
# targets, stated in the report with pass/fail
REUSE_TARGET_OF_BOUND = 0.98
SPEEDUP_TARGET = 2.0
LOGITS_TOLERANCE = 1e-4

# defaults: a few minutes on a 2-core host; --quick: well under three minutes for both passes
DEFAULTS = {"sessions": 4, "turns": 10, "scale": 16, "concurrency": 4, "device_cache_tokens": 8192}
QUICK = {"sessions": 4, "turns": 8, "scale": 32, "concurrency": 4, "device_cache_tokens": 4096}


class TracesMissing(FileNotFoundError):
    """The weka traces directory is not there."""


def default_traces_dir() -> Path:
    """``<repo>/../shared/traces/agentx-weka``: the shared traces next to the checkout."""
    return Path(kvpool.__file__).resolve().parents[1].parent / "shared" / "traces" / "agentx-weka"


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """What one run replays and on which cluster."""

    traces: Path
    sessions: int
    turns: int
    scale: int
    concurrency: int
    device_cache_tokens: int
    chunk_size: int = CHUNK_SIZE
    num_stages: int = NUM_STAGES
    model: str = MODEL

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "scale", "concurrency", "device_cache_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Flags over the defaults (``--quick`` picks the small defaults)."""
    base = QUICK if getattr(args, "quick", False) else DEFAULTS
    values = {name: default if getattr(args, name, None) is None else getattr(args, name)
              for name, default in base.items()}
    traces = Path(args.traces) if getattr(args, "traces", None) else default_traces_dir()
    return BenchSettings(traces=traces, **values)


# ---- workload ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prompt:
    """One turn to send: its session, its place in the session, its token ids."""

    session_id: str
    turn_index: int
    token_ids: tuple[int, ...]
    is_last: bool = False


@dataclass(slots=True)
class Workload:
    """The prompts of every session in turn order, and what was left out."""

    sessions: list[list[Prompt]]
    traces: list[Session]  # the sessions cut to the turns actually sent
    num_turns_skipped: int
    skipped_reasons: list[str]

    @property
    def prompts(self) -> list[Prompt]:
        return [p for session in self.sessions for p in session]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def working_set_tokens(self) -> int:
        """Sum over sessions of the longest prompt: the KV the sessions' histories need at once."""
        return sum(max((len(p.token_ids) for p in s), default=0) for s in self.sessions)


def _max_prompt_tokens(settings: BenchSettings) -> tuple[int, int]:
    """(device cache tokens in whole blocks, the model's context)."""
    from kvpool.model import get_config

    blocks = settings.device_cache_tokens // settings.chunk_size
    return blocks * settings.chunk_size, get_config(settings.model).max_position_embeddings


def build_workload(settings: BenchSettings) -> Workload:
    """Load the sessions, cut them to ``turns`` turns, make token ids, skip prompts that cannot fit."""
    if not settings.traces.is_dir():
        raise TracesMissing(f"traces directory {settings.traces} not found (pass --traces DIR: the weka "
                            "traces, e.g. ../shared/traces/agentx-weka)")
    from kvpool.model import get_config

    vocab = get_config(settings.model).vocab_size
    device_tokens, context = _max_prompt_tokens(settings)
    loaded = load_sessions(settings.traces, limit=settings.sessions)
    if not loaded:
        raise TracesMissing(f"no trace_*.json files in {settings.traces}")
    sessions: list[list[Prompt]] = []
    traces: list[Session] = []
    skipped: list[str] = []
    for session in loaded:
        prompts, kept = [], []
        for index, turn in enumerate(session.turns[: settings.turns]):
            ids = turn_token_ids(session.id, turn.hash_ids, turn.input_tokens, session.block_size,
                                 settings.scale, vocab)
            if len(ids) > min(device_tokens, context):
                skipped.append(f"{session.id} turn {index}: {len(ids)} tokens > device cache {device_tokens} "
                               f"/ context {context}")
                continue
            prompts.append(Prompt(session.id, index, tuple(ids)))
            kept.append(turn)
        if prompts:
            prompts[-1] = dataclasses.replace(prompts[-1], is_last=True)
            sessions.append(prompts)
            traces.append(dataclasses.replace(session, turns=tuple(kept)))
    return Workload(sessions, traces, len(skipped), skipped)


def pool_segment_size(workload: Workload, settings: BenchSettings) -> int:
    """Per-store segment that holds every distinct chunk of the replay below the eviction watermark."""
    from kvpool.model import get_config

    config = get_config(settings.model)
    chunk_bytes = settings.chunk_size * config.num_hidden_layers * config.kv_entry_dim * 4  # float32 KV
    distinct = {h for p in workload.prompts for h in chunk_hashes(p.token_ids, settings.chunk_size)}
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
    """Prefill one turn, then release its KV at once (no decode yet)."""
    request = prefill_pb2.PrefillRequest(token_ids=prompt.token_ids, session_id=prompt.session_id,
                                         return_logits=prompt.is_last)
    t0 = time.perf_counter()
    response = await stub.Prefill(request, timeout=PREFILL_TIMEOUT_S)
    latency_ms = (time.perf_counter() - t0) * 1e3
    await stub.Release(prefill_pb2.ReleaseRequest(kv_handle=response.kv_handle), timeout=30)
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

    async with grpc.aio.insecure_channel(address, options=service.GRPC_OPTIONS) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(stub) for _ in range(min(concurrency, len(workload.sessions)))))
        wall_s = time.perf_counter() - t0
    results.sort(key=lambda r: r.issue_index)
    return Replay(mode, wall_s, results)


async def _pool_stats(master: str) -> dict[str, int]:
    async with grpc.aio.insecure_channel(master, options=service.GRPC_OPTIONS) as channel:
        stats = await pool_pb2_grpc.PoolMasterStub(channel).Stats(pool_pb2.StatsRequest(), timeout=10)
    return {
        "capacity_bytes": stats.capacity_bytes, "used_bytes": stats.used_bytes,
        "num_complete_groups": stats.num_complete_groups, "num_puts_in_flight": stats.num_puts_in_flight,
        "evicted_groups": stats.evicted_groups, "revoked_puts": stats.revoked_puts,
    }


def _stage_args(settings: BenchSettings) -> list[str]:
    return ["--device-cache-tokens", str(settings.device_cache_tokens), "--chunk-size", str(settings.chunk_size),
            "--model", settings.model, "--log-level", "warning"]


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


# ---- correctness ---------------------------------------------------------------------------------


def reference_logits(token_ids: Sequence[int], settings: BenchSettings) -> Any:
    """Final-position logits of the prompt computed from scratch in this process (float32 tensor)."""
    import torch

    from kvpool.model import LocalPipeline as ReferenceModel
    from kvpool.model import get_config

    blocks = -(-len(token_ids) // settings.chunk_size)
    model = ReferenceModel(get_config(settings.model), num_blocks=blocks, block_size=settings.chunk_size)
    with torch.inference_mode():
        return model.forward(torch.tensor(list(token_ids)), list(range(blocks)), 0)[-1].to(torch.float32)


def check_logits(results: Sequence[TurnResult], settings: BenchSettings) -> tuple[float, bool, int]:
    """(max |served - reference| over the last turns, every greedy token matched, turns checked)."""
    import torch

    worst, match, checked = 0.0, True, 0
    for r in results:
        if not r.prompt.is_last:
            continue
        reference = reference_logits(r.prompt.token_ids, settings)
        served = torch.frombuffer(bytearray(r.logits), dtype=torch.float32)
        if served.numel() != reference.numel():
            return math.inf, False, checked + 1
        worst = max(worst, float((served - reference).abs().max()))
        match = match and r.first_token == int(torch.argmax(reference))
        checked += 1
    return worst, match, checked


# ---- figures -------------------------------------------------------------------------------------


def shares(results: Sequence[TurnResult]) -> dict[str, float]:
    """Share of prompt tokens served by device, pool and compute."""
    total = sum(r.figures.num_prompt_tokens for r in results)
    device = sum(r.figures.num_device_tokens for r in results)
    pool = sum(r.figures.num_pool_tokens for r in results)
    computed = sum(r.figures.num_computed_tokens for r in results)
    if not total:
        return {"device_share": math.nan, "pool_share": math.nan, "computed_share": math.nan}
    return {"device_share": device / total, "pool_share": pool / total, "computed_share": computed / total}


def restore_times(results: Sequence[TurnResult]) -> tuple[list[float], list[float]]:
    """(per-stage read+unpack of every stage restore that had chunks, restore wait of every restoring turn)."""
    per_stage = [s.read_ms + s.unpack_ms for r in results for s in r.figures.restore if s.num_chunks_requested > 0]
    waits = [r.figures.restore_wait_ms for r in results if any(s.num_chunks_requested for s in r.figures.restore)]
    return per_stage, waits


def shortfall(results: Sequence[TurnResult], bound_hits: Sequence[int]) -> dict[str, int]:
    """Turns (in issue order) whose device+pool hit fell short of the unlimited-cache hit, and by how much."""
    short = [b - (r.figures.num_device_tokens + r.figures.num_pool_tokens) for r, b in zip(results, bound_hits)]
    return {"turns_below_bound": sum(1 for s in short if s > 0), "tokens_below_bound": sum(s for s in short if s > 0)}


def summarize(workload: Workload, settings: BenchSettings, on: Replay, off: Replay) -> dict[str, Any]:
    """The report: measured values of this run only."""
    prompt_tokens = workload.prompt_tokens
    # same prompts, in the order the pool-on run sent them, one cache for all sessions
    bound = chunk_prefix_bound([r.prompt.token_ids for r in on.results], settings.chunk_size)
    on_shares, off_shares = shares(on.results), shares(off.results)
    per_stage, waits = restore_times(on.results)
    diff, greedy, checked = check_logits(on.results, settings)
    tput_on = prompt_tokens / on.wall_s if on.wall_s > 0 else math.nan
    tput_off = prompt_tokens / off.wall_s if off.wall_s > 0 else math.nan
    summary: dict[str, Any] = {
        "reuse_ratio": 1.0 - on_shares["computed_share"],
        "trace_bound": bound.ratio,
        "trace_block_bound": trace_block_bound(workload.traces),
        **on_shares,
        **{f"{k}_pool_off": v for k, v in off_shares.items()},
        "reuse_ratio_pool_off": 1.0 - off_shares["computed_share"],
        "restore_p50_ms": percentile(per_stage, 50),
        "restore_p90_ms": percentile(per_stage, 90),
        "restore_wait_p50_ms": percentile(waits, 50),
        "restore_wait_p90_ms": percentile(waits, 90),
        "num_stage_restores": len(per_stage),
        "restore_bytes": sum(s.bytes for r in on.results for s in r.figures.restore),
        "throughput_tok_s_pool_on": tput_on,
        "throughput_tok_s_pool_off": tput_off,
        "speedup": tput_on / tput_off,
        "wall_s_pool_on": on.wall_s,
        "wall_s_pool_off": off.wall_s,
    }
    for name, replay_ in (("pool_on", on), ("pool_off", off)):
        latencies = [r.latency_ms for r in replay_.results]
        for q in (50, 90, 99):
            summary[f"ttft_p{q}_ms_{name}"] = percentile(latencies, q)
    summary.update({
        "logits_max_abs_diff": diff,
        "greedy_match": greedy,
        "logits_checked_turns": checked,
        "num_pool_chunks_lost": sum(r.figures.num_pool_chunks_lost for r in on.results),
        **shortfall(on.results, bound.hit_tokens),
        **{f"pool_{k}": v for k, v in on.pool_stats.items()},
        "prompt_tokens": prompt_tokens,
        "num_turns": len(workload.prompts),
        "num_turns_skipped": workload.num_turns_skipped,
        "working_set_tokens": workload.working_set_tokens,
        "scale": settings.scale,
        "sessions": len(workload.sessions),
        "session_ids": [s[0].session_id for s in workload.sessions],
        "turns": settings.turns,
        "device_cache_tokens": settings.device_cache_tokens,
        "concurrency": settings.concurrency,
        "chunk_size": settings.chunk_size,
        "num_stages": settings.num_stages,
        "model": settings.model,
        "think_time": "ignored",
    })
    summary["reuse_target"] = REUSE_TARGET_OF_BOUND * summary["trace_bound"]
    summary["reuse_target_met"] = summary["reuse_ratio"] >= summary["reuse_target"]
    summary["speedup_target"] = SPEEDUP_TARGET
    summary["speedup_target_met"] = summary["speedup"] >= SPEEDUP_TARGET
    summary["logits_target_met"] = diff <= LOGITS_TOLERANCE and greedy
    return summary


def _verdict(met: bool) -> str:
    return "PASS" if met else "FAIL"


def format_report(s: dict[str, Any], workload: Workload) -> str:
    """The readable summary."""
    lines = [
        f"kvpool bench prefill — {s['sessions']} weka sessions ({', '.join(s['session_ids'])}) × first "
        f"{s['turns']} turns at scale 1/{s['scale']}: {s['num_turns']} turns, {s['prompt_tokens']:,} prompt tokens "
        f"({s['num_turns_skipped']} turns skipped as too long)",
        f"  closed loop of {s['concurrency']} concurrent sessions, turns in order; think time ignored (next turn sent "
        f"on the previous answer, so sessions interleave as response times fall); {s['num_stages']} stages, "
        f"model {s['model']}, chunk {s['chunk_size']}",
        f"  device cache {s['device_cache_tokens']:,} tokens vs working set {s['working_set_tokens']:,} tokens "
        f"(sum of each session's longest prompt); pool {format_size(s.get('pool_capacity_bytes', 0))}",
        f"{'':18}{'device':>9}{'pool':>9}{'computed':>10}{'reuse':>8}{'tok/s':>10}{'TTFT p50':>11}{'p90':>9}"
        f"{'p99':>9}",
    ]
    for name, suffix in (("pool on", ""), ("pool off", "_pool_off")):
        mode = "pool_on" if not suffix else "pool_off"
        lines.append(
            f"  {name:16}{s['device_share' + suffix]:>9.1%}{s['pool_share' + suffix]:>9.1%}"
            f"{s['computed_share' + suffix]:>10.1%}{1 - s['computed_share' + suffix]:>8.1%}"
            f"{s['throughput_tok_s_' + mode]:>10,.0f}{s['ttft_p50_ms_' + mode]:>9.0f}ms"
            f"{s['ttft_p90_ms_' + mode]:>7.0f}ms{s['ttft_p99_ms_' + mode]:>7.0f}ms"
        )
    lines += [
        f"  bounds: unlimited prefix cache at chunk {s['chunk_size']} {s['trace_bound']:.1%}; "
        f"trace's own (64-token blocks, any earlier block) {s['trace_block_bound']:.1%}; "
        f"pool on fell short of the unlimited cache on {s['turns_below_bound']} turns "
        f"({s['tokens_below_bound']:,} tokens)",
        f"  restore per stage (read+unpack) p50 {s['restore_p50_ms']:.1f} ms, p90 {s['restore_p90_ms']:.1f} ms over "
        f"{s['num_stage_restores']} stage restores ({format_size(s['restore_bytes'])}); wait for all stages p50 "
        f"{s['restore_wait_p50_ms']:.1f} ms; pool chunks lost {s['num_pool_chunks_lost']}; pool evictions "
        f"{s.get('pool_evicted_groups', 0)}",
        f"  logits of {s['logits_checked_turns']} last turns (pool on) vs from scratch: max |diff| "
        f"{s['logits_max_abs_diff']:.2e}, greedy token {'matched' if s['greedy_match'] else 'DIFFERED'}",
        "targets:",
        f"  reuse {s['reuse_ratio']:.2%} >= {REUSE_TARGET_OF_BOUND:.0%} of bound {s['trace_bound']:.2%} "
        f"(= {s['reuse_target']:.2%}): {_verdict(s['reuse_target_met'])}",
        f"  pool on / pool off prompt throughput {s['speedup']:.2f}× >= {SPEEDUP_TARGET:.0f}×: "
        f"{_verdict(s['speedup_target_met'])}",
        f"  logits within {LOGITS_TOLERANCE:g} and same greedy token: {_verdict(s['logits_target_met'])}",
    ]
    lines += [f"  skipped: {reason}" for reason in workload.skipped_reasons]
    return "\n".join(lines)


# ---- entry points --------------------------------------------------------------------------------


def run(settings: BenchSettings, workdir: Path | None = None) -> tuple[dict[str, Any], Workload]:
    """Both passes on fresh clusters; returns the summary and the workload."""
    workload = build_workload(settings)
    if not workload.prompts:
        raise ValueError("no turn fits the device cache and the model's context; raise --device-cache-tokens "
                         "or --scale")
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-prefill-") as tmp:
        base = workdir or Path(tmp)
        on = run_pool_on(workload, settings, base)
        off = run_pool_off(workload, settings, base)
    return summarize(workload, settings, on, off), workload


def main(args: argparse.Namespace) -> int:
    """``kvpool bench prefill``: print the summary; with ``--json`` the last line is one JSON object."""
    started = time.monotonic()
    try:
        settings = settings_from_args(args)
        summary, workload = run(settings)
    except (TracesMissing, ValueError, ServiceFailed) as exc:
        raise SystemExit(f"kvpool bench prefill: {exc}") from None
    summary["wall_s"] = time.monotonic() - started
    print(format_report(summary, workload))
    if args.json:
        print(json.dumps(json_safe(summary)))
    return 0


def json_safe(summary: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities (e.g. no restore happened) become null: the line stays strict JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}
