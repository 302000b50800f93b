"""``kvpool replay``: replay real coding-agent sessions through a whole cluster and report what it served.

By default each concurrency level gets a FRESH cluster (``kvpool.tools.up.up_cluster``
sized by the flags; decode and router settings go through a generated TOML
``--config``), so a level never starts on the previous level's warm caches;
``--url`` targets a running router instead (all levels on it, figures from its
``/metrics`` only). Before anything starts, the longest turn at ``--scale``
must fit ``--device-cache-tokens``. The library is ``kvpool.tools.replay``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvpool.tools.bench.prefill_workload import default_traces_dir
from kvpool.tools.command_flags import add_report_flags
from kvpool.tools.replay import (
    ClusterProbes,
    DeviceCacheTooSmall,
    ReplayOptions,
    ReplayResult,
    ReplayWorkload,
    check_device_cache,
    load_workload,
    run_replay,
)
from kvpool.tools.replay.report import format_table, json_safe

DEFAULT_TRACES = default_traces_dir()


def add_replay_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay", help="replay real coding-agent sessions through a whole cluster's HTTP API",
        description="Replay weka-format coding-agent sessions (subagents run beside their parent at their own "
        "times) or a Mooncake JSONL arrival stream as a closed loop of concurrent sessions through the router's "
        "OpenAI-compatible HTTP API, on a cluster it starts per concurrency level (or --url). Reports throughput, "
        "reuse next to the trace's bounds, device/pool/computed shares, TTFT and inter-token latency, restore, "
        "handoff, pool and decode figures.")
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACES),
                   help="a weka session file or folder, or a Mooncake .jsonl (default ../shared/traces/agentx-weka)")
    p.add_argument("--url", help="a running router's HTTP URL; no cluster is started")
    p.add_argument("--master", default="", help="with --url: the pool master's gRPC address, for pool occupancy")
    p.add_argument("--concurrency", help="concurrent sessions; a list such as 8,16,32 runs each level (default 4; "
                   "--compare sched= finds its own unless given, see --find-load)")
    p.add_argument("--sessions", type=int, help="replay the first N sessions (Mooncake: the first N requests)")
    p.add_argument("--duration", type=float, help="stop issuing requests after this many seconds (per level)")
    p.add_argument("--scale", type=int, default=16, help="token scale: a 64-token block becomes 64/S tokens")
    p.add_argument("--think-scale", type=float, default=1.0, help="multiply think times (and Mooncake arrival "
                   "times) by this; 0: none")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on each turn's scaled output tokens")
    p.add_argument("--shared-prefix", action="store_true", help="prepend a prefix common to all sessions, "
                   "system_tokens + tool_tokens long, scaled (weka only)")
    add_report_flags(p)
    p.add_argument("--plot", metavar="DIR", help="write PNG charts here")
    cluster = p.add_argument_group("the cluster it starts (ignored with --url, except the cache check)")
    cluster.add_argument("--pipelines", type=int, default=1, help="prefill pipelines")
    cluster.add_argument("--stages", type=int, default=4, help="stages per pipeline")
    cluster.add_argument("--decode-shards", type=int, default=1, help="decode shards")
    cluster.add_argument("--stores", type=int, default=2, help="store daemons (0: no pool)")
    cluster.add_argument("--segment-size", default="512MiB", help="DRAM each store gives the pool")
    cluster.add_argument("--master-standbys", type=int, default=0, metavar="N",
                         help="pool master standbys, the leader elected through an etcd in the workdir (kvpool up "
                         "--master-standbys); with --chaos, kill:master kills the first candidate, the leader")
    cluster.add_argument("--device-cache-tokens", type=int, help="each prefill stage's device KV capacity in tokens "
                         "(default 32768; with --url only checked when given)")
    cluster.add_argument("--decode-pages", type=int, help="KV pages of each decode shard (default: from its kv_bytes)")
    cluster.add_argument("--chunk-size", type=int, default=256, help="the prefill chunk size (and the bound's)")
    cluster.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16", "float8_e4m3fn"))
    cluster.add_argument("--workdir", help="keep the cluster's logs here")
    p.add_argument("--chaos", metavar="SPEC", help="run the sessions twice on a supervised cluster, clean then "
                   "with these faults, and report what each cost, e.g. kill:store0@30s,kill:master@60s,"
                   "kill:p1-stage2@90s,kill:decode1@120s,slow:store1=200ms@150s,corrupt:store0@180s "
                   "(kvpool.tools.replay.chaos)")
    from kvpool.tools.replay.compare_cmd import add_compare_arguments

    add_compare_arguments(p)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"kvpool replay: --concurrency: expected numbers such as 8,16,32, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise SystemExit(f"kvpool replay: --concurrency: every level must be >= 1, got {text!r}")
    return levels


def write_config(path: Path, args: argparse.Namespace) -> Path:
    """The generated ``--config``: [prefill] chunk size, [decode] pages, [router] limits."""
    lines = ["[prefill]", f"chunk_size = {args.chunk_size}", "", "[decode]"]
    if args.decode_pages:
        lines.append(f"num_pages = {args.decode_pages}")
    lines += ["", "[router]", "request_timeout_s = 600.0", ""]
    path.write_text("\n".join(lines))
    return path


def _probes(cluster: Any) -> ClusterProbes:
    host = cluster.topology.host

    def root(proc: Any) -> str:
        return f"http://{host}:{proc.ready['admin_port']}"

    master = next((p for p in cluster.services if p.name == "master"), None)
    return ClusterProbes(
        router=root(cluster.find("router")),
        stages={p.name: root(p) for p in cluster.services if "-stage" in p.name},
        decode={p.name: root(p) for p in cluster.services if p.name.startswith("decode")},
        # with standbys, the leader wherever etcd announces it
        master=(cluster.master_address if cluster.etcd is not None else f"{host}:{master.ready['port']}")
        if master else "")


def _run_level(args: argparse.Namespace, workload: ReplayWorkload, options: ReplayOptions,
               device_cache_tokens: int, workdir: Path) -> ReplayResult:
    if args.url:
        probes = ClusterProbes(router=args.url.rstrip("/"), master=args.master)
        return asyncio.run(run_replay(args.url, workload, options, probes))
    from kvpool.tools.up import UpSettings

    settings = UpSettings(http_port=0, grpc_port=0, pipelines=args.pipelines, stages=args.stages,
                          decode_shards=args.decode_shards, stores=args.stores, segment_size=args.segment_size,
                          master_standbys=args.master_standbys,
                          kv_dtype=args.kv_dtype, device_cache_tokens=device_cache_tokens,
                          workdir=str(workdir / f"c{options.concurrency}"))
    config = write_config(workdir / f"replay-c{options.concurrency}.toml", args)
    return replay_on_new_cluster(settings, config, workload, options, args.log_level)


def replay_on_new_cluster(settings: Any, config: Path, workload: ReplayWorkload, options: ReplayOptions,
                          log_level: str = "warning") -> ReplayResult:
    """``workload`` on a fresh local cluster (``up_cluster(settings)`` with ``config``), stopped however the
    replay ended."""
    from kvpool.tools.up import up_cluster

    cluster = up_cluster(settings, str(config), log_level)
    cluster.start()
    try:
        return asyncio.run(run_replay(cluster.http_url, workload, options, _probes(cluster)))
    finally:
        cluster.stop()


def main(args: argparse.Namespace) -> int:
    from kvpool.tools.cluster import ServiceFailed
    from kvpool.model import get_config

    levels = _levels(args.concurrency or "4")
    faults = _chaos_faults(args) if args.chaos else None  # a bad SPEC stops here, before any process
    if args.compare:
        from kvpool.tools.replay.compare_cmd import main as compare

        return compare(args, levels)
    config = get_config("tiny")  # the cluster's model; with --url the router's /v1/models decides the name
    device_cache_tokens = args.device_cache_tokens or 32768
    try:
        workload = load_workload(args.trace, scale=args.scale, vocab_size=config.vocab_size,
                                 context=config.max_position_embeddings, max_tokens=args.max_tokens,
                                 sessions=args.sessions, shared_prefix=args.shared_prefix,
                                 turns=getattr(args, "turns", None))
        if not args.url or args.device_cache_tokens:
            check_device_cache(workload, device_cache_tokens, args.chunk_size)
        if not workload.sessions:
            raise ValueError("no turn fits the model's context")
    except DeviceCacheTooSmall as exc:
        raise SystemExit(f"kvpool replay: {exc}") from None
    except ValueError as exc:
        raise SystemExit(f"kvpool replay: {exc}") from None
    print(f"kvpool replay: {len(workload.sessions)} sessions, {workload.num_turns} turns, "
          f"{workload.prompt_tokens:,} prompt tokens at --scale {args.scale}; levels {levels}", flush=True)
    if faults is not None:
        return _run_chaos(args, workload, faults, device_cache_tokens)
    results: list[ReplayResult] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-replay-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for level in levels:
            options = ReplayOptions(concurrency=level, think_scale=args.think_scale, duration_s=args.duration,
                                    chunk_size=args.chunk_size, progress=sys.stderr.isatty())
            try:
                results.append(_run_level(args, workload, options, device_cache_tokens, workdir))
            except ServiceFailed as exc:
                raise SystemExit(f"kvpool replay: a service failed to start:\n{exc}") from None
    summaries = [r.summary for r in results]
    print(format_table(summaries, workload), flush=True)
    if args.plot:
        from kvpool.tools.replay.plot import write_plots

        for path in write_plots(Path(args.plot), results):
            print(f"kvpool replay: wrote {path}", flush=True)
    if args.json:
        last = dict(summaries[-1])
        if len(summaries) > 1:
            last["levels"] = summaries
        print(json.dumps(json_safe(last)), flush=True)
    return 0 if all(s["errors"] == 0 for s in summaries) else 1


def _chaos_faults(args: argparse.Namespace) -> list[Any]:
    """The SPEC's faults, checked against the cluster's names; exit 2 naming the bad part."""
    from kvpool.core.supervision.chaos_spec import ChaosSpecError, check_targets, parse_chaos
    from kvpool.tools.replay.chaos import cluster_names

    try:
        if args.url or args.compare:
            raise ChaosSpecError(args.chaos, "--chaos starts its own clusters: not with --url or --compare")
        if args.kv_dtype != "float32":
            raise ChaosSpecError(args.chaos, "answers are compared exactly: --kv-dtype must be float32")
        faults = parse_chaos(args.chaos)
        check_targets(faults, cluster_names(args.stores, args.pipelines, args.stages, args.decode_shards))
    except ChaosSpecError as exc:
        print(f"kvpool replay: --{exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return faults


def _run_chaos(args: argparse.Namespace, workload: ReplayWorkload, faults: list[Any], device_cache_tokens: int) -> int:
    from kvpool.tools.replay.chaos import main_chaos
    from kvpool.tools.replay.chaos_report import format_chaos_table

    with tempfile.TemporaryDirectory(prefix="kvpool-chaos-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        report = main_chaos(args, workload, faults, device_cache_tokens, write_config, _probes, workdir)
    print(format_chaos_table(report), flush=True)
    if args.json:
        print(json.dumps(json_safe(report)), flush=True)
    ok = report["wrong_outputs"] == 0 and report["lost_silently"] == 0 and report["recovered_all"]
    return 0 if ok else 1
