"""``kvpool bench path``: a request's way through the cluster — the handoff streamed during prefill
(``cases``: push against after-prefill, see ``path_cases``), admission under a burst, the control RPCs
before its first token, and how much of the handoff crosses servers.

Beside ``cases``, the control RPCs of one request, ``pool_hit`` and ``cold`` on 4 stages, each with
``rpcs_per_request`` (saves included, ``save_rpcs`` apart), ``critical_path_depth`` (awaited round trips before
the first token) and ``depth_beyond_stage_hops`` (less the forward chain's 3 hops), see ``path_rpcs``; and three
figures, each from one run here:

- ``queued_not_failed``: a burst of ``--requests`` concurrent long requests (8)
  against a decode receive arena that holds two of them; true when every one
  completed, none failed, and the router's metrics show requests queued.
- ``critical_path_depth``: per request, the longest chain of control RPCs before
  its first token (each after the one before it, or nested in it), from the
  interceptor trace every service writes keyed by the request id
  (``kvpool.tracing``, counted by ``path_counts``); the median over the burst, with that chain's methods
  (``critical_path``). The burst's cluster has a pool (one store), as deployed:
  its Lookup is on the path.
- ``cross_server_handoff_share``: handoff bytes that crossed servers over all
  handoff bytes, from a replay of the shared traces on two logical servers with
  locality on (and off, side by side, with ``--no-quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from kvpool import service
from kvpool.rpc import router_pb2_grpc
from kvpool.tracing import tracing_children
from kvpool.tools.bench.path_counts import critical_path
from kvpool.tools.bench.path_rpcs import generate, read_trace, run_rpcs
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster

ARENA_REGIONS = 2  # the receive arena holds this many of the burst's regions


def _metric(cluster: Cluster, name: str, sample: str) -> float:
    port = cluster.find(name).ready["admin_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample + " ")), 0.0)


async def _burst(address: str, num_requests: int, prompt_tokens: int, max_tokens: int) -> list[dict[str, Any]]:
    async with service.channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        rngs = [random.Random(i) for i in range(num_requests)]
        prompts = [[rng.randrange(1, 250) for _ in range(prompt_tokens)] for rng in rngs]
        return list(await asyncio.gather(*(generate(stub, prompt, max_tokens) for prompt in prompts)))


def burst(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The burst against an arena of two regions, on a fresh cluster (see the module doc)."""
    from kvpool.model.config import CONFIGS

    config = CONFIGS["tiny"]
    region = args.prompt_tokens * config.num_hidden_layers * config.kv_entry_dim * 4 + config.vocab_size * 4
    arena = -(-region // 4096) * 4096 * ARENA_REGIONS + 4096
    workdir.mkdir(parents=True, exist_ok=True)
    toml = workdir / "cluster.toml"
    toml.write_text(f"[router]\nmax_queue = {args.requests}\nqueue_timeout_s = 600\n")
    trace = workdir / "rpc-trace.jsonl"
    with tracing_children(trace):  # the services inherit it
        # the arena as kvpool up's flag: up passes every shard's arena as one, and flags win over the file
        # with a pool, as deployed: its Lookup (and a hit's lease and restores) are on the path
        cluster = up_cluster(UpSettings(pipelines=1, stages=args.stages, decode_shards=1, stores=1,
                                        segment_size="64MiB", http_port=0,
                                        grpc_port=0, device_cache_tokens=4 * 4096, region_arena_bytes=str(arena),
                                        workdir=str(workdir / "logs")),
                             str(toml)).start()
    try:
        queued_before = _metric(cluster, "router", "kvpool_router_queued_total")
        results = asyncio.run(_burst(f"127.0.0.1:{cluster.find('router').ready['port']}", args.requests,
                                     args.prompt_tokens, args.max_tokens))
        queued = _metric(cluster, "router", "kvpool_router_queued_total") - queued_before
        expired = _metric(cluster, "router", "kvpool_router_queue_expired_total")
    finally:
        cluster.stop()
    calls = read_trace(trace)
    paths = [critical_path(calls.get(r["request_id"], []), r["first_token_at"]) for r in results if r["first_token_at"]]
    depths = [len(path) for path in paths]
    per_request = [{"request_id": r["request_id"], "tokens": r["tokens"], "finish_reason": r["finish_reason"],
                    "error": r["error"],
                    "ttft_s": r["first_token_at"] - r["started"] if r["first_token_at"] else None,
                    "calls": sorted(c["method"].rsplit("/", 1)[-1] for c in calls.get(r["request_id"], [])
                                    if c["start"] < r["first_token_at"])}
                   for r in results]
    completed = sum(1 for r in results if r["error"] is None and r["finish_reason"] in ("stop", "length"))
    errors = sum(1 for r in results if r["error"] is not None)
    return {
        "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "arena_bytes": arena, "arena_regions": ARENA_REGIONS, "completed": completed, "errors": errors,
        "queued": int(queued), "queue_expired": int(expired),
        "queued_not_failed": completed == args.requests and errors == 0 and queued > 0,
        "critical_path_depth": statistics.median(depths) if depths else None,
        "critical_path_depths": depths,
        # the chain itself, of a request at the median depth: what the figure counts
        "critical_path": sorted(paths, key=len)[len(paths) // 2] if paths else [],
        "ttft_p50_s": statistics.median([p["ttft_s"] for p in per_request if p["ttft_s"] is not None] or [0.0]),
        "per_request": per_request,
    }


def locality(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The two-server replay of the shared traces, locality on (and off unless --quick)."""
    from kvpool.model.config import CONFIGS
    from kvpool.tools.replay.compare import run_side
    from kvpool.tools.replay.engine import ReplayOptions
    from kvpool.tools.replay.topology import TopologySettings
    from kvpool.tools.replay.workload import load_workload

    config = CONFIGS["tiny"]
    workload = load_workload(args.traces, scale=args.scale, vocab_size=config.vocab_size,
                             context=config.max_position_embeddings, max_tokens=args.replay_max_tokens,
                             sessions=args.sessions, turns=args.turns)
    device_tokens = -(-workload.longest_prompt // 256) * 256 * 2
    options = ReplayOptions(concurrency=args.concurrency, think_scale=0.0, chunk_size=256, progress=False)
    out: dict[str, Any] = {"sessions": len(workload.sessions), "turns": workload.num_turns, "scale": args.scale}
    for side in (("on",) if args.quick else ("on", "off")):
        settings = TopologySettings(servers=2, stages=2, segment_size="256MiB", device_cache_tokens=device_tokens,
                                    netns=not args.loopback, locality=side == "on")
        summary = run_side(settings, workload, options, None, workdir / f"locality-{side}")
        out[side] = {k: summary.get(k) for k in ("cross_server_handoff_share", "cross_server_handoff_bytes",
                                                 "handoff_bytes", "errors", "reuse_ratio", "trace_bound",
                                                 "trace_block_bound", "prompt_tok_s", "ttft_p50_s",
                                                 "network_mode")}
    return out


def main(args: argparse.Namespace) -> int:
    from kvpool.tools.bench.prefill_workload import default_traces_dir

    args.traces = args.traces or str(default_traces_dir())
    args.sessions = args.sessions or (4 if args.quick else 8)
    args.turns = args.turns or (6 if args.quick else 10)
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-path-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {}
        if not args.skip_cases:
            from kvpool.tools.bench.path_cases import run_cases

            result["cases"] = run_cases(args, workdir / "cases")
        if args.cases_only:
            if args.json:
                print(json.dumps(result, default=str))
            else:
                print(json.dumps(result, indent=1, default=str))
            return 0 if all(result["cases"]["targets"].values()) else 1
        result |= run_rpcs(workdir / "rpcs")  # pool_hit and cold, on 4 stages
        result["burst"] = burst(args, workdir / "burst")
        if not args.skip_replay:
            result["locality"] = locality(args, workdir / "replay")
    b = result["burst"]
    result["queued_not_failed"] = b["queued_not_failed"]
    result["critical_path_depth"] = b["critical_path_depth"]
    if "locality" in result:
        result["cross_server_handoff_share"] = result["locality"]["on"]["cross_server_handoff_share"]
    if args.json:
        print(json.dumps(result, default=str))
    else:
        if "cases" in result:
            print(f"cases: {json.dumps(result['cases'], default=str)}")
        print(f"burst: {b['completed']}/{b['requests']} completed, {b['errors']} errors, {b['queued']} queued "
              f"(arena holds {b['arena_regions']}); queued_not_failed={b['queued_not_failed']}")
        print(f"critical_path_depth (median) {b['critical_path_depth']}: {' > '.join(b['critical_path'])}")
        for name in ("pool_hit", "cold"):
            row = result[name]
            print(f"{name} ({row['stages']} stages): rpcs_per_request={row.get('rpcs_per_request')} "
                  f"(save_rpcs={row.get('save_rpcs')}) critical_path_depth={row.get('critical_path_depth')} "
                  f"depth_beyond_stage_hops={row.get('depth_beyond_stage_hops')} errors={row['errors']}")
        if "locality" in result:
            for side in ("on", "off"):
                if side in result["locality"]:
                    row = result["locality"][side]
                    print(f"locality {side}: cross_server_handoff_share={row['cross_server_handoff_share']} "
                          f"errors={row['errors']} reuse={row['reuse_ratio']} bound={row['trace_bound']}")
    counted = all(result[name]["errors"] == 0 and result[name].get("critical_path_depth")
                  for name in ("pool_hit", "cold"))
    return 0 if b["queued_not_failed"] and counted else 1
