"""``kvpool simulate --validate``: a few concurrent sessions in the simulator and on a local cluster, compared.

The cluster side is ``kvpool replay``'s (``kvpool.tools.up.up_cluster`` + ``kvpool.tools.replay.run_replay``):
``VALIDATION_TRACES`` (no sub-agents: one request in flight per session) at once, no think time, the tiny
model, a device cache (``DEVICE_CACHE_TOKENS``) too small for every session's history, so turns restore
from the pool, and two stores of ``SEGMENT_BYTES`` each, too small for every history, so the master evicts.
The cluster runs at log level debug and records two orders: stage 0's block events (each turn's arrival,
which touches its session's cached blocks, ``prefill_arrived``; each admission, ``prefill_admitted``; each
release of a request's blocks and of its save's, ``blocks_freed``) and the master's pool operations (each
lookup, lease release, and each stage's put start and put end, ``pool_op``, with its outcome). The
simulator applies each of those in its recorded order (``kvpool.tools.sim.validate.replay_sessions``), so
every turn's device / pool / computed tokens should be equal; the turns that differ are listed
(``mismatched_turns``), and so are the pool operations whose outcome differed (``pool_ops_differing``:
a lookup's complete groups, a put's evictions). The last JSON line ends with
``pool_tokens``, ``evictions``, ``token_counts_equal``, ``throughput_error`` and ``ttft_p50_error``. The simulator's times come from
``cost_model_cpu.toml`` (measured on this host for this cluster) unless ``--cost-model`` names another;
``--runs N`` repeats the whole comparison and reports the timing errors' median and spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

# no sub-agents, 14-33 turns each of 1-4.4K tokens at scale 16
VALIDATION_TRACES = ("trace_0002.json", "trace_0019.json", "trace_0021.json")
DURATION_S = 180.0  # every turn of the three sessions on a loaded host (71 turns took 73 s; 90 s once ran only 57)
DEVICE_CACHE_TOKENS = 4608  # 18 chunks a stage: the longest prompt (4,361 tokens) fits, three histories do not
SEGMENT_BYTES = 8 << 20  # two stores of 8 MiB: 21 groups of 4 x 196,608 B, fewer than the histories hold


def block_events(workdir: Path, session_ids: list[str]) -> list[tuple[str, str]]:
    """Stage 0's block events in its log's order (``recorded_orders``' first part)."""
    return recorded_orders(workdir, session_ids)[0]


def recorded_orders(workdir: Path, session_ids: list[str]) -> tuple[list[tuple[str, str]], list[Any]]:
    """The cluster's two recorded orders, named as the simulator names requests (``s{session index}.t{turn
    index}``): stage 0's block events and the master's pool operations, each in its own log's order.

    Block events: ("touch", id) from ``prefill_arrived`` (debug level: a turn's arrival touches its
    session's cached blocks), ("admit", id) from ``prefill_admitted``, ("free", id or "id/save") from
    ``blocks_freed``. Each session has one request in flight, so its n-th admitted request is its turn n; an
    attempt never admitted (refused before its admission and retried under another id) is no turn, and its
    events are left out. A request planned again after a lost device cache (a second attempt, the same
    request id) is admitted once; events of requests outside the sessions (none in a validation) are left out.

    Pool operations (the master's ``pool_op`` events, debug level): ((op, holder), figure), holder the
    request's name, or "name/stage" for a put (the stage from its first key, ``object_key``'s last part);
    figure: a lookup's complete groups, a release's 1 (released) or 0, a put start's groups evicted, a put
    end's objects committed.
    """
    index = {sid: k for k, sid in enumerate(session_ids)}
    stage0: list[dict[str, Any]] = []
    master: list[dict[str, Any]] = []
    for path in sorted(workdir.rglob("*")):
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            wanted = "prefill_admitted" in line or "blocks_freed" in line or "prefill_arrived" in line
            if not wanted and "pool_op" not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            (stage0 if wanted else master).append(event)
    # a session's n-th admitted request is its turn n (an attempt that never got admitted is no turn)
    names: dict[str, str] = {}
    turns = [0] * len(session_ids)
    for event in stage0:
        request_id = event.get("request_id")
        if event.get("event") == "prefill_admitted" and event.get("session_key") in index and request_id not in names:
            k = index[event["session_key"]]
            names[request_id] = f"s{k}.t{turns[k]}"
            turns[k] += 1
    seen: set[tuple[str, str]] = set()
    blocks: list[tuple[str, str]] = []
    for event in stage0:  # one stage-0 log: its lines are in the order the events happened
        kind = {"prefill_arrived": "touch", "prefill_admitted": "admit"}.get(str(event.get("event")))
        if kind is not None:
            name = names.get(event.get("request_id"))
            if name is not None and (kind, name) not in seen:
                seen.add((kind, name))
                blocks.append((kind, name))
        elif event.get("event") == "blocks_freed":
            request_id, save, _ = str(event.get("holder", "")).partition("/save")
            if request_id in names:
                blocks.append(("free", names[request_id] + ("/save" if save else "")))
    figure = {"lookup": "complete", "release": "released", "put_start": "evicted", "put_end": "items"}
    ops: list[Any] = []
    for event in master:  # one master's log: its operations in the order it served them
        op, name = event.get("op"), names.get(str(event.get("request_id")))
        if event.get("event") != "pool_op" or op not in figure or name is None:
            continue
        holder = f"{name}/{str(event.get('first_key', '')).rpartition('/')[2]}" if op.startswith("put") else name
        ops.append(((op, holder), int(event.get(figure[op], 0))))
    return blocks, ops


def turn_key(request_id: str) -> tuple[int, int]:
    """``s{k}.t{i}`` → (k, i)."""
    session, turn = request_id.split(".t")
    return int(session[1:]), int(turn)


def _real_side(traces: list[Path], setup: Any, workdir: Path, duration_s: float) -> dict[str, Any]:
    from kvpool.model import get_config
    from kvpool.tools.replay import ReplayOptions, load_workload, run_replay
    from kvpool.tools.replay.cli import _probes
    from kvpool.tools.sim.validate import TurnCounts
    from kvpool.tools.up import UpSettings, up_cluster

    config = get_config("tiny")
    loaded = [load_workload(t, scale=setup.scale, vocab_size=config.vocab_size, context=setup.context,
                            max_tokens=setup.max_tokens) for t in traces]
    if any(w.skipped_turns for w in loaded):
        raise SystemExit("kvpool simulate --validate: a validation trace lost turns to the replay's limits")
    workload = replace(loaded[0], sessions=[s for w in loaded for s in w.sessions])
    session_ids = [s.id for s in workload.sessions]
    settings = UpSettings(http_port=0, grpc_port=0, pipelines=1, stages=setup.num_stages, decode_shards=1,
                          stores=2, segment_size=f"{setup.store_bytes >> 20}MiB", device_cache_tokens=setup.device_cache_tokens,
                          workdir=str(workdir / "cluster"))
    config_path = workdir / "validate.toml"
    config_path.write_text(f"[prefill]\nchunk_size = {setup.chunk_size}\n\n[router]\nrequest_timeout_s = 600.0\n")
    # debug: stage 0's block events (info) and the master's pool_op events (debug)
    cluster = up_cluster(settings, str(config_path), "debug")
    cluster.start()
    try:
        options = ReplayOptions(concurrency=len(session_ids), think_scale=0.0, duration_s=duration_s,
                                chunk_size=setup.chunk_size)
        result = asyncio.run(run_replay(cluster.http_url, workload, options, _probes(cluster)))
    finally:
        cluster.stop()
    events, pool_ops = recorded_orders(workdir / "cluster", session_ids)
    index = {sid: k for k, sid in enumerate(session_ids)}
    turns = {(index[r.session_id], r.turn): TurnCounts(r.prompt_tokens, r.device_tokens, r.pool_tokens,
                                                      r.computed_tokens, r.ttft_s, r.completion_tokens)
             for r in result.records if r.error is None}
    return {"turns": turns, "events": events, "pool_ops": pool_ops, "wall_s": result.wall_s, "pool": result.pool or {},
            "errors": sum(r.error is not None for r in result.records)}


def compare_one(sessions: list[Any], setup: Any, cost: Any, real: dict[str, Any]) -> dict[str, Any]:
    """The simulator in the cluster's admission order against the cluster's turns."""
    from kvpool.tools.sim.metrics import percentile
    from kvpool.tools.sim.validate import replay_sessions

    real_turns = real["turns"]
    sim_turns, sim_span, sim_pool = replay_sessions(
        sessions, setup, cost, real["events"], {key: t.output_tokens for key, t in real_turns.items()},
        real.get("pool_ops", ()))
    keys = sorted(real_turns)
    mismatches = [key for key in keys if key not in sim_turns or _split(sim_turns[key]) != _split(real_turns[key])]
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
        "real_pool_tokens": sum(real_turns[k].pool_tokens for k in keys),
        "real_evictions": int(real["pool"].get("evicted_groups", -1)),
        "real_wall_s": real["wall_s"], "sim_span_s": sim_span,
        "pool_tokens": sum(sim_turns[k].pool_tokens for k in keys if k in sim_turns),
        "evictions": sim_pool["evictions"],
        "token_counts_equal": bool(keys) and not mismatches,
        "throughput_error": (sim_tput - real_tput) / real_tput if real_tput else 0.0,
        "ttft_p50_error": (sim_pool["ttft_p50_s"] - real_ttft) / real_ttft if real_ttft else 0.0,
    }


def _split(t: Any) -> tuple[int, int, int, int]:
    return (t.prompt_tokens, t.device_tokens, t.pool_tokens, t.computed_tokens)


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
    setup = ValidationSetup(context=get_config("tiny").max_position_embeddings, device_cache_tokens=DEVICE_CACHE_TOKENS,
                            store_bytes=SEGMENT_BYTES)
    cost_path = cost_model_path(args)
    cost = load_cost_model(cost_path)  # a bad file fails before the cluster starts
    sessions = [load_session(t) for t in traces]
    runs = []
    for _ in range(max(1, args.runs)):
        with tempfile.TemporaryDirectory(prefix="kvpool-validate-") as tmp:
            real = _real_side(traces, setup, Path(tmp), 30.0 if args.quick else DURATION_S)
        t0 = time.perf_counter()
        run = compare_one(sessions, setup, cost, real)
        run["sim_wall_s"] = time.perf_counter() - t0
        runs.append(run)
        print(json.dumps(run))
    last = runs[-1]
    errors = {key: [r[key] for r in runs] for key in ("throughput_error", "ttft_p50_error")}
    out = {"traces": list(VALIDATION_TRACES), "scale": setup.scale, "cost_model": Path(cost_path).name,
           "device_cache_tokens": setup.device_cache_tokens, "segment_bytes": setup.store_bytes, "runs": len(runs),
           **{k: v for k, v in last.items() if k not in _LAST},
           "num_mismatched_turns_runs": [r["num_mismatched_turns"] for r in runs],
           **{f"{key}_runs": values for key, values in errors.items()},
           **{f"{key}_spread": max(values) - min(values) for key, values in errors.items()},
           "pool_tokens": min(r["pool_tokens"] for r in runs), "evictions": min(r["evictions"] for r in runs),
           "token_counts_equal": all(r["token_counts_equal"] for r in runs),
           # the median over the runs (one run: its own)
           **{key: statistics.median(values) for key, values in errors.items()}}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0 if out["token_counts_equal"] else 1


_LAST = ("pool_tokens", "evictions", "token_counts_equal", "throughput_error", "ttft_p50_error")
