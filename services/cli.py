"""The ``kvpool`` command: one subcommand per role, plus tools and benchmarks.

It lives with the services because it is what starts them: the library in
``kvpool/`` never imports ``services/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvpool.logs import configure_logging
from kvpool.settings import add_setting_flags, load_settings


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="TOML", help="settings file; its [<role>] table is read, flags win")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--log-format", default="auto", choices=["auto", "json", "console"],
        help="auto: JSON unless stderr is a terminal",
    )
    parser.add_argument("--ready-file", metavar="PATH", help="write bound ports as JSON here once serving")


def _add_master(sub: Any) -> None:
    from services.master.settings import MasterSettings

    p = sub.add_parser("master", help="run the pool master", description="Run the pool master: object locations, "
                       "group-LRU eviction, leases, store liveness.")
    _common(p)
    add_setting_flags(p, MasterSettings)


def _add_store(sub: Any) -> None:
    from services.store.settings import StoreSettings

    p = sub.add_parser("store", help="run a store daemon", description="Run a store daemon: one DRAM segment "
                       "pinned to a NUMA node, registered with the transfer engine and mounted on the master.")
    _common(p)
    add_setting_flags(p, StoreSettings)


def _add_prefill(sub: Any) -> None:
    from services.prefill.settings import PrefillSettings

    p = sub.add_parser("prefill", help="run a prefill pipeline stage",
                       description="Run one prefill pipeline stage: a contiguous range of layers and their device KV "
                       "pages. Stage 0 also runs the scheduler (chunk hashing, the shared block table, device → pool "
                       "→ compute planning) and serves the Prefill API. Start the later stages first.")
    _common(p)
    add_setting_flags(p, PrefillSettings)
    p.add_argument("--no-pool", dest="master", action="store_const", const="",
                   help="run without the pool: device cache only")


def _add_pool(sub: Any) -> None:
    p = sub.add_parser("pool", help="inspect the pool")
    pool_sub = p.add_subparsers(dest="pool_command", required=True)
    stats = pool_sub.add_parser("stats", help="capacity, use, objects, groups, evictions, per segment")
    stats.add_argument("--master", default="127.0.0.1:7601", help="pool master address")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON output with --json)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    pool = bench_sub.add_parser(
        "pool", help="pool put/get throughput vs upstream Mooncake Store and raw transfer engine",
        description="Starts a master, two stores and client processes on this host and measures put/get "
        "throughput, lookup latency and eviction under churn; the same workload against upstream Mooncake "
        "Store and the raw transfer engine in the same run.",
    )
    pool.add_argument("--json", action="store_true", help="last line of output is one JSON object")
    pool.add_argument("--quick", action="store_true", help="small run, under two minutes")
    pool.add_argument("--object-size", type=int, default=256 * 4 * 1152, help="bytes per KV object")
    pool.add_argument("--batch-sizes", default="4,16,64", help="objects per batch, comma separated")
    pool.add_argument("--batches", type=int, help="batches per measurement")
    pool.add_argument("--skip-upstream", action="store_true", help="do not run upstream Mooncake Store")
    pool.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    prefill = bench_sub.add_parser(
        "prefill", help="replay real agent sessions through the prefill pipeline, pool on vs pool off",
        description="Replays the first turns of real coding-agent sessions (weka traces) as a closed loop of "
        "concurrent sessions through a master, two stores and a four-stage prefill pipeline whose device cache "
        "is smaller than the working set, then through the same pipeline without the pool (fresh clusters). "
        "Reports reuse next to the trace's bounds, device/pool/computed shares, restore times, TTFT, prompt "
        "throughput and logits against a from-scratch computation. Think time is ignored.",
    )
    prefill.add_argument("--json", action="store_true", help="last line of output is one JSON object")
    prefill.add_argument("--quick", action="store_true", help="small run, well under three minutes")
    prefill.add_argument("--sessions", type=int,
                         help="sessions to replay, the first by file name (default 4, also with --quick)")
    prefill.add_argument("--turns", type=int, help="first turns of each session (default 10; quick 8)")
    prefill.add_argument("--scale", type=int, help="token scale factor: 64-token blocks become 64/S tokens "
                         "(default 16; quick 32)")
    prefill.add_argument("--concurrency", type=int,
                         help="sessions in flight at once (default 4, also with --quick)")
    prefill.add_argument("--device-cache-tokens", type=int, help="device KV capacity of each stage in tokens "
                         "(default 8192; quick 4096)")
    prefill.add_argument("--traces", metavar="DIR", help="weka traces directory (default ../shared/traces/agentx-weka "
                         "next to the checkout)")
    prefill.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: disaggregated LLM serving around one shared KV-cache pool in host memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_master(sub)
    _add_store(sub)
    _add_prefill(sub)
    _add_pool(sub)
    _add_bench(sub)
    return parser


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if v is not None}


def _log(args: argparse.Namespace) -> None:
    fmt = getattr(args, "log_format", "auto")
    configure_logging(getattr(args, "log_level", "warning"), json=None if fmt == "auto" else fmt == "json")


def _settings(cls: type, section: str, args: argparse.Namespace) -> Any:
    try:
        return load_settings(cls, section, args.config, _flags(args))
    except (ValueError, TypeError) as exc:
        # bad settings: say which, no traceback
        raise SystemExit(f"kvpool {section}: {exc}") from None


def _run_master(args: argparse.Namespace) -> int:
    from kvpool import service
    from services.master.server import serve
    from services.master.settings import MasterSettings

    settings = _settings(MasterSettings, "master", args)
    service.run(lambda: serve(settings, args.ready_file))
    return 0


def _run_store(args: argparse.Namespace) -> int:
    from kvpool import service
    from services.store.daemon import serve
    from services.store.settings import StoreSettings

    settings = _settings(StoreSettings, "store", args)
    service.run(lambda: serve(settings, args.ready_file))
    return 0


def _run_prefill(args: argparse.Namespace) -> int:
    from kvpool import service
    from services.prefill.server import serve
    from services.prefill.settings import PrefillSettings

    settings = _settings(PrefillSettings, "prefill", args)
    service.run(lambda: serve(settings, args.ready_file))
    return 0


def _run_pool(args: argparse.Namespace) -> int:
    from kvpool.pool.stats import fetch_stats, format_stats

    stats = asyncio.run(fetch_stats(args.master))
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "prefill":
        from kvpool.bench.prefill_bench import main as bench_prefill

        return bench_prefill(args)
    from kvpool.bench.pool_bench import main as bench_pool

    return bench_pool(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _log(args)
    handlers = {
        "master": _run_master, "store": _run_store, "prefill": _run_prefill, "pool": _run_pool, "bench": _run_bench,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
