"""``kvpool simulate --validate``: a few concurrent sessions on a local cluster and in the simulator, compared.

The cluster (``kvpool replay``'s: ``up_cluster`` + ``run_replay``) plays ``VALIDATION_TRACES`` at once, no
think time, the tiny model, a device cache too small for every history (turns restore from the pool) and two
stores too small for every history (the master evicts). It records what each request saw
(``kvpool.request_record``; no log is read): the router's and stage 0's driver effects, each turn's arrival,
and the master's pool operations with their outcomes. The simulator replays the sessions in those orders
(``validate.replay_sessions``), running the same drivers: every turn's device / pool / computed tokens
(``token_counts_equal``, ``mismatched_turns``), every request's effects, the router's and stage 0's, one by
one (``effects_equal``, ``effects_differing``, ``router_effects_differing``) and the pool operations' outcomes
(``pool_ops_differing``) should be equal. Times come from ``cost_model_cpu.toml`` unless ``--cost-model``;
``--runs N`` repeats the comparison and reports the timing errors' median and spread.

``--validate-mode`` (``MODES``): ``ungated`` (stage 0 admits each turn on arrival, as the cluster's default
FIFO stage 0 does); ``gated`` (stage 0's gate on both sides: one prefill at a time in FIFO order, the head's
and the waiters' sessions touched in serving order when the gate hands it stage 0); ``long`` (gated, at token
scale 4: prompts of 3.9-17.4K tokens on a device cache and a pool that each hold one history, not three).
Gated, the order of arrivals, the places where the gate handed stage 0 a request, the releases of blocks
and the master's operations come from the record (not the forwards' commits: one prefill at a time, they
never race); which request it hands, the serving order it touches, and every admission, lookup, save and
eviction are the simulator's own (the core's). Device cache evictions are reported on both sides (``device_evictions``,
``real_device_evictions``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpool.request_record import effects_by_request, read_records, recording_children

# no sub-agents, 14-33 turns each of 1-4.4K tokens at scale 16
VALIDATION_TRACES = ("trace_0002.json", "trace_0019.json", "trace_0021.json")
DURATION_S = 180.0  # every turn of the three sessions on a loaded host (71 turns took 73 s; 90 s once ran only 57)
DEVICE_CACHE_TOKENS = 4608  # 18 chunks a stage: the longest prompt (4,361 tokens) fits, three histories do not
SEGMENT_BYTES = 8 << 20  # two stores of 8 MiB: 21 groups of 4 x 196,608 B, fewer than the histories hold
LEASE_S = 600.0  # the master's read lease (its default, 5 s, expired under restores of 17K-token prompts here)


@dataclass(frozen=True, slots=True)
class Mode:
    """``--validate-mode``: the sessions' token scale, the cluster's sizes, whether stage 0 is gated (one
    prefill at a time, FIFO: ``--sched fifo --sched-slots 1``, so its gate touches the waiters' sessions in
    serving order), the replay's seconds (``--quick``'s)."""

    scale: int = 16
    device_cache_tokens: int = DEVICE_CACHE_TOKENS
    segment_bytes: int = SEGMENT_BYTES
    gated: bool = False
    duration_s: float = DURATION_S
    quick_s: float = 30.0


MODES = {
    "ungated": Mode(),
    "gated": Mode(gated=True),
    # scale 4: prompts of 3.9-17.4K tokens; 72 chunks a stage hold the longest prompt (69), not three histories;
    # two stores of 32 MiB hold 85 groups, one history (69 at most) but not three
    "long": Mode(scale=4, device_cache_tokens=18432, segment_bytes=32 << 20, gated=True, duration_s=300.0,
                 quick_s=120.0),
}


Effects = dict[str, list[dict[str, Any]]]


def recorded_orders(records: list[dict[str, Any]], session_ids: list[str], gated: bool = False
                    ) -> tuple[list[tuple[str, str]], list[Any], Effects, Effects]:
    """What the cluster recorded, requests named as the simulator names them (``s{session}.t{turn}``: a
    session's n-th admitted request is its turn n; other records are left out): stage 0's block events in
    their order (a turn's "touch" on arrival, its first "admit" (``gated``: where the gate handed it stage 0,
    its first effect, which may be a wait for blocks), its "commit" once its forward's chunks became
    cached (not ``gated``: one prefill at a time, no two forwards' commits race), a "free" of each holder a
    ``Freed`` names), the master's operations in theirs (``((op, holder),
    figure)``: a lookup's complete groups, a release's 1 or 0, a put start's evictions, a put end's commits;
    a put's holder is "name/stage"), and each request's stage 0 and router effects."""
    index = {sid: k for k, sid in enumerate(session_ids)}
    stage0 = [r for r in records if r.get("source") == "stage0"]
    names: dict[str, str] = {}
    turns = [0] * len(session_ids)
    for record in stage0:
        request_id = str(record.get("request_id"))
        if (record.get("effect") == "Admitted" and record.get("session_key") in index
                and request_id not in names):
            k = index[str(record["session_key"])]
            names[request_id] = f"s{k}.t{turns[k]}"
            turns[k] += 1
    seen: set[tuple[str, str]] = set()
    blocks: list[tuple[str, str]] = []
    for record in stage0:  # one stage 0: its records are in the order things happened there
        name = names.get(str(record.get("request_id")))
        if name is None:
            continue
        handed = gated and record.get("kind") == "effect" and ("admit", name) not in seen
        kind = ("touch" if record.get("kind") == "touch" else "admit" if record.get("effect") == "Admitted" or handed
                else "commit" if record.get("effect") == "Prefilled" and not gated else None)
        if kind is not None and (kind, name) not in seen:
            seen.add((kind, name))
            blocks.append((kind, name))
        for holder in record.get("holders", ()) if record.get("effect") == "Freed" else ():
            request_id, save, _ = str(holder).partition("/save")
            if request_id in names:
                blocks.append(("free", names[request_id] + ("/save" if save else "")))
    figure = {"lookup": "complete", "release": "released", "put_start": "evicted", "put_end": "items"}
    ops: list[Any] = []
    for record in records:  # one master: its operations in the order it served them
        op, name = record.get("op"), names.get(str(record.get("request_id")))
        if record.get("source") != "master" or op not in figure or name is None:
            continue
        holder = f"{name}/{str(record.get('first_key', '')).rpartition('/')[2]}" if op.startswith("put") else name
        ops.append(((op, holder), int(record.get(figure[op], 0))))
    stage0_effects, router = ({names[i]: e for i, e in effects_by_request(records, source).items() if i in names}
                              for source in ("stage0", "router"))  # one router: each request's in its order
    return blocks, ops, stage0_effects, router


def cluster_config(chunk_size: int, gated: bool) -> str:
    """The validation cluster's TOML: its chunk, stage 0's gate when ``gated`` (one prefill at a time, in arrival
    order), and leases as long as the run (the simulated pool's never expire: an expiry is the cluster's clock,
    not an order)."""
    gate = 'sched = "fifo"\nsched_slots = 1\n' if gated else ""
    return (f"[prefill]\nchunk_size = {chunk_size}\n{gate}\n[router]\nrequest_timeout_s = 600.0\n\n"
            f"[master]\nlease_s = {LEASE_S}\n")


def _real_side(traces: list[Path], setup: Any, workdir: Path, duration_s: float, gated: bool = False,
               keep: str | None = None) -> dict[str, Any]:
    from kvpool.model import get_config
    from kvpool.tools.replay import ReplayOptions, load_workload
    from kvpool.tools.replay.cli import replay_on_new_cluster
    from kvpool.tools.sim.validate import TurnCounts
    from kvpool.tools.up import UpSettings

    config = get_config("tiny")
    loaded = [load_workload(t, scale=setup.scale, vocab_size=config.vocab_size, context=setup.context,
                            max_tokens=setup.max_tokens) for t in traces]
    if any(w.skipped_turns for w in loaded):
        raise SystemExit("kvpool simulate --validate: a validation trace lost turns to the replay's limits")
    workload = replace(loaded[0], sessions=[s for w in loaded for s in w.sessions])
    session_ids = [s.id for s in workload.sessions]
    settings = UpSettings(http_port=0, grpc_port=0, pipelines=1, stages=setup.num_stages, decode_shards=1,
                          stores=2, segment_size=f"{setup.store_bytes >> 20}MiB",
                          device_cache_tokens=setup.device_cache_tokens, workdir=str(workdir / "cluster"))
    config_path = workdir / "validate.toml"
    config_path.write_text(cluster_config(setup.chunk_size, gated))
    options = ReplayOptions(concurrency=len(session_ids), think_scale=0.0, duration_s=duration_s,
                            chunk_size=setup.chunk_size)
    records = workdir / "requests.jsonl"
    with recording_children(records):  # what each request saw, the router's, stage 0's and the master's
        result = replay_on_new_cluster(settings, config_path, workload, options)
    if keep:
        shutil.copyfile(records, keep)
    recorded = read_records(records)
    events, pool_ops, effects, router_effects = recorded_orders(recorded, session_ids, gated)
    index = {sid: k for k, sid in enumerate(session_ids)}
    turns = {(index[r.session_id], r.turn): TurnCounts(r.prompt_tokens, r.device_tokens, r.pool_tokens,
                                                      r.computed_tokens, r.ttft_s, r.completion_tokens)
             for r in result.records if r.error is None}
    return {"turns": turns, "events": events, "pool_ops": pool_ops, "effects": effects,
            "router_effects": router_effects, "wall_s": result.wall_s,
            "pool": result.pool or {}, "device_evictions": device_evictions(recorded),
            "errors": sum(r.error is not None for r in result.records)}


def device_evictions(records: list[dict[str, Any]]) -> int:
    """Stage 0's device cache evictions, as of its last admission (-1: not recorded)."""
    return max((int(r.get("evicted", 0)) for r in records if r.get("source") == "stage0" and r.get("kind") == "blocks"),
               default=-1)


def compare_one(sessions: list[Any], setup: Any, cost: Any, real: dict[str, Any], gated: bool = False
                ) -> dict[str, Any]:
    """The simulator in the cluster's admission order against the cluster's turns."""
    from kvpool.tools.sim.metrics import percentile
    from kvpool.tools.sim.validate import differing_effects, replay_sessions

    real_turns = real["turns"]
    sim_turns, sim_span, sim_pool = replay_sessions(
        sessions, setup, cost, real["events"], {key: t.output_tokens for key, t in real_turns.items()},
        real.get("pool_ops", ()), gated)
    keys = sorted(real_turns)
    mismatches = [key for key in keys if sim_turns.get(key) != real_turns[key]]  # (the split: TurnCounts' ==)
    real_effects, real_router = real.get("effects", {}), real.get("router_effects", {})
    differing = differing_effects(sim_pool["effects"], real_effects)
    router_differing = differing_effects(sim_pool["router_effects"], real_router, list)
    # throughput: prompt tokens of the turns both sides ran over each side's span
    prompt = sum(real_turns[k].prompt_tokens for k in keys)
    sim_tput, real_tput = prompt / sim_span if sim_span else 0.0, prompt / real["wall_s"] if real["wall_s"] else 0.0
    real_ttft = percentile([real_turns[k].ttft_s for k in keys], 50)
    return {
        "turns_compared": len(keys), "turns_admitted": sum(kind == "admit" for kind, _ in real["events"]),
        "events_not_followed": sim_pool["events_left"], "pool_ops_followed": len(real.get("pool_ops", ())),
        "pool_ops_not_followed": sim_pool["pool_ops_left"], "orders_stopped_at": sim_pool["stopped_at"],
        "pool_ops_differing": [list(op) for op in sim_pool["pool_ops_differing"][:10]],
        "num_pool_ops_differing": len(sim_pool["pool_ops_differing"]), "real_errors": real["errors"],
        "num_mismatched_turns": len(mismatches), "mismatched_turns": [list(k) for k in mismatches[:10]],
        "requests_effects_compared": len(real_effects), "num_effects_differing": len(differing),
        "effects_differing": differing[:10], "router_effects_compared": len(real_router),
        "num_router_effects_differing": len(router_differing), "router_effects_differing": router_differing[:10],
        "real_pool_tokens": sum(real_turns[k].pool_tokens for k in keys),
        "real_evictions": int(real["pool"].get("evicted_groups", -1)),
        "real_wall_s": real["wall_s"], "sim_span_s": sim_span,
        "pool_tokens": sum(sim_turns[k].pool_tokens for k in keys if k in sim_turns),
        "evictions": sim_pool["evictions"],
        "real_device_evictions": real.get("device_evictions", -1), "device_evictions": sim_pool["device_evictions"],
        "effects_equal": bool(real_effects) and not differing and bool(real_router) and not router_differing,
        "token_counts_equal": bool(keys) and not mismatches,
        "throughput_error": (sim_tput - real_tput) / real_tput if real_tput else 0.0,
        "ttft_p50_error": (sim_pool["ttft_p50_s"] - real_ttft) / real_ttft if real_ttft else 0.0,
    }


def main(args: argparse.Namespace) -> int:
    from kvpool.model import get_config
    from kvpool.tools.sim.cost_model import cost_model_path, load_cost_model
    from kvpool.tools.sim.validate import ValidationSetup
    from kvpool.workload.weka import load_session

    traces = [Path(args.traces) / name for name in VALIDATION_TRACES]
    missing = [str(t) for t in traces if not t.is_file()]
    if missing:
        print(f"kvpool simulate --validate: no {', '.join(missing)} (give --traces)")
        return 2
    name = getattr(args, "validate_mode", None) or "ungated"
    mode = MODES[name]
    setup = ValidationSetup(scale=mode.scale, context=get_config("tiny").max_position_embeddings,
                            device_cache_tokens=mode.device_cache_tokens, store_bytes=mode.segment_bytes)
    cost_path = cost_model_path(args)
    cost = load_cost_model(cost_path)  # a bad file fails before the cluster starts
    sessions = [load_session(t) for t in traces]
    runs = []
    for _ in range(max(1, args.runs)):
        with tempfile.TemporaryDirectory(prefix="kvpool-validate-") as tmp:
            real = _real_side(traces, setup, Path(tmp), mode.quick_s if args.quick else mode.duration_s, mode.gated,
                              getattr(args, "validate_records", None))
        t0 = time.perf_counter()
        run = compare_one(sessions, setup, cost, real, mode.gated)
        run["sim_wall_s"] = time.perf_counter() - t0
        runs.append(run)
        print(json.dumps(run), file=sys.stderr)  # each run as it ends; stdout holds one document, the summary
    last = runs[-1]
    errors = {key: [r[key] for r in runs] for key in ("throughput_error", "ttft_p50_error")}
    out = {"mode": name, "gated": mode.gated, "traces": list(VALIDATION_TRACES), "scale": setup.scale,
           "cost_model": Path(cost_path).name,
           "device_cache_tokens": setup.device_cache_tokens, "segment_bytes": setup.store_bytes, "runs": len(runs),
           **{k: v for k, v in last.items() if k not in _LAST},
           "num_mismatched_turns_runs": [r["num_mismatched_turns"] for r in runs],
           **{f"{key}_runs": values for key, values in errors.items()},
           **{f"{key}_spread": max(values) - min(values) for key, values in errors.items()},
           "pool_tokens": min(r["pool_tokens"] for r in runs), "evictions": min(r["evictions"] for r in runs),
           "effects_equal": all(r["effects_equal"] for r in runs),
           "token_counts_equal": all(r["token_counts_equal"] for r in runs),
           # the median over the runs (one run: its own)
           **{key: statistics.median(values) for key, values in errors.items()}}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0 if out["token_counts_equal"] and out["effects_equal"] else 1


_LAST = ("pool_tokens", "evictions", "effects_equal", "token_counts_equal", "throughput_error", "ttft_p50_error")
