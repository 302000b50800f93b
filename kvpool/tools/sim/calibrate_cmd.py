"""``kvpool simulate --calibrate``: run the fit of ``calibrate`` from the cost model's ``[fit]``, freeze it, then check.

In this order, and the JSON's ``order`` says so:
1. **fit**: each step is one run of one server at 112 sessions (``--warmup``, default 1,500 s: past the pool
   share's climb, then ``--duration`` counted, default an hour; ``--quick``: 1,200 s). A step sees only its
   run's ``fit_view`` (the four fitted figures, ``calibrate.FITTED``, and what steers the step); it stops when
   those are within their targets or after ``--calibrate-steps`` steps.
2. **freeze**: the fit is printed and fixed.
3. **check**: the frozen fit's run at 112 sessions (the last step's: a run is deterministic) and a new run at 96
   are read for every other figure (restore, stage spread, 96 sessions, queue, reuse) and both for the settling
   rule (``metrics.settling``). A counted span shorter than the rule's is refused before anything runs.
The last JSON line has ``calibrated`` (every figure within, both runs steady), ``fitted`` (each fitted input with
the figure it was fitted to), ``constants`` (every other constant with its source), ``figures`` and the windows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

HOUR_S = 3600.0
QUICK_S = 1200.0  # the settling rule's shortest counted span
WARMUP_S = 1500.0  # a cold start's pool share climbs for ~20 minutes (docs/simulation.md)
# the figures reported for the frozen fit with prompts cut to the context and as recorded
CONTEXT_KEYS = ("throughput_per_gpu", "pool_share", "reuse_ratio", "trace_bound", "ttft_p50_s", "restore_p50_ms",
                "restore_tokens_p50", "stage_spread_mean_s", "decode_kv_reserved_p50", "prefill_busy", "steady",
                "counted_prompt_tokens", "counted_turns")
WINDOW_S = 300.0  # the hour's figures per 5 minutes: a fit must hold in each, not only on average


def _run(sessions: int, cost: Any, traces: str, warmup: float, duration: float,
         topology: Any = None) -> dict[str, Any]:
    from kvpool.tools.sim.report import RunSpec
    from kvpool.tools.sim.runner import run_spec
    from kvpool.tools.sim.topology import RunSettings, Topology

    result = run_spec(RunSpec(f"calibration-{sessions}", 1, sessions, "shared", duration), traces, cost,
                      RunSettings(warmup_s=warmup, window_s=WINDOW_S), topology or Topology())
    result["windows"] = counted_windows(result.pop("windows", []), warmup, duration, WINDOW_S,
                                        Topology().gpus_per_server)
    return result


def counted_span(args: argparse.Namespace) -> tuple[float, float]:
    """(warm-up, counted seconds) of every run; ``ValueError`` naming the flag when the counted span is shorter
    than the settling rule's (such a run could not be told steady)."""
    from kvpool.tools.sim.metrics import SETTLE_MIN_S

    counted = args.duration if args.duration is not None else (QUICK_S if args.quick else HOUR_S)
    warmup = args.warmup if args.warmup is not None else WARMUP_S
    if counted < SETTLE_MIN_S:
        raise ValueError(f"--duration: {counted:g} s counted is shorter than the settling rule's {SETTLE_MIN_S:g} s "
                         f"(the pool share of its two halves is compared; give at least {SETTLE_MIN_S:g})")
    if warmup < 0:
        raise ValueError(f"--warmup: must be >= 0, got {warmup:g}")
    return warmup, counted


def counted_windows(windows: list[dict[str, float]], warmup: float, duration: float, window_s: float,
                    gpus: int) -> list[dict[str, float]]:
    """The run's whole windows after the warm-up: pool share, reuse and tokens/s per GPU in each."""
    return [{"t": w["t"], "pool_share": w["pool_share"], "reuse": w["reuse"], "prompt_tokens": w["prompt_tokens"],
             "throughput_per_gpu": w["tokens_done"] / window_s / gpus}
            for w in windows if warmup <= w["t"] and w["t"] + window_s <= duration]


def _row(fit: Any, view: dict[str, float], wall_s: float) -> str:
    """One fit step: its inputs and the fitted figures only (the checks are read after the freeze)."""
    return (f"fit kv {fit.device_kv_gib_per_gpu:6.1f} GiB  prefill x{fit.prefill_level:.3f}  think "
            f"x{fit.think_scale:.4f}  decode kv {fit.decode_kv_gib_per_gpu:.1f} GiB -> "
            f"{view['throughput_per_gpu']:8,.0f} tok/s/GPU  pool {view['pool_share']:.1%}  dec KV held "
            f"{view['decode_kv_reserved_p50']:.1%}  TTFT p50 {view['ttft_p50_s']:.2f}s  (busy "
            f"{view['prefill_busy']:.0%}  TTFT mean {view['ttft_mean_s']:.1f}s  think mean "
            f"{view['think_mean_s']:.1f}s; wall {wall_s:.0f}s)")


def main(args: argparse.Namespace) -> int:
    from kvpool.tools.sim.calibrate import (FITTED, KvBracket, fit_toml, fit_view, fitted_rows, fitted_within,
                                            next_fit, verdict)
    from kvpool.tools.sim.cost_model import (RESULTS_DIR, bench_turn_check, cost_model_path, load_cost_model,
                                             provenance)

    if not Path(args.traces).is_dir():
        print(f"kvpool simulate: no trace folder at {args.traces} (give --traces)", file=sys.stderr)
        return 2
    try:
        warmup, counted = counted_span(args)
    except ValueError as exc:
        print(f"kvpool simulate: {exc}", file=sys.stderr)
        return 2
    from kvpool.tools.sim.topology import CONTEXT_AS_RECORDED, Topology

    cost = load_cost_model(cost_model_path(args))
    topology = Topology() if args.max_context is None else Topology(max_context=args.max_context)
    duration = warmup + counted
    t0 = time.perf_counter()
    steps = []
    bracket = KvBracket()
    print(f"1. fit: one server, 112 sessions, {warmup:g} s warm-up + {counted:g} s counted a step", flush=True)
    run = _run(112, cost, args.traces, warmup, duration, topology)
    view = fit_view(run)
    print(_row(cost.fit, view, run["wall_s"]), flush=True)
    steps.append({"fit": asdict(cost.fit), **view})
    for _ in range(args.calibrate_steps):
        if fitted_within(view):
            break
        cost = replace(cost, fit=next_fit(cost.fit, view, cost, bracket))
        run = _run(112, cost, args.traces, warmup, duration, topology)
        view = fit_view(run)
        print(_row(cost.fit, view, run["wall_s"]), flush=True)
        steps.append({"fit": asdict(cost.fit), **view})
    print("2. freeze:\n" + fit_toml(cost.fit), flush=True)
    print("3. check: the frozen fit's run at 112 sessions, and 96 sessions", flush=True)
    run96 = _run(96, cost, args.traces, warmup, duration, topology)
    out = verdict(run, run96)
    for key, row in out["figures"].items():
        mark = "ok " if row["within"] else "OUT"
        kind = "fitted" if row["fitted"] else "checked"
        print(f"  {mark} {row['name']:<44} {row['value']:>12.4g}   seed {row['target']:<26} ({kind})")
    for label, r in (("112", run), ("96", run96)):
        st = r["settling"]
        print(f"  {'ok ' if st['steady'] else 'OUT'} {label} sessions steady: pool share "
              f"{st['pool_share_first_half']:.1%} then {st['pool_share_second_half']:.1%} over "
              f"{st['counted_s']:.0f} s ({st['rule']})")
    for w in run["windows"]:
        print(f"  112 sessions, {w['t']:5.0f}-{w['t'] + WINDOW_S:5.0f} s: pool share {w['pool_share']:.1%}  "
              f"reuse {w['reuse']:.2%}  {w['throughput_per_gpu']:8,.0f} tok/s/GPU")
    contexts = None
    if topology.max_context < CONTEXT_AS_RECORDED:  # both: the frozen fit with no prompt cut
        uncut = _run(112, cost, args.traces, warmup, duration, replace(topology, max_context=CONTEXT_AS_RECORDED))
        contexts = {label: {k: r[k] for k in CONTEXT_KEYS} | {"cut_to_context": r["trace_policy"]["cut_to_context"],
                                                             "max_context": r["trace_policy"]["context_tokens"]}
                    for label, r in (("cut", run), ("as_recorded", uncut))}
        print(f"  112 sessions, prompts as recorded (none cut): {uncut['throughput_per_gpu']:,.0f} tok/s/GPU, pool "
              f"share {uncut['pool_share']:.1%}, TTFT p50 {uncut['ttft_p50_s']:.2f}s, restore p50 "
              f"{uncut['restore_p50_ms']:.0f}ms, steady {uncut['steady']}", flush=True)
    constants = {k: v for k, v in provenance(cost).items() if k.removeprefix("fit.") not in FITTED}
    master_check = None
    if cost.master.record:
        bench = json.loads((RESULTS_DIR / cost.master.record).read_text())
        master_check = bench_turn_check(cost.master, bench.get("output", bench))
    out.update(contexts=contexts, order=["fit: each step one run at 112 sessions, judged on the fitted figures only",
                      "freeze: the fit below fixed", "check: the frozen fit's 112 run and a 96 run, every other "
                      "figure and the settling rule"],
               fitted=fitted_rows(cost.fit, run), constants=constants, master_turn_check=master_check,
               fit=asdict(cost.fit), steps=steps, warmup_s=warmup, counted_s=counted,
               steady={"112": run["steady"], "96": run96["steady"]},
               settling_112=run["settling"], settling_96=run96["settling"],
               # the reuse target against what these traces allow over the same turns (the bound, its count)
               reuse_bound={"trace_bound": run["trace_bound"], "reuse": run["reuse_ratio"],
                            "turns": run["counted_turns"], "prompt_tokens": run["counted_prompt_tokens"],
                            "target_reachable": run["trace_bound"] > 0.95},
               windows_112=run["windows"], windows_96=run96["windows"],
               run_112={k: v for k, v in run.items() if not isinstance(v, list)},
               run_96={k: v for k, v in run96.items() if not isinstance(v, list)},
               wall_s=time.perf_counter() - t0)
    print(json.dumps(out, sort_keys=True) if args.json else json.dumps(out, indent=2, sort_keys=True))
    return 0 if out["calibrated"] else 1
