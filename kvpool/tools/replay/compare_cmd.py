"""``kvpool replay --compare``: the flags and the run of the side-by-side comparisons (``kvpool.tools.replay.compare``).

``add_compare_arguments`` adds the flags to the ``replay`` parser; ``main``
runs when ``--compare`` is given. The pool and device sizes default to the
seed's regime for the workload at hand: each store holds enough that the
shared pool (two stores a server) keeps the whole working set, so one
server's split pool (one store) keeps about two thirds of its share; each
prefill stage's device cache is the longest turn, rounded up to whole chunks
(about one session's history). ``--turns`` keeps the first N turns of every
session, so a run's working set is known before it starts and every side
replays exactly the same requests to the end.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.tools.replay.compare import (
    Fault,
    auto_segment_size,
    baseline_side,
    chunk_nbytes,
    parse_compare,
    prefill_queueing,
    regime,
    run_compare,
    run_side,
    side_settings,
    working_set_bytes,
    workload_prompts,
)
from kvpool.tools.replay.records import ReplayOptions
from kvpool.tools.replay.report import json_safe
from kvpool.tools.replay.topology import TopologySettings
from kvpool.tools.replay.workload import ReplayWorkload, load_workload
from kvpool.sizes import format_size, parse_size

FIND_LOAD_START = 8  # the load finder's first step, in sessions, without --sessions
FIND_LOAD_RULE = ("the baseline side alone, every session at once, the sessions doubled a step until its median "
                  "wait in front of prefill (the router's queue, stage 0's gate and its wait for device blocks) is at "
                  "least its median prefill service time (stage 0's pipeline compute), or the steps end")
SUMMARY_KEYS = ("prompt_tok_s", "reuse_ratio", "device_share", "pool_share", "computed_share", "ttft_p50_s",
                "turns_sent", "errors", "wall_s", "pool_evicted_groups", "restore_bytes", "cross_server_handoff_share",
                "session_moves", "prefill_gate_wait_p50_s", "router_queue_wait_p50_s", "prefill_compute_p50_s")


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("comparisons (--compare): K logical servers, started fresh for every side and level")
    g.add_argument("--compare", metavar="WHAT=A,B",
                   help="pool=shared,split (one pool over every store against one per server, the split side "
                   "twice: split-moving, the router's own session affinity, where a session moves off a pipeline "
                   "with a long queue, and split-strict, where a session's turns always wait for its home server; "
                   "name one of them instead of split to run only it) or groups=on,off "
                   "(whole-group against per-object eviction) or locality=on,off (the router prefers the decode "
                   "shard on the pipeline's server, or not) or sched=fifo,session (the router's admission queue and "
                   "stage 0's gate work-aware, and the clients' session hints, or neither); the same sessions on "
                   "each side")
    g.add_argument("--servers", type=int, default=2, help="logical servers: each a pipeline, a decode shard and "
                   "two stores (prefill side, decode side) (default 2)")
    g.add_argument("--turns", type=int, help="keep the first N turns of every weka session, with or without "
                   "--compare (default: all)")
    g.add_argument("--store-size", metavar="SIZE", help="each store's DRAM (default, pool: the shared pool holds "
                   "the working set and one server's split pool about 2/3 of its share, the seed's regime; groups: "
                   "the shared pool holds 3/5 of it, eviction pressure)")
    g.add_argument("--link-gbit", type=float, default=10.0, help="each server's link, shaped with tc, each way "
                   "(namespaces only; default 10)")
    g.add_argument("--sched-slots", type=int, default=None, metavar="N",
                   help="sched=: stage 0's gate on both sides, N prefills through the stages at once, the others "
                   "waiting in arrival order (fifo) or least work first (session); 0: no gate on either side, "
                   "every admitted prefill at once (default: one a stage, at least 2, as stage 0's own default "
                   "under --sched session)")
    g.add_argument("--sched-max-wait-s", type=float, default=0.0, metavar="S",
                   help="sched=: the session side's aging bound, at stage 0's gate and the router's queue (a "
                   "request waiting S goes first; default: theirs, 4 s, chosen in the simulator for the seed's "
                   "GPUs: scale it with the turn's service time)")
    g.add_argument("--sched-max-bypass-s", type=float, metavar="S",
                   help="sched=: the session side's bypass budget, at stage 0's gate and the router's queue: later "
                   "requests may overtake a waiting one by S seconds of estimated work in all, so it waits at most "
                   "what arrival order would make it wait plus S (default: theirs, no budget). Seconds of this host's "
                   "compute: the estimates are scaled by each stage 0's measured speed (kvpool_prefill_work_scale)")
    g.add_argument("--sched-reorder-below-s", type=float, metavar="S",
                   help="sched=: the session side's backlog gate, at stage 0's gate and the router's queue: while S "
                   "seconds of estimated work wait, requests go in arrival order (default: theirs, none). Seconds of "
                   "this host's compute, as for --sched-max-bypass-s")
    g.add_argument("--sides-at-once", action="store_true",
                   help="run every side's cluster and replay at the same time (not with --kill-server): on a "
                   "shared host a load that moves then moves for every side, where one after the other it does not")
    g.add_argument("--find-load", action=argparse.BooleanOptionalAction, default=None,
                   help="find a load where the baseline side's prefill queues (sched: fifo; pool: split; groups, "
                   "locality: off) before comparing: that side alone, every session at once, from --sessions "
                   f"(default {FIND_LOAD_START}) doubling up to --find-load-max-sessions, until its median wait in "
                   "front of prefill (the router's queue, stage 0's gate, its wait for device blocks) reaches its "
                   "median prefill service time; then every side at that load, the baseline's step reused. Reports "
                   "the load chosen and every step (JSON: load). Default: on for sched= unless --concurrency (a "
                   "load of your own: --sessions and --concurrency as given) or --kill-server is given, off "
                   "otherwise; not with --concurrency or --kill-server")
    g.add_argument("--find-load-max-sessions", type=int, default=64, metavar="N",
                   help="--find-load's last step, in sessions (default 64; the trace may hold fewer)")
    g.add_argument("--loopback", action="store_true", help="no network namespaces even where they work")
    g.add_argument("--kill-server", type=int, metavar="N", help="kill every process of server N ... ")
    g.add_argument("--at", type=float, metavar="S", help="... S seconds into each replay")


def load_compare_workload(args: argparse.Namespace, vocab_size: int, context: int,
                          sessions: int | None = None) -> ReplayWorkload:
    """The first ``sessions`` weka sessions (None: ``--sessions``), each cut to its first ``--turns`` turns
    before its timelines are built."""
    return load_workload(args.trace, scale=args.scale, vocab_size=vocab_size, context=context,
                         max_tokens=args.max_tokens, sessions=sessions or args.sessions,
                         shared_prefix=args.shared_prefix, turns=args.turns)


def _check(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    try:
        what, sides = parse_compare(args.compare)
    except ValueError as exc:
        raise SystemExit(f"kvpool replay: {exc}") from None
    if args.url:
        raise SystemExit("kvpool replay: --compare starts its own servers; drop --url")
    if args.servers < 1:
        raise SystemExit(f"kvpool replay: --servers: must be >= 1, got {args.servers}")
    if (args.kill_server is None) != (args.at is None):
        raise SystemExit("kvpool replay: --kill-server N and --at S go together")
    if args.kill_server is not None and not 0 <= args.kill_server < args.servers:
        raise SystemExit(f"kvpool replay: --kill-server: no server {args.kill_server} of {args.servers}")
    if args.sched_max_wait_s < 0:
        raise SystemExit(f"kvpool replay: --sched-max-wait-s: must be >= 0, got {args.sched_max_wait_s}")
    if args.sched_max_bypass_s is not None and not args.sched_max_bypass_s >= 0:
        raise SystemExit(f"kvpool replay: --sched-max-bypass-s: must be >= 0, got {args.sched_max_bypass_s}")
    if args.sched_reorder_below_s is not None and not args.sched_reorder_below_s > 0:
        raise SystemExit(f"kvpool replay: --sched-reorder-below-s: must be positive, got {args.sched_reorder_below_s}")
    if args.sched_slots is not None and args.sched_slots < 0:
        raise SystemExit(f"kvpool replay: --sched-slots: must be >= 0, got {args.sched_slots}")
    if args.find_load and args.concurrency is not None:
        raise SystemExit("kvpool replay: --find-load sets the concurrency (every session at once): drop --concurrency "
                         "or give --no-find-load")
    if args.find_load and args.kill_server is not None:
        raise SystemExit("kvpool replay: --find-load: not with --kill-server")
    if args.find_load_max_sessions < 1:
        raise SystemExit(f"kvpool replay: --find-load-max-sessions: must be >= 1, got {args.find_load_max_sessions}")
    if find_load_on(args, what) and args.sessions is not None and args.sessions > args.find_load_max_sessions:
        raise SystemExit(f"kvpool replay: --find-load-max-sessions: {args.find_load_max_sessions} is below "
                         f"--sessions {args.sessions}, the first step")
    if args.turns is not None and args.turns < 1:
        raise SystemExit(f"kvpool replay: --turns: must be >= 1, got {args.turns}")
    if str(args.trace).endswith(".jsonl"):
        raise SystemExit("kvpool replay: --compare replays weka sessions (a folder or a trace_*.json)")
    return what, sides


def sched_slots(args: argparse.Namespace) -> int:
    """Stage 0's gate on both sides: ``--sched-slots``, else one a stage (at least 2), stage 0's own default."""
    return max(2, args.stages) if args.sched_slots is None else args.sched_slots


def base_settings(args: argparse.Namespace, what: str, segment: str, device_tokens: int) -> TopologySettings:
    """Every side's shape before its own change (``side_settings``); the sched= flags only for sched=."""
    sched = what == "sched"
    return TopologySettings(servers=args.servers, stages=args.stages, segment_size=segment,
                            device_cache_tokens=device_tokens, kv_dtype=args.kv_dtype, netns=not args.loopback,
                            link_gbit=args.link_gbit, log_level=args.log_level,
                            decode_args=("--num-pages", str(args.decode_pages)) if args.decode_pages else (),
                            sched_slots=sched_slots(args) if sched else -1,
                            sched_max_wait_s=args.sched_max_wait_s if sched else 0.0,
                            sched_max_bypass_s=args.sched_max_bypass_s if sched else None,
                            sched_reorder_below_s=args.sched_reorder_below_s if sched else None)


@dataclass(slots=True)
class Plan:
    """One load's run: the workload of its first sessions, its sizes, every side's shape before its change."""

    workload: ReplayWorkload
    base: TopologySettings
    planned: dict[str, Any]
    segment: str
    device_tokens: int


def plan(args: argparse.Namespace, what: str, sessions: int | None) -> Plan:
    """The first ``sessions`` sessions (None: ``--sessions``), the sizes for them (``--store-size`` and
    ``--device-cache-tokens``, else the regime's defaults) and the base settings."""
    from kvpool.model.config import CONFIGS

    config = CONFIGS["tiny"]
    workload = load_compare_workload(args, config.vocab_size, config.max_position_embeddings, sessions)
    if not workload.sessions:
        raise SystemExit("kvpool replay: no turn fits the model's context")
    chunk = args.chunk_size
    device_tokens = args.device_cache_tokens or -(-workload.longest_prompt // chunk) * chunk
    if workload.longest_prompt > device_tokens // chunk * chunk:
        raise SystemExit(f"kvpool replay: the longest turn ({workload.longest_prompt} tokens) does not fit "
                         f"--device-cache-tokens {device_tokens}")
    working_set = working_set_bytes(workload_prompts(workload), chunk, chunk_nbytes("tiny", args.kv_dtype, chunk))
    # groups: a pool smaller than the working set, or nothing is ever evicted
    auto = auto_segment_size(working_set if what == "pool" else working_set * 0.6 / 1.15, args.servers)
    segment = args.store_size or f"{auto >> 20}MiB"
    return Plan(workload, base_settings(args, what, segment, device_tokens),
                regime(working_set, parse_size(segment), args.servers), segment, device_tokens)


def find_load_on(args: argparse.Namespace, what: str) -> bool:
    """``--find-load`` as given; unset: on for sched= unless ``--concurrency`` fixes the load or
    ``--kill-server`` is given."""
    if args.find_load is None:
        return what == "sched" and args.concurrency is None and args.kill_server is None
    return bool(args.find_load)


def load_steps(start: int, most: int) -> list[int]:
    """The sessions the load finder tries: ``start``, doubling, up to ``most`` (the last step ``most``)."""
    steps = [min(start, most)]
    while steps[-1] < most:
        steps.append(min(steps[-1] * 2, most))
    return steps


def find_load(args: argparse.Namespace, what: str, sides: tuple[str, ...],
              workdir: Path) -> tuple[Plan, dict[str, Any], dict[str, dict[str, Any]]]:
    """Step the sessions up (concurrency: every session at once) with the baseline side alone, on a fresh
    cluster a step, until its prefill queues (``prefill_queueing``) or the steps end; the plan at the load
    chosen, the steps tried, and the baseline's run there (the comparison's, not run again)."""
    baseline = baseline_side(what, sides)
    start = args.sessions or FIND_LOAD_START
    steps: list[dict[str, Any]] = []
    chosen: tuple[Plan, dict[str, Any]] | None = None
    for sessions in load_steps(start, args.find_load_max_sessions):
        step_plan = plan(args, what, sessions)
        found = len(step_plan.workload.sessions)
        if steps and found <= steps[-1]["sessions"]:
            break  # the trace has no more sessions
        options = ReplayOptions(concurrency=found, think_scale=args.think_scale, duration_s=args.duration,
                                chunk_size=args.chunk_size, progress=False,
                                session_hints=what == "sched" and baseline == "session")
        summary = run_side(side_settings(step_plan.base, what, baseline), step_plan.workload, options, None,
                           workdir / f"find-load-{baseline}-s{found}")
        summary["side"] = baseline
        queueing = prefill_queueing(summary)
        steps.append({"sessions": found, "concurrency": found, **queueing, "ttft_p50_s": summary["ttft_p50_s"],
                      "errors": summary["errors"]})
        print(f"  find-load: {what}={baseline} with {found} sessions at once: wait in front of prefill "
              f"{_fmt(queueing['prefill_wait_p50_s'])} s (median) against its service "
              f"{_fmt(queueing['prefill_service_p50_s'])} s (median): "
              f"{'queues' if queueing['queues'] else 'does not queue'}", flush=True)
        chosen = step_plan, summary
        if queueing["queues"]:
            break
    assert chosen is not None
    step_plan, summary = chosen
    load = {"rule": FIND_LOAD_RULE, "baseline": baseline, "sessions": steps[-1]["sessions"],
            "concurrency": steps[-1]["concurrency"], "queues": steps[-1]["queues"], "steps": steps}
    return step_plan, load, {baseline: summary}


def main(args: argparse.Namespace, levels: list[int]) -> int:
    """Run the comparison; print one line per side and level, then (``--json``) one JSON object."""
    what, sides = _check(args)
    finding = find_load_on(args, what)
    first = plan(args, what, args.sessions or FIND_LOAD_START if finding else None)
    workload, device_tokens = first.workload, first.device_tokens
    print(f"kvpool replay --compare {args.compare}: {len(workload.sessions)} sessions, {workload.num_turns} turns, "
          f"{workload.prompt_tokens:,} prompt tokens at --scale {args.scale}; {args.servers} servers; stores of "
          f"{format_size(parse_size(first.segment))}, device caches of {device_tokens} tokens a stage; "
          + (f"the load found from {len(workload.sessions)} sessions up to {args.find_load_max_sessions}, every "
             f"session at once" if finding else f"levels {levels}"), flush=True)
    print(f"kvpool replay: planned {first.planned['text']}", flush=True)
    fault = Fault(args.kill_server, args.at) if args.kill_server is not None else None

    def on_side(side: str, summary: dict[str, Any]) -> None:
        figures = "  ".join(f"{k}={_fmt(summary.get(k))}" for k in SUMMARY_KEYS)
        print(f"  {what}={side} c={summary['concurrency']}: {figures}", flush=True)
        print(f"    {summary['network_mode']}; link bytes in/out per server: {summary['link_bytes']}", flush=True)
        print(f"    {summary['regime']['text']}", flush=True)
        if "kill" in summary:
            print(f"    kill: {json.dumps(json_safe(summary['kill']))}", flush=True)

    # SIGTERM unwinds like Ctrl-C: every finally runs, so processes stop and namespaces go
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="kvpool-compare-") as tmp:
            workdir = Path(args.workdir) if args.workdir else Path(tmp)
            load: dict[str, Any] | None = None
            ran: dict[str, dict[str, Any]] = {}
            chosen = first
            if finding:
                chosen, load, ran = find_load(args, what, sides, workdir)
                levels = [load["concurrency"]]
                print(f"kvpool replay: the load chosen: {load['sessions']} sessions, every one at once"
                      + ("" if load["queues"] else f" (the last step: {load['baseline']}'s prefill never queued)"),
                      flush=True)
                if args.sides_at_once:
                    ran = {}  # every side again, at the same time
            options = ReplayOptions(concurrency=levels[-1], think_scale=args.think_scale, duration_s=args.duration,
                                    chunk_size=args.chunk_size, progress=False)
            out = run_compare(what, sides, chosen.base, chosen.workload, levels, options, fault, workdir,
                              on_side, at_once=args.sides_at_once, ran=ran)
    finally:
        signal.signal(signal.SIGTERM, previous)
    out["planned_regime"] = chosen.planned
    if load is not None:
        out["load"] = load
    out["sessions"] = len(chosen.workload.sessions)
    print(f"kvpool replay --compare {what}: {headline(out)}", flush=True)
    if args.json:
        print(json.dumps(json_safe(out)), flush=True)
    errors = sum(s["errors"] for s in out["sides"].values())
    return 0 if errors == 0 or fault is not None else 1


def _raise_interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def headline(out: dict[str, Any]) -> str:
    """The comparison's own figures (its top-level numbers: the ratios and each side's headline), one line."""
    figures = {k: v for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and k not in ("servers",)}
    return "  ".join(f"{k}={_fmt(v)}" for k, v in figures.items()) or "no figures (a side did not run)"


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
