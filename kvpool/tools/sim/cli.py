"""``kvpool simulate``: the seed's comparisons and the pool past four servers, on the system's own policy code.

The simulation itself is ``kvpool.tools.sim`` (pure: the core and the workload);
this module parses flags, runs the matrix's entries in parallel processes,
prints the table, writes plots and the final JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

DEFAULT_TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces" / "agentx-weka"  # ../shared from the repo


def add_simulate_parser(sub: Any) -> None:
    from kvpool.tools.sim.cost_model import CPU_COST_MODEL, DEFAULT_COST_MODEL

    p = sub.add_parser(
        "simulate", help="simulate the cluster at the seed's scale and past it (the core's own policy code)",
        description="A discrete-event simulation that drives kvpool.core (pool index, block manager, prefill "
        "request, decode scheduler, router policy) with real weka traces at full token scale: shared vs split "
        "pools at 32-112 sessions per server on 4 servers, a single-server calibration run, 8/16/32/64 servers "
        "(one server's stores dying mid-run) and the capacity scenario (split stores that evict). No process is "
        "started and no byte moves.",
    )
    p.add_argument("--traces", default=str(DEFAULT_TRACES), help="folder of weka trace_*.json files")
    p.add_argument("--cost-model", default=None,
                   help=f"cost model TOML (default: {DEFAULT_COST_MODEL.name}, the seed's GPUs; with --validate: "
                   f"{CPU_COST_MODEL.name}, measured on this host for the local cluster --validate starts)")
    # defaults: the matrix of docs/simulation.md, 56 runs; on a shared 2-core host that is hours, one run at a
    # time (each run's wall time is in the doc's tables; --jobs runs several at once)
    p.add_argument("--duration", type=float, default=None,
                   help="simulated seconds per seed run (default 900); with --calibrate the seconds counted after "
                   "the warm-up (default 3600, --quick 1200; shorter than the settling rule's 1200 is refused)")
    p.add_argument("--scale-duration", type=float, default=2700.0,
                   help="simulated seconds per 8/16/32/64-server run (default 2700: --scale-warmup, then the settling "
                   "rule's 1200 s counted; server 0's stores die at 2/3 of it)")
    p.add_argument("--scale-warmup", type=float, default=1500.0,
                   help="simulated seconds before a scale-out or capacity run counts (default 1500: past the pool "
                   "share's climb after a cold start)")
    p.add_argument("--capacity-sessions", default="112,224", metavar="N,...",
                   help="the capacity scenario's sessions per server (default 112,224: a split server's store holds "
                   "the live histories of ~184 sessions of prompts as recorded)")
    p.add_argument("--capacity-servers", type=int, default=4,
                   help="servers in the capacity scenario (default 4, the seed's; 1 runs shared against split-strict "
                   "alone, no session can move)")
    p.add_argument("--capacity-duration", type=float, default=2700.0,
                   help="simulated seconds per capacity run (4 servers, prompts as recorded, one agent's prefix "
                   "shared; default 2700)")
    p.add_argument("--scale-sessions", type=int, default=112,
                   help="sessions per server in the 8/16/32-server runs (default 112: the calibrated server's "
                   "saturating load)")
    p.add_argument("--warmup", type=float, default=None,
                   help="simulated seconds before throughput/TTFT count (default 300; --calibrate: 1500, past the "
                   "pool share's climb after a cold start)")
    p.add_argument("--max-context", type=int, default=None, metavar="TOKENS",
                   help="cut a prompt whose prompt + output passes TOKENS to its leading tokens (default 163840, "
                   "DeepSeek-V3's context, which cuts 9.5%% of the recorded prompts; 1048576: none cut)")
    p.add_argument("--think-scale", type=float, default=None,
                   help="each turn's think time is the trace's times this (default: the cost model's [fit] think_scale)")
    p.add_argument("--no-think", action="store_true", help="send each turn as soon as the last one ends")
    p.add_argument("--affinity", default="4",
                   help="the router's session-affinity threshold for the seed matrix: strict, none or N (default 4)")
    p.add_argument("--only", help="comma-separated run labels to keep (e.g. calibration,seed-shared-112)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs side by side (processes)")
    p.add_argument("--quick", action="store_true", help="a small matrix, under a minute")
    p.add_argument("--validate", action="store_true",
                   help="replay a few concurrent sessions on a local cluster (kvpool replay) with a pool that "
                   "evicts, then in the simulator in the cluster's admission order; compare turn by turn")
    p.add_argument("--runs", type=int, default=1, help="--validate: whole comparisons to run (timing median, spread)")
    p.add_argument("--validate-mode", choices=("ungated", "gated", "long"), default="ungated",
                   help="--validate: ungated (stage 0 admits each turn on arrival); gated (one prefill at a time, "
                   "FIFO, the serving-order touch on, on both sides); long (gated, 4-18K-token prompts that evict "
                   "from the device cache and the pool)")
    p.add_argument("--validate-records", metavar="FILE", help="--validate: keep the cluster's request records here")
    p.add_argument("--calibrate", action="store_true",
                   help="fit the cost model's [fit] inputs to the seed's single server at 112 sessions, check 96")
    p.add_argument("--calibrate-steps", type=int, default=4, help="most fit steps (runs) before the check")
    p.add_argument("--compare", metavar="sched=fifo,session",
                   help="session-aware prefill against the FIFO queue on the calibrated server: a closed loop of "
                   "--sessions and an open loop at 90%% of its capacity (docs/simulation.md)")
    p.add_argument("--sessions", type=int, default=112, help="--compare: closed-loop sessions (default 112)")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="--compare: run each side N times, session k playing trace k + seed for seed 0..N-1, and "
                        "pool the runs' turns (one run's p99 rests on ~70 turns: at 112 sessions its ratio moved "
                        "0.96-1.40x from seed to seed); per_seed lists each pair's ratios (default 1)")
    p.add_argument("--first-seed", type=int, default=0, metavar="K",
                   help="--compare: the first trace offset, so --seeds N runs K..K+N-1 (default 0); settings chosen "
                        "on offsets 0-4 are checked on ones they were not chosen on with --first-seed 5")
    p.add_argument("--sched-max-wait-s", type=float, default=4.0, metavar="S",
                   help="sched=session: a prefill waiting this long goes first, oldest first (the queue's aging "
                        "bound; default 4, the services' --sched-max-wait-s; inf: no aging)")
    p.add_argument("--sched-max-bypass-s", type=float, default=math.inf, metavar="S",
                   help="sched=session: the queue's bypass budget, seconds of estimated work that younger prefills "
                        "may overtake a prefill by; a prefill then waits at most what FIFO would make it wait plus "
                        "S (default: none; the services' --sched-max-bypass-s)")
    p.add_argument("--sched-reorder-below-s", type=float, default=math.inf, metavar="S",
                   help="sched=session: the queue's backlog gate: while S seconds of estimated work or more are "
                        "queued, prefills go in arrival order; below it, in the session order (default: none; "
                        "the services' --sched-reorder-below-s)")
    p.add_argument("--session-order", default="work", choices=("work", "ratio"),
                   help="sched=session: the queue's order, least work first or highest response ratio next "
                        "(default work)")
    p.add_argument("--open-rate", type=float, default=None, metavar="SESSIONS_PER_S",
                   help="--compare: the open loop's session arrival rate (default: prefill 90%% as busy as in the "
                   "closed FIFO run, found by a pilot run)")
    p.add_argument("--json", action="store_true", help="the last line of output is one JSON object")
    p.add_argument("--runs-to", metavar="FILE", help="append each run's figures to FILE (JSON lines) as it ends")
    p.add_argument("--from-runs", metavar="FILE",
                   help="report from runs appended by --runs-to (no simulation: the table and the JSON line)")
    p.add_argument("--plot", metavar="DIR", help="write PNG charts here")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvpool.tools.sim.cost_model import cost_model_path
    from kvpool.tools.sim.report import matrix
    from kvpool.tools.sim.runner import run_spec
    from kvpool.tools.sim.topology import RunSettings, Topology, parse_affinity

    duration = 240.0 if args.quick else args.duration
    scale_duration = 240.0 if args.quick else args.scale_duration
    try:
        capacity = tuple(int(n) for n in args.capacity_sessions.split(","))
        if not capacity or min(capacity) <= 0 or args.capacity_servers <= 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"kvpool simulate: --capacity-sessions / --capacity-servers: expected positive integers, "
                         f"got {args.capacity_sessions!r} / {args.capacity_servers!r}") from None
    specs = matrix(duration, scale_duration, args.quick, args.scale_sessions, args.scale_warmup,
                   args.capacity_duration, args.scale_warmup, capacity, args.capacity_servers)
    if args.only:
        wanted = set(args.only.split(","))
        specs = [s for s in specs if s.label in wanted]
        if not specs:
            raise SystemExit(f"kvpool simulate: --only matched no run (labels: {', '.join(wanted)})")
    try:
        affinity = parse_affinity(args.affinity)
    except ValueError as exc:
        raise SystemExit(f"kvpool simulate: {exc}") from None
    try:
        base = RunSettings(warmup_s=60.0 if args.quick else args.warmup, think=not args.no_think,
                           think_scale=args.think_scale, affinity_max_queue=affinity,
                           max_wait_s=args.sched_max_wait_s, max_bypass_s=args.sched_max_bypass_s,
                           reorder_below_s=args.sched_reorder_below_s, session_order=args.session_order)
    except ValueError as exc:
        raise SystemExit(f"kvpool simulate: {exc}") from None
    topology = Topology() if args.max_context is None else Topology(max_context=args.max_context)
    call = (args.traces, cost_model_path(args), base, topology)
    # the biggest runs first, so the pool's processes end together
    order = sorted(specs, key=lambda s: -s.servers * s.sessions_per_server * s.duration_s)
    results: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_spec, s, *call): s.label for s in order}
        for future in as_completed(futures):
            results[futures[future]] = result = future.result()
            if args.runs_to:  # each run as it ends: a long matrix stopped midway keeps what it finished
                with open(args.runs_to, "a") as out:
                    out.write(json.dumps(result, sort_keys=True) + "\n")
    return [results[s.label] for s in specs]


def main(args: argparse.Namespace) -> int:
    if args.max_context is not None and args.max_context <= 0:
        print(f"kvpool simulate: --max-context: must be positive, got {args.max_context}", file=sys.stderr)
        return 2
    if not args.calibrate:  # the calibration has its own defaults (calibrate_cmd.counted_span)
        args.duration = 900.0 if args.duration is None else args.duration
        args.warmup = 300.0 if args.warmup is None else args.warmup
    if args.validate:
        from kvpool.tools.sim.validate_cmd import main as validate

        return validate(args)
    if args.compare:
        from kvpool.tools.sim.compare_sched import main as compare

        return compare(args)
    if args.calibrate:
        from kvpool.tools.sim.calibrate_cmd import main as calibrate

        return calibrate(args)
    from kvpool.tools.sim.report import final_object, plot, table

    if not Path(args.traces).is_dir():
        print(f"kvpool simulate: no trace folder at {args.traces} (give --traces)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.from_runs:
        results = [json.loads(line) for line in Path(args.from_runs).read_text().splitlines() if line.strip()]
        wall = sum(r["wall_s"] for r in results)
    else:
        results = _run(args)
        wall = time.perf_counter() - t0
    print(table(results))
    if args.plot:
        for path in plot(results, args.plot):
            print(f"wrote {path}")
    final = final_object(results, wall)
    if args.json:
        print(json.dumps(final, sort_keys=True))
    else:
        print(json.dumps(final, indent=2, sort_keys=True))
    return 0
