"""``kvpool simulate --compare sched=fifo,session``: session-aware prefill against the FIFO queue, side by side.

Two pairs of runs on the calibrated single server (the cost model's ``[fit]``),
each pair identical but for ``RunSettings.sched``:

- **closed loop**, ``--sessions`` (default 112) session slots, each thinking,
  sending a turn and waiting for its last token (the calibration's regime);
- **open loop**, new sessions arriving at a fixed rate whatever the server
  does, each playing its trace once, at 90% of the open loop's capacity:
  the highest arrival rate the FIFO server keeps up with (it prefills at
  least ``SUSTAINED`` of the prompt tokens offered, rate × the mean prompt
  tokens of a trace as played, and prefill is busy at most ``SATURATED_BUSY``:
  an open queue past its capacity keeps prefill busy all the time). The closed loop's capacity does not carry
  over: fewer sessions live at once, so the device holds more of their
  histories and a token costs less, until a rate where it no longer holds
  them and every turn restores its whole history (the device cache's
  cliff). So FIFO runs at ``GRID`` points between the closed run's token
  rate (its prompt tokens per second over a trace's) and the rate scaled so
  prefill would be as busy as in the closed FIFO run, side by side; the
  capacity is the highest point sustained, and every point is reported
  (``capacity_sweep``). A session lives long (tens of turns of
  think, TTFT and decode), so each open run starts with the sessions a steady
  state holds (rate × the closed FIFO run's session lifetime: turns a trace ×
  its mean think + TTFT + decode) and warms up ``OPEN_WARMUP_S``.

The closed pair runs first (the open rate comes from it), each pair in two
processes. Figures count after the warm-up, as in every simulated run.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpool.tools.sim.metrics import percentile
from kvpool.tools.sim.report import RunSpec
from kvpool.tools.sim.runner import _sessions, run_spec
from kvpool.tools.sim.topology import RunSettings, Topology
from kvpool.tools.sim.workload import fit_to_context

SIDES = ("fifo", "session")
OPEN_LOAD = 0.9
# the server keeps up with the arrivals: it prefills this share of the prompt tokens offered (a trace's
# tokens vary widely, so a counted window holds fewer or more than the mean) and prefill is not saturated
SUSTAINED = 0.9
SATURATED_BUSY = 0.95
GRID = 4  # FIFO runs of the capacity sweep, evenly from the closed run's token rate up
OPEN_WARMUP_S = 1200.0
KEEP = ("throughput_per_gpu", "think_mean_s", "decode_mean_s", "prompt_tok_s", "reuse_ratio", "trace_bound",
        "device_share", "pool_share", "computed_share", "counted_prompt_tokens",
        "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "queue_p50_s", "queue_p90_s", "restore_p50_ms",
        "restore_critical_s_per_turn", "prefill_busy", "turns", "errors", "prefetched_bytes", "prefetch_used_bytes",
        "prefetch_wasted_bytes", "prefetch_pending_bytes", "wasted_prefetch_share", "prefetches",
        "prefetches_cancelled", "prefetches_skipped_pressure", "prefetches_unpinned", "prefetch_outcomes",
        "queue_overdue_pops", "queue_budget_pops", "queue_backlog_pops", "ttft_breakdown", "ttft_samples")
# pooling one side's runs over seeds (``pool_runs``): these add up; these are shares of the counted prompt
# tokens (weighted by them); the TTFT figures come from every run's turns together; other numbers are means
SUMMED = ("turns", "errors", "counted_prompt_tokens", "prefetched_bytes", "prefetch_used_bytes",
          "prefetch_wasted_bytes", "prefetch_pending_bytes", "prefetches", "prefetches_cancelled",
          "prefetches_skipped_pressure", "prefetches_unpinned", "queue_overdue_pops", "queue_budget_pops",
          "queue_backlog_pops")
TOKEN_SHARES = ("reuse_ratio", "trace_bound", "device_share", "pool_share", "computed_share")


SINGLE_RUN_NOTE = ("one trace offset: a run's p99 is its ~70th slowest turn and moved 0.96-1.40x between offsets "
                   "at 112 sessions (docs/simulation.md); --seeds 5 pools five")


def parse_sched_compare(text: str) -> None:
    """Only ``sched=fifo,session``; SystemExit naming the flag otherwise."""
    what, _, sides = text.partition("=")
    if what != "sched" or tuple(sides.split(",")) != SIDES:
        raise SystemExit(f"kvpool simulate: --compare: expected sched=fifo,session, got {text!r}")


def mean_session_prompt_tokens(trace_dir: str, chunk_tokens: int, max_context: int) -> float:
    """Prompt tokens one trace instance sends, as played (each turn cut to the context), averaged."""
    traces = _sessions(trace_dir)
    total = sum(fit_to_context(t, s.block_size, max_context).input_tokens for s in traces for t in s.turns)
    return total / len(traces)


def ratios(fifo: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
    def over(key: str) -> float:
        return session[key] / fifo[key] if fifo[key] else 0.0

    return {
        "ttft_p50_session_over_fifo": over("ttft_p50_s"), "ttft_p99_session_over_fifo": over("ttft_p99_s"),
        "ttft_mean_session_over_fifo": over("ttft_mean_s"),
        "throughput_session_over_fifo": over("throughput_per_gpu"),
        "prompt_throughput_session_over_fifo": over("prompt_tok_s"),
        "restore_critical_session_over_fifo": over("restore_critical_s_per_turn"),
        "reuse_session": session["reuse_ratio"], "reuse_fifo": fifo["reuse_ratio"],
        # each side's turns differ (who finished in the window): the trace's own bound over them, and the share
        # of prompt tokens under it the caches did not serve (what eviction and misses cost, like for like)
        "trace_bound_session": session.get("trace_bound", 0.0), "trace_bound_fifo": fifo.get("trace_bound", 0.0),
        "reuse_gap_session": session.get("trace_bound", 0.0) - session["reuse_ratio"],
        "reuse_gap_fifo": fifo.get("trace_bound", 0.0) - fifo["reuse_ratio"],
        "wasted_prefetch_share": session["wasted_prefetch_share"],
        "errors": fifo["errors"] + session["errors"],
    }


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's runs (one per seed) as one run: TTFT percentiles and mean over all their counted turns,
    ``SUMMED`` added, ``TOKEN_SHARES`` weighted by counted prompt tokens, the prefetch's waste over all its
    bytes, outcomes added, other numbers averaged (throughput: every run counts the same span); the TTFT
    breakdown only with one run. ``ttft_samples`` is dropped."""
    tokens = sum(r.get("counted_prompt_tokens", 0) for r in runs) or 1
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if key in SUMMED:
            out[key] = sum(values)
        elif key in TOKEN_SHARES:
            out[key] = sum(v * r.get("counted_prompt_tokens", 0) for v, r in zip(values, runs)) / tokens
        elif key == "prefetch_outcomes":
            out[key] = {k: sum(v.get(k, 0) for v in values) for k in sorted({k for v in values for k in v})}
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            out[key] = sum(values) / len(values)
        elif key == "ttft_samples" or key == "ttft_breakdown" and len(runs) > 1:
            continue  # the samples make the percentiles below; breakdowns of several runs do not add up
        else:
            out[key] = first
    samples = [t for r in runs for t in r.get("ttft_samples", [])]
    out.update(ttft_p50_s=percentile(samples, 50), ttft_p90_s=percentile(samples, 90),
               ttft_p99_s=percentile(samples, 99), ttft_mean_s=sum(samples) / max(1, len(samples)),
               ttft_turns=len(samples))
    if out.get("prefetched_bytes"):
        out["wasted_prefetch_share"] = out["prefetch_wasted_bytes"] / out["prefetched_bytes"]
    elif "prefetched_bytes" in out:
        out["wasted_prefetch_share"] = 0.0
    return out


def per_seed(seeds: list[int], fifo: list[dict[str, Any]], session: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each seed's pair as its own comparison: how far the pooled ratios hold run by run."""
    keys = ("ttft_p50_session_over_fifo", "ttft_p99_session_over_fifo", "throughput_session_over_fifo",
            "reuse_session", "reuse_fifo", "reuse_gap_session", "reuse_gap_fifo", "errors")
    rows = []
    for seed, f, s in zip(seeds, fifo, session):
        r = ratios(f, s)
        rows.append({"seed": seed, **{k: r[k] for k in keys}})
    return rows


def _runs(settings: list[RunSettings], spec: RunSpec, args: argparse.Namespace, cost_path: str,
          topology: Topology) -> list[dict[str, Any]]:
    """Each settings' run, side by side in processes (``--jobs``), in the order given."""
    with ProcessPoolExecutor(max_workers=max(1, min(len(settings), args.jobs))) as pool:
        futures = [pool.submit(run_spec, spec, args.traces, cost_path, s, topology) for s in settings]
        results = [f.result() for f in futures]
    return [{k: r[k] for k in KEEP if k in r} | {"sched": r["sched"]} for r in results]


def _sides(base: RunSettings, seeds: list[int], spec: RunSpec, args: argparse.Namespace, cost_path: str,
           topology: Topology) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """FIFO's and session's runs of ``base``, one per seed (the trace offset), each in seed order."""
    settings = [replace(base, sched=side, seed_offset=seed) for seed in seeds for side in SIDES]
    runs = _runs(settings, spec, args, cost_path, topology)
    return runs[0::2], runs[1::2]


def run_compare(args: argparse.Namespace, cost_path: str) -> dict[str, Any]:
    from kvpool.tools.sim.cost_model import load_cost_model

    parse_sched_compare(args.compare)
    duration = 240.0 if args.quick else (args.duration or 900.0)
    warmup = min(60.0 if args.quick else (300.0 if args.warmup is None else args.warmup), duration / 2)
    sessions = args.sessions
    if args.first_seed < 0:
        raise SystemExit(f"kvpool simulate: --first-seed: must be >= 0, got {args.first_seed}")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if not seeds:
        raise SystemExit(f"kvpool simulate: --seeds: must be at least 1, got {args.seeds}")
    topology = Topology()
    try:
        base = RunSettings(warmup_s=warmup, duration_s=duration, think=not args.no_think, think_scale=args.think_scale,
                           max_wait_s=args.sched_max_wait_s, max_bypass_s=args.sched_max_bypass_s,
                           reorder_below_s=args.sched_reorder_below_s, session_order=args.session_order,
                           keep_ttft_samples=True, seed_offset=seeds[0])  # the capacity sweep's traces
    except ValueError as exc:
        raise SystemExit(f"kvpool simulate: {exc}") from None
    spec = RunSpec("calibration", 1, sessions, "shared", duration)
    closed_runs = _sides(base, seeds, spec, args, cost_path, topology)
    closed = [pool_runs(runs) for runs in closed_runs]
    cost = load_cost_model(Path(cost_path))
    per_session = mean_session_prompt_tokens(args.traces, cost.model.chunk_tokens, topology.max_context)
    rate = OPEN_LOAD * closed[0]["prompt_tok_s"] / per_session
    traces = _sessions(args.traces)
    turns = sum(len(t.turns) for t in traces) / len(traces)
    fifo = closed[0]
    lifetime = turns * (fifo["think_mean_s"] + fifo["ttft_mean_s"] + fifo["decode_mean_s"])
    open_warmup = 60.0 if args.quick else OPEN_WARMUP_S
    counted = duration - warmup
    open_spec = replace(spec, duration_s=open_warmup + counted)

    def open_settings(sched: str, sessions_per_s: float) -> RunSettings:
        return replace(base, sched=sched, open_loop_sessions_per_s=sessions_per_s, warmup_s=open_warmup,
                       duration_s=open_warmup + counted, open_loop_initial_sessions=round(sessions_per_s * lifetime))

    token_rate = rate / OPEN_LOAD  # the closed FIFO run's prompt tokens/s, in sessions/s
    sweep: list[dict[str, Any]] = []
    capacity: float | None = None
    if args.open_rate is not None:  # the rate given: no sweep
        rate = args.open_rate
    else:  # FIFO at the first seed's traces
        pilot_settings = open_settings("fifo", token_rate)
        pilot = _runs([pilot_settings], open_spec, args, cost_path, topology)[0]
        busy_rate = token_rate * fifo["prefill_busy"] / max(pilot["prefill_busy"], 1e-9)
        rates = [token_rate + (busy_rate - token_rate) * k / (GRID - 1) for k in range(1, GRID)]
        settings = [pilot_settings, *(open_settings("fifo", r) for r in rates)]
        runs = [pilot, *_runs(settings[1:], open_spec, args, cost_path, topology)]
        for each, run in zip(settings, runs):
            offered = each.open_loop_sessions_per_s * per_session
            sweep.append({"sessions_per_s": each.open_loop_sessions_per_s, "seed_offset": each.seed_offset,
                          "offered_prompt_tok_s": offered, "served_share": run["prompt_tok_s"] / offered,
                          "prefill_busy": run["prefill_busy"], "ttft_p50_s": run["ttft_p50_s"],
                          "device_share": run["device_share"]})
        sustained = [p["sessions_per_s"] for p in sweep
                     if p["served_share"] >= SUSTAINED and p["prefill_busy"] <= SATURATED_BUSY]
        capacity = max(sustained) if sustained else token_rate
        rate = OPEN_LOAD * capacity
    open_base = open_settings("fifo", rate)
    open_runs = _sides(open_base, seeds, open_spec, args, cost_path, topology)
    opened = [pool_runs(runs) for runs in open_runs]
    out = ratios(*closed)
    out["seeds"], out["first_seed"] = len(seeds), seeds[0]
    out["closed_loop"] = {"sessions": sessions, **{s: r for s, r in zip(SIDES, closed)},
                          "per_seed": per_seed(seeds, *closed_runs)}
    out["open_loop"] = {"load": OPEN_LOAD, "sessions_per_s": rate, "mean_session_prompt_tokens": per_session,
                        "initial_sessions": round(rate * lifetime), "warmup_s": open_warmup,
                        "prefill_busy_over_closed_fifo": opened[0]["prefill_busy"] / fifo["prefill_busy"],
                        "capacity_sweep": sweep, "capacity_sessions_per_s": capacity,
                        **ratios(*opened), **{s: r for s, r in zip(SIDES, opened)},
                        "per_seed": per_seed(seeds, *open_runs)}
    out["errors"] += out["open_loop"]["errors"]
    out["duration_s"], out["warmup_s"] = duration, warmup
    return out


def table(out: dict[str, Any]) -> str:
    rows = [("run", "sched", "tok/s/GPU", "reuse", "TTFT p50", "p99", "mean", "queue p90", "restore/turn",
             "prefetched", "used", "wasted")]
    for loop in ("closed_loop", "open_loop"):
        for side in SIDES:
            r = out[loop][side]
            rows.append((loop, side, f"{r['throughput_per_gpu']:,.0f}", f"{r['reuse_ratio']:.1%}",
                         f"{r['ttft_p50_s']:.2f}s", f"{r['ttft_p99_s']:.2f}s", f"{r['ttft_mean_s']:.2f}s",
                         f"{r['queue_p90_s']:.2f}s", f"{r['restore_critical_s_per_turn'] * 1e3:.0f}ms",
                         f"{r.get('prefetched_bytes', 0) / 1e9:.1f}GB", f"{r.get('prefetch_used_bytes', 0) / 1e9:.1f}GB",
                         f"{r.get('prefetch_wasted_bytes', 0) / 1e9:.1f}GB"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def offsets_line(out: dict[str, Any]) -> str:
    """Under the table: how far one run's p99 can be trusted (one offset), or how far the offsets spread."""
    if out["seeds"] == 1:
        return SINGLE_RUN_NOTE
    closed = [r["ttft_p99_session_over_fifo"] for r in out["closed_loop"]["per_seed"]]
    first = out["first_seed"]
    return (f"{out['seeds']} trace offsets pooled ({first}-{first + out['seeds'] - 1}); the closed loop's p99 ratio by offset: "
            f"{min(closed):.2f}-{max(closed):.2f}")


def main(args: argparse.Namespace) -> int:
    from kvpool.tools.sim.cost_model import cost_model_path

    out = run_compare(args, cost_model_path(args))
    print(table(out))
    print(offsets_line(out))
    print(json.dumps(out, sort_keys=True) if args.json else json.dumps(out, indent=2, sort_keys=True))
    return 0
