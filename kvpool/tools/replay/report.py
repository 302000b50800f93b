"""The replay's report: one flat summary per concurrency level, the printed table, the JSON line.

Every figure is measured in the run it describes. Shares are of the prompt
tokens of the requests that answered (``device + pool + computed = 1``);
``reuse_ratio = device_share + pool_share``. ``trace_bound`` is an unlimited
prefix cache at the system's chunk size over the prompts in the order they
were actually sent (one cache for all sessions, as the pool is), and
``trace_block_bound`` the trace's own block-level bound over the turns sent
(``trace_block_bound_all_turns``: over every kept turn, for a run cut short).
Figures a service does not expose are null in the JSON and named in
``missing``. Wait means are exact; wait percentiles (``*_p50_s``, ``*_p99_s``)
are estimated from the services' histogram buckets, as Prometheus's
``histogram_quantile`` does, so they are only as fine as the buckets.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from kvpool.tools.bench.stats import percentile
from kvpool.tools.replay.probes import Metrics, buckets, delta, histogram_quantile, total
from kvpool.tools.replay.records import ReplayOptions, ReplayResult
from kvpool.tools.replay.workload import ReplayWorkload, sent_block_bound
from kvpool.workload.bounds import chunk_prefix_bound


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _add_buckets(into: dict[float, float], moved: Metrics, name: str) -> None:
    for bound, count in buckets(moved, name).items():
        into[bound] = into.get(bound, 0.0) + count


def _quantiles(out: dict[str, Any], prefix: str, cumulative: dict[float, float]) -> None:
    """``{prefix}_p50_s`` and ``_p99_s``: estimated from the histogram's buckets (see ``histogram_quantile``)."""
    for q in (50, 99):
        out[f"{prefix}_p{q}_s"] = histogram_quantile(q / 100, cumulative)


def _stage_figures(before: dict[str, Metrics], after: dict[str, Metrics]) -> dict[str, Any]:
    """Restored/saved bytes per prefill stage and the restore wait on each pipeline's stage 0, from /metrics."""
    out: dict[str, Any] = {"restore_bytes_per_stage": {}, "saved_bytes_per_stage": {},
                           "restore_seconds_mean_per_stage": {}}
    wait_sum = wait_count = queue_sum = queue_count = gate_sum = gate_count = 0.0
    wait_buckets: dict[float, float] = {}
    queue_buckets: dict[float, float] = {}
    gate_buckets: dict[float, float] = {}
    compute_buckets: dict[float, float] = {}
    prefetch = dict.fromkeys(("prefetched", "used", "wasted"), 0.0)
    # the stages' pool bytes by path: memory (a store on the stage's host) or the transfer engine
    by_path = {f"{path}_{direction}": 0.0 for path in ("memory", "engine") for direction in ("read", "write")}
    gate_pops = dict.fromkeys(("aging", "budget", "backlog"), 0.0)
    hints: dict[str, int] = {}
    for name in sorted(n for n in after if "stage" in n):
        moved = delta(after[name], before.get(name, {}))
        for kind in prefetch:  # stage 0's session prefetch (bytes on every stage)
            prefetch[kind] += total(moved, "kvpool_prefetch_bytes_total", kind=kind)
        for key, value in moved.items():  # what each session hint came to (staged, on_device, pressure, ...)
            if key.startswith("kvpool_prefetch_hints_total{") and value:
                outcome = key.partition('outcome="')[2].partition('"')[0]
                hints[outcome] = hints.get(outcome, 0) + int(value)
        for key in by_path:
            path, _, direction = key.partition("_")
            by_path[key] += total(moved, "kvpool_prefill_pool_bytes_total", path=path, direction=direction)
        out["restore_bytes_per_stage"][name] = int(total(moved, "kvpool_prefill_restored_bytes_total"))
        out["saved_bytes_per_stage"][name] = int(total(moved, "kvpool_prefill_saved_bytes_total"))
        # each stage's read (and verify) straight into its pages, per restore
        out["restore_seconds_mean_per_stage"][name] = _ratio(
            total(moved, "kvpool_prefill_restore_seconds_sum"), total(moved, "kvpool_prefill_restore_seconds_count"))
        _add_buckets(wait_buckets, moved, "kvpool_prefill_restore_wait_seconds")
        _add_buckets(queue_buckets, moved, "kvpool_prefill_admission_wait_seconds")
        wait_sum += total(moved, "kvpool_prefill_restore_wait_seconds_sum")
        wait_count += total(moved, "kvpool_prefill_restore_wait_seconds_count")
        queue_sum += total(moved, "kvpool_prefill_admission_wait_seconds_sum")
        queue_count += total(moved, "kvpool_prefill_admission_wait_seconds_count")
        _add_buckets(gate_buckets, moved, "kvpool_prefill_gate_wait_seconds")
        _add_buckets(compute_buckets, moved, "kvpool_prefill_compute_seconds")  # stage 0's: the pipeline's
        gate_sum += total(moved, "kvpool_prefill_gate_wait_seconds_sum")
        gate_count += total(moved, "kvpool_prefill_gate_wait_seconds_count")
        for how in gate_pops:  # stage 0's gate: pops that aging, the bypass budget or the backlog gate decided
            gate_pops[how] += total(moved, "kvpool_prefill_gate_pops_total", decided_by=how)
    out["restore_bytes"] = sum(out["restore_bytes_per_stage"].values())
    out["pool_bytes_by_path"] = {key: int(value) for key, value in by_path.items()}
    out["restore_wait_mean_s"] = _ratio(wait_sum, wait_count)
    out["restores"] = int(wait_count)
    out["prefill_queue_wait_mean_s"] = _ratio(queue_sum, queue_count)
    out["prefill_gate_wait_mean_s"] = _ratio(gate_sum, gate_count)  # nan without a gate
    out["prefill_gate_pops_aging"] = int(gate_pops["aging"])
    out["prefill_gate_pops_budget"] = int(gate_pops["budget"])
    out["prefill_gate_pops_backlog"] = int(gate_pops["backlog"])
    _quantiles(out, "restore_wait", wait_buckets)
    _quantiles(out, "prefill_queue_wait", queue_buckets)
    _quantiles(out, "prefill_gate_wait", gate_buckets)
    # the prefill's service time: stage 0's wall time from the pipeline's start to its last stage's end
    _quantiles(out, "prefill_compute", compute_buckets)
    # the restore on the critical path, per restore (each pipeline's stage 0: first stage start to last finish)
    out["restore_wait_total_s"] = wait_sum
    out["prefetched_bytes"] = int(prefetch["prefetched"])
    out["prefetch_used_bytes"] = int(prefetch["used"])
    out["prefetch_wasted_bytes"] = int(prefetch["wasted"])
    out["prefetch_hints"] = hints
    return out


def _decode_figures(before: dict[str, Metrics], after: dict[str, Metrics]) -> dict[str, Any]:
    queue_sum = queue_count = 0.0
    for name in (n for n in after if n.startswith("decode")):
        moved = delta(after[name], before.get(name, {}))
        queue_sum += total(moved, "kvpool_decode_queue_seconds_sum")
        queue_count += total(moved, "kvpool_decode_queue_seconds_count")
    return {"decode_queue_wait_mean_s": _ratio(queue_sum, queue_count)}


def _handoff_links(before: dict[str, Metrics], after: dict[str, Metrics]) -> dict[str, Any]:
    """The share of handoff bytes that crossed servers (the router's count, by link); the router queue's wait."""
    if "router" not in after:
        return {"cross_server_handoff_share": math.nan}
    moved = delta(after["router"], before.get("router", {}))
    queue: dict[str, Any] = {}
    _quantiles(queue, "router_queue_wait", buckets(moved, "kvpool_router_queue_seconds"))
    cross = total(moved, "kvpool_router_handoff_bytes_total", link="cross_server")
    same = total(moved, "kvpool_router_handoff_bytes_total", link="same_server")
    return {"cross_server_handoff_share": _ratio(cross, cross + same), "cross_server_handoff_bytes": int(cross),
            # the router's admission queue (decode room and the pipeline's device blocks), in front of stage 0
            "router_queue_wait_mean_s": _ratio(total(moved, "kvpool_router_queue_seconds_sum"),
                                               total(moved, "kvpool_router_queue_seconds_count")),
            # tickets its queue gave by aging (the oldest overdue), where the bypass budget held the order back,
            # or in arrival order because the backlog gate's seconds of work waited
            "router_queue_pops_aging": int(total(moved, "kvpool_router_queue_overdue_total")),
            "router_queue_pops_budget": int(total(moved, "kvpool_router_queue_budget_total")),
            "router_queue_pops_backlog": int(total(moved, "kvpool_router_queue_backlog_total")), **queue}


def summarize(result: ReplayResult, workload: ReplayWorkload, options: ReplayOptions) -> dict[str, Any]:
    """The flat summary of one replay (see the module doc)."""
    records = result.records
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    device, pool = sum(r.device_tokens for r in ok), sum(r.pool_tokens for r in ok)
    computed = sum(r.computed_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    wall = result.wall_s
    by_session = {s.id: s for s in workload.sessions}
    sent = [by_session[r.session_id].token_ids(by_session[r.session_id].turns[r.turn], workload.scale,
                                               workload.vocab_size) for r in records]
    bound = chunk_prefix_bound(sent, options.chunk_size)
    per_pipeline: dict[str, int] = defaultdict(int)
    for r in ok:
        per_pipeline[r.pipeline or "?"] += r.prompt_tokens
    ttft = [r.ttft_s for r in ok]
    itl = [gap for r in ok for gap in r.itl_s]
    missing: list[str] = []
    scraped = result.metrics_after
    if not any("stage" in name for name in scraped):
        missing.append("restore and save bytes per stage (no prefill stage /metrics reached: --url reaches the router)")
    if not any(name.startswith("decode") for name in scraped):
        missing.append("decode KV use and queue wait (no decode shard /metrics reached)")
    if result.pool is None:
        missing.append("pool occupancy and evictions (no pool master reached: --master ADDR)")
    summary: dict[str, Any] = {
        "concurrency": result.concurrency,
        "sessions": len({r.session_id for r in records}),
        "turns_sent": len(records),
        "turns_ok": len(ok),
        "errors": result.errors,
        "skipped_turns": workload.skipped_turns,
        "wall_s": wall,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "prompt_tok_s": _ratio(prompt, wall),
        "output_tok_s": _ratio(output, wall),
        "prompt_tok_s_per_pipeline": {p: _ratio(n, wall) for p, n in sorted(per_pipeline.items())},
        "reuse_ratio": _ratio(device + pool, prompt),
        "trace_bound": bound.ratio,
        "trace_block_bound": sent_block_bound(workload, ((r.session_id, r.turn) for r in records)),
        "trace_block_bound_all_turns": workload.trace_block_bound,
        "device_share": _ratio(device, prompt),
        "pool_share": _ratio(pool, prompt),
        "computed_share": _ratio(computed, prompt),
        "device_tokens": device,
        "pool_tokens": pool,
        "computed_tokens": computed,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "server_ttft_p50_s": percentile([r.server_ttft_s for r in ok], 50),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "handoff_transfers": sum(r.handoff_transfers for r in ok),
        "handoff_bytes": sum(r.handoff_bytes for r in ok),
        **_stage_figures(result.metrics_before, result.metrics_after),
        **_decode_figures(result.metrics_before, result.metrics_after),
        **_handoff_links(result.metrics_before, result.metrics_after),
        "decode_kv_util_peak": max(result.decode_utilization) if result.decode_utilization else math.nan,
        "decode_kv_util_mean": _ratio(sum(result.decode_utilization), len(result.decode_utilization)),
        "scale": workload.scale,
        "think_scale": options.think_scale,
        "chunk_size": options.chunk_size,
        "workload": workload.kind,
        "subagents": workload.num_subagents,
        "missing": missing,
    }
    pool_stats = result.pool or {}
    for key in ("capacity_bytes", "used_bytes", "evicted_groups", "evicted_bytes", "num_complete_groups"):
        summary[f"pool_{key}"] = int(pool_stats[key]) if key in pool_stats else None
    if result.errors:
        summary["first_error"] = next(r.error for r in records if r.error is not None)
    return summary


def _f(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def format_table(summaries: Sequence[dict[str, Any]], workload: ReplayWorkload) -> str:
    """The printed report: one row per concurrency level, then the run's other figures."""
    lines = [
        f"kvpool replay — {workload.kind} {workload.source}: {len(workload.sessions)} sessions "
        f"({workload.num_subagents} subagent timelines), {workload.num_turns} turns at --scale {workload.scale}, "
        f"{workload.skipped_turns} turns skipped (beyond the context of {workload.context})",
        f"{'conc':>5}{'prompt tok/s':>14}{'out tok/s':>11}{'reuse':>8}{'bound':>8}{'device':>8}{'pool':>8}"
        f"{'computed':>10}{'TTFT p50':>10}{'p90':>8}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'errors':>8}",
    ]
    for s in summaries:
        lines.append(
            f"{s['concurrency']:>5}{_f(s['prompt_tok_s'], ',.0f'):>14}{_f(s['output_tok_s'], ',.1f'):>11}"
            f"{_f(s['reuse_ratio'], '.1%'):>8}{_f(s['trace_bound'], '.1%'):>8}{_f(s['device_share'], '.1%'):>8}"
            f"{_f(s['pool_share'], '.1%'):>8}{_f(s['computed_share'], '.1%'):>10}"
            f"{_f(s['ttft_p50_s'], '.3f'):>9}s{_f(s['ttft_p90_s'], '.2f'):>7}s{_f(s['ttft_p99_s'], '.2f'):>7}s"
            f"{_f(s['itl_p50_s'] * 1e3, '.1f'):>7}ms{_f(s['itl_p99_s'] * 1e3, '.0f'):>6}ms{s['errors']:>8}")
    for s in summaries:
        per_pipe = ", ".join(f"{p} {v:,.0f}" for p, v in s["prompt_tok_s_per_pipeline"].items())
        lines += [
            f"concurrency {s['concurrency']}: {s['turns_ok']}/{s['turns_sent']} turns in {s['wall_s']:.1f} s; "
            f"trace block bound {_f(s['trace_block_bound'], '.1%')}; prompt tok/s per pipeline: {per_pipe or '-'}",
            f"  restore {s['restore_bytes']:,} B over {s['restores']} restoring requests (wait mean "
            f"{_f(s['restore_wait_mean_s'], '.3f')} s, p99 ~{_f(s['restore_wait_p99_s'], '.3f')} s); "
            "per stage bytes and mean read: "
            + (", ".join(f"{k} {v:,} B {_f(s['restore_seconds_mean_per_stage'].get(k), '.3f')} s"
                         for k, v in s["restore_bytes_per_stage"].items()) or "-")
            + f"; prefill queue wait mean {_f(s['prefill_queue_wait_mean_s'], '.3f')} s, "
            f"p99 ~{_f(s['prefill_queue_wait_p99_s'], '.3f')} s",
            f"  handoff {s['handoff_transfers']:,} transfers, {s['handoff_bytes']:,} B; decode KV use peak "
            f"{_f(s['decode_kv_util_peak'], '.1%')}, mean {_f(s['decode_kv_util_mean'], '.1%')}; decode queue "
            f"wait mean {_f(s['decode_queue_wait_mean_s'], '.4f')} s",
            f"  pool: used {_f(s['pool_used_bytes'], ',')} of {_f(s['pool_capacity_bytes'], ',')} B, "
            f"{_f(s['pool_num_complete_groups'], ',')} groups, evicted {_f(s['pool_evicted_groups'], ',')} groups "
            f"({_f(s['pool_evicted_bytes'], ',')} B)",
        ]
        if s.get("first_error"):
            lines.append(f"  first error: {s['first_error']}")
    if summaries and summaries[0]["missing"]:
        lines.append("not measured: " + "; ".join(summaries[0]["missing"]))
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """NaN and infinities become null, recursively: the line stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
