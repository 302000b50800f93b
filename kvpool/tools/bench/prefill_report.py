"""The prefill benchmark's report: figures of one run, the logits check, the readable summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvpool.tools.bench.prefill_replay import Replay, TurnResult
from kvpool.tools.bench.prefill_workload import BenchSettings, Workload
from kvpool.tools.bench.stats import percentile
from kvpool.sizes import format_size
from kvpool.workload import chunk_prefix_bound, trace_block_bound

# targets, stated in the report with pass/fail
REUSE_TARGET_OF_BOUND = 0.98
SPEEDUP_TARGET = 2.0
LOGITS_TOLERANCE = 1e-4


# ---- correctness ---------------------------------------------------------------------------------


def reference_logits(token_ids: Sequence[int], settings: BenchSettings) -> Any:
    """Final-position logits of the prompt computed from scratch in this process (float32 tensor)."""
    import torch

    from kvpool.model import InProcessPipeline as ReferenceModel
    from kvpool.model import get_config

    blocks = -(-len(token_ids) // settings.chunk_size)
    model = ReferenceModel(get_config(settings.model), num_blocks=blocks, block_size=settings.chunk_size)
    with torch.inference_mode():
        return model.forward(torch.tensor(list(token_ids)), list(range(blocks)), 0)[-1].to(torch.float32)


def check_logits(results: Sequence[TurnResult], settings: BenchSettings) -> tuple[float, bool, int]:
    """(max |served - reference| over the last turns, every greedy token matched, turns checked)."""
    import torch

    from kvpool.model import get_config
    from kvpool.model.sampling import greedy_token

    config = get_config(settings.model)
    worst, match, checked = 0.0, True, 0
    for r in results:
        if not r.prompt.is_last:
            continue
        reference = reference_logits(r.prompt.token_ids, settings)
        served = torch.frombuffer(bytearray(r.logits), dtype=torch.float32)
        if served.numel() != reference.numel():
            return math.inf, False, checked + 1
        worst = max(worst, float((served - reference).abs().max()))
        match = match and r.first_token == greedy_token(reference, config)
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
    """(per-stage read time of every stage restore that had chunks, restore wait of every restoring turn)."""
    per_stage = [s.read_ms for r in results for s in r.figures.restore if s.num_chunks_requested > 0]
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
        f"  restore per stage (read) p50 {s['restore_p50_ms']:.1f} ms, p90 {s['restore_p90_ms']:.1f} ms over "
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


def json_safe(summary: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities (e.g. no restore happened) become null: the line stays strict JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}
