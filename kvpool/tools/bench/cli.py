"""``kvpool bench``: the benchmarks' command-line parsers and their dispatch.

Every benchmark module is imported only when it runs, so ``kvpool --help`` and
the services start without them.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvpool.tools.command_flags import add_report_flags


def add_bench(sub: Any) -> None:
    """``kvpool bench <name>``: one parser per benchmark."""
    p = sub.add_parser("bench", help="benchmarks (JSON output with --json)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    pool = bench_sub.add_parser(
        "pool", help="pool put/get throughput vs upstream Mooncake Store and raw transfer engine",
        description="Starts a master, two stores and client processes on this host and measures put/get "
        "throughput, lookup latency and eviction under churn; the same workload against upstream Mooncake "
        "Store and the raw transfer engine in the same run. The largest batch is measured side by side on the "
        "same-host memory path (warm and first touch), the engine path, upstream and a one-thread copy between "
        "two shared mappings (memcpy), each run reading several times the largest CPU cache.",
    )
    add_report_flags(pool, quick="small run (the headline reads 2x the L3 cache per run), under three minutes")
    pool.add_argument("--object-size", type=int, default=256 * 4 * 1152, help="bytes per KV object")
    pool.add_argument("--batch-sizes", default="4,16,64", help="objects per batch, comma separated")
    pool.add_argument("--batches", type=int, help="batches per measurement")
    pool.add_argument("--skip-upstream", action="store_true", help="do not run upstream Mooncake Store")
    pool.add_argument("--working-set-bytes", type=int,
                      help="bytes each headline run reads (default 4x the largest CPU cache; quick 2x)")
    prefill = bench_sub.add_parser(
        "prefill", help="replay real agent sessions through the prefill pipeline, pool on vs pool off",
        description="Replays the first turns of real coding-agent sessions (weka traces) as a closed loop of "
        "concurrent sessions through a master, two stores and a four-stage prefill pipeline whose device cache "
        "is smaller than the working set, then through the same pipeline without the pool (fresh clusters). "
        "Reports reuse next to the trace's bounds, device/pool/computed shares, restore times, TTFT, prompt "
        "throughput and logits against a from-scratch computation. Think time is ignored.",
    )
    add_report_flags(prefill, quick="small run, well under three minutes")
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
    restore = bench_sub.add_parser(
        "restore", help="prefill restore/save throughput at the seed's KV shape vs the raw transfer engine",
        description="Starts a master, two stores and a four-stage pipeline (dsv3-kv-61, fp8 KV) and restores "
        "4K and 16K tokens of history (synthesized into the pool; a 4K prompt is also computed, saved and "
        "restored, its logits checked) on every stage at once; reports per-stage bytes, read ms and "
        "GB/s, the aggregate over the four stages, the raw engine's aggregate read of the same objects by four "
        "readers, and save throughput from the pages. Every size runs twice, side by side: the stages on the "
        "same-host path (--pool-path auto) and on the engine path (--pool-path engine).",
    )
    add_report_flags(restore, quick="4K tokens of history only, 3 repeats")
    restore.add_argument("--sizes", help="history sizes in tokens, comma separated (default 4096,16384)")
    restore.add_argument("--repeats", type=int, help="restores per size (default 5; quick 3)")
    faults = bench_sub.add_parser(
        "faults", help="the pool through a master kill -9, a store kill -9 and an outage under prefill",
        description="Starts a master, two stores and a four-stage prefill pipeline; four stages save groups while "
        "readers check every byte; kills the master with -9 and starts it again while the pipeline computes "
        "(recovery time, groups usable without a put, saves skipped), then kills one store (groups lost next to "
        "the share it held). Then the leader scenario: etcd, a master and a standby, two stores and a writer and "
        "readers under load; the leader is killed with -9 --leader-kills times (failover p50/p99 from the kill to "
        "the first lookup the new leader serves, objects acknowledged and lost, wrong bytes, failed requests), "
        "paused past its lease and resumed (fenced), and --quiet-s seconds of load count leader changes without "
        "a kill. One run; every figure measured in it.",
    )
    add_report_flags(faults, quick="small run (16 groups), about a minute and a half")
    faults.add_argument("--groups", type=int, help="groups of four 1 MiB members to write (default 64; quick 16)")
    faults.add_argument("--leader-kills", type=int,
                        help="leader scenario: times the master leader is killed with -9 under load (default 10)")
    faults.add_argument("--quiet-s", type=float,
                        help="leader scenario: seconds of load without a fault, counting leader changes (default "
                        "600, the issue's ten minutes; --quick 60, a shorter window for development)")
    faults.add_argument("--scenarios", help="which to run, comma separated: pool (master restart, store kill, "
                        "outage under prefill), leader (a master and a standby through etcd) (default both)")
    decode = bench_sub.add_parser(
        "decode", help="decode tokens/s of one shard at 1, 4, 16 and 64 concurrent sequences",
        description="Starts one decode shard process (tiny model by default), fills each prompt's KV through "
        "Reserve and real transfer-engine writes from this process, and measures decode tokens per second and "
        "page use at each concurrency; batching_gain is tok/s at 16 over tok/s at 1.",
    )
    add_report_flags(decode)
    decode.add_argument("--concurrency", default="1,4,16,64", help="concurrent sequences, comma separated")
    decode.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of every sequence")
    decode.add_argument("--max-tokens", type=int, default=64, help="tokens each sequence makes")
    decode.add_argument("--repeats", type=int, default=3, help="runs per concurrency; the median is reported")
    decode.add_argument("--model", default="tiny", help="model config")
    decode.add_argument("--kv-dtype", default="float32", help="KV dtype")
    handoff = bench_sub.add_parser(
        "handoff", help="prefill → decode handoff: gathered large writes vs one write per token per layer",
        description="Two processes on this host, each with a transfer engine: a sender holding one prefill "
        "stage's paged KV and a receiver with decode's token-major pages. Runs the direct per-token-per-layer "
        "copy and the gathered path (gather, writes of at most 8 MiB, scatter) in the same run and verifies "
        "decode's pages against the sender's byte for byte after each.",
    )
    add_report_flags(handoff, quick="1,024 tokens unless --tokens says otherwise", log_level=False)
    handoff.add_argument("--tokens", type=int, help="tokens in the request (default 8192; quick 1024)")
    handoff.add_argument("--layers", type=int, default=20, help="layers of the prefill stage")
    handoff.add_argument("--entry-bytes", type=int, default=576, help="bytes per token per layer (576: fp8 MLA)")
    handoff.add_argument("--repeats", type=int, default=3, help="measured gathered runs (median counts)")
    ab = bench_sub.add_parser(
        "ab", help="time to first token of this checkout against an earlier commit, through the public API",
        description="Starts two whole clusters on this host, one from a clone of --baseline and one from this "
        "checkout, on the same settings (4 stages, dsv3-kv-lean, float8 KV, no pool), and sends the same prompts "
        "to each router in alternating rounds: 4K and 16K cold prompts, a 16K prompt whose 95%% prefix is a device "
        "hit, and a 4K prompt plus one token (all but one token a device hit: mostly control time). Reports each "
        "case's TTFT medians and the ratio current / baseline.",
    )
    add_report_flags(ab, quick="2 rounds instead of 5")
    ab.add_argument("--baseline", required=True, metavar="COMMIT", help="the commit to compare against")
    ab.add_argument("--rounds", type=int, help="rounds of every case, alternating which side goes first (default 5)")
    ab.add_argument("--hit-requests", type=int, default=5, help="one-token device-hit requests per round")
    ab.add_argument("--workdir", help="keep the clusters' logs here (default: a temporary folder)")
    ab.add_argument("--cases", choices=("all", "cases", "control"), default="all",
                    help="cases: the 4K/16K prompts on dsv3-kv-lean; control: the one-token device hit on tiny "
                         "(mostly control time); all: both")
    core = bench_sub.add_parser(
        "master-core", help="the master's index and servicer CPU per save and lookup, in one process (no gRPC)",
        description="Runs the pool master's index and servicer in this process (no gRPC, no other process), "
        "populates them through the servicer's session answers to 10^5 and 10^6 objects at the high watermark, "
        "the stores' heartbeats acknowledged as a store does, then measures the process's CPU per save of 22 "
        "chunks over 4 stages (its commit riding on the next save, alternating in blocks of saves between a commit of "
        "whole groups and two flat arrays) with its share of the heartbeats, while saves evict, and per lookup "
        "of a 450-chunk history by its handle with its release. What kvpool bench master reads over gRPC, less "
        "the calls' own cost and the host's other load.",
    )
    add_report_flags(core, quick="10^4 objects, fewer saves and lookups (seconds)")
    core.add_argument("--objects", type=int, help="one object count to measure at (default: 10^5, then 10^6)")
    core.add_argument("--saves", type=int, help="saves measured (default 2000; quick 200)")
    core.add_argument("--lookups", type=int, help="lookups measured (default 400; quick 80)")
    master = bench_sub.add_parser(
        "master", help="what one pool master carries: CPU per lookup, save and turn, calls a second, index memory",
        description="Starts a master and two stores, populates the pool through real PutStart/PutEnd calls to "
        "10^5 and 10^6 objects at the high watermark, then measures the master's CPU (from /proc) per lookup of "
        "a 450-chunk history with its release, per save of 22 chunks over 4 stages and per typical turn, each in "
        "the older call pattern (legacy: unary calls, every group located, a put pair per stage) and today's "
        "(session messages) side by side; then lookups, saves and turns a second with several client "
        "processes at once while saves evict (churn). No byte moves: the master only sees control messages.",
    )
    add_report_flags(master, quick="10^4 and 10^5 objects, shorter phases")
    master.add_argument("--objects", help="object counts to measure at, comma separated (default 100000,1000000)")
    master.add_argument("--master-standbys", type=int, default=0, metavar="N",
                        help="measure the leader of a master with N standbys through etcd: every PutEnd waits "
                        "until the stores hold its commit (default 0: the one master)")
    master.add_argument("--clients", type=int, default=4, help="client processes at saturation")
    master.add_argument("--seconds", type=float, help="length of the saves' and turns' saturation phases "
                        "(default 8; quick 3)")
    master.add_argument("--lookups", type=int, help="lookups the saturation phase makes (default 10000; quick 1000)")
    master.add_argument("--cost-seconds", type=float, help="length of each cost phase (default 3; quick 1.5)")
    master.add_argument("--heartbeat-interval-s", type=float, default=2.0,
                        help="the stores' heartbeat period the master asks for (default 2.0, the master's): each "
                        "phase first waits for the stores to acknowledge every change, about one period")
    master.add_argument("--turn-device-share", type=float, default=0.6,
                        help="share of a typical turn's history its device holds (the device served 56-69%% of "
                        "prompt tokens in the prefill bench)")
    master.add_argument("--turn-new-chunks", type=int, default=8, help="chunks a typical turn adds and saves")
    tracing = bench_sub.add_parser(
        "tracing", help="what tracing costs a call: off, spans to a file, spans to an OTLP collector",
        description="One process serves a pool master and calls it as a request's hop would (request id bound): "
        "a unary Exists and a Session lookup of 16 groups with its release. Per mode (off; every span a JSON line "
        "in a file; spans batched to an OTLP/gRPC collector running in the same process, its receiving counted "
        "too), the process's CPU per call at both ends; the modes alternate over --rounds, medians reported.",
    )
    add_report_flags(tracing, quick="300 calls a round, 2 rounds")
    tracing.add_argument("--calls", type=int, help="calls of each kind a round (default 2000)")
    tracing.add_argument("--rounds", type=int, help="rounds of every mode (default 5)")
    path = bench_sub.add_parser(
        "path", help="a request's path: a burst beyond decode's room queues, not fails; RPCs before the first "
        "token; every control call of a pool-hit and a cold request (pool_hit, cold); handoff bytes across servers",
        description="Starts a cluster whose decode receive arena holds two long prompts and sends a burst of "
        "--requests at once: queued_not_failed is true when all complete with none failed and queueing in the "
        "router's metrics. Every service traces its calls keyed by the request id: critical_path_depth is the "
        "median longest chain of control RPCs before a request's first token. Then replays the shared traces on "
        "two logical servers with the router's locality on (and off, unless --quick): "
        "cross_server_handoff_share is the share of handoff bytes that crossed servers with it on.",
    )
    add_report_flags(path, quick="locality on only, 4 sessions of 6 turns")
    path.add_argument("--requests", type=int, default=8, help="requests in the burst")
    path.add_argument("--prompt-tokens", type=int, default=2000, help="prompt length of each burst request")
    path.add_argument("--max-tokens", type=int, default=16, help="tokens each burst request makes")
    path.add_argument("--stages", type=int, default=2, help="prefill stages")
    path.add_argument("--skip-replay", action="store_true", help="no replay (burst and cases)")
    path.add_argument("--skip-cases", action="store_true", help="no handoff cases (push against after-prefill)")
    path.add_argument("--cases-only", action="store_true", help="the handoff cases only")
    path.add_argument("--handoff", choices=("both", "pieces", "all", "push", "after-prefill", "after-stage"),
                      default="both",
                      help="the cases' modes, side by side: push (the service's path: the handoff streamed during "
                           "prefill, the stages overlapping on the forward's pieces), after-prefill (the handoff "
                           "after the last forward), after-stage (each stage passes a request on whole: the stages "
                           "one after another); both = push and after-prefill, pieces = push and after-stage, all = "
                           "the three")
    path.add_argument("--case-requests", type=int, default=3,
                      help="requests per mode in the 4k and warm cases (16k cold: one fewer)")
    path.add_argument("--traces", default=None, help="weka traces (default ../shared/traces/agentx-weka)")
    path.add_argument("--sessions", type=int, help="sessions replayed (default 8; quick 4)")
    path.add_argument("--turns", type=int, help="first turns of each session (default 10; quick 6)")
    path.add_argument("--scale", type=int, default=32, help="token scale factor of the replay")
    path.add_argument("--concurrency", type=int, default=4, help="sessions in flight in the replay")
    path.add_argument("--replay-max-tokens", type=int, default=16, help="output tokens per replayed turn at most")
    path.add_argument("--loopback", action="store_true", help="no network namespaces: servers share loopback")
    path.add_argument("--workdir", default="", help="keep logs and the trace here")
    tenants = bench_sub.add_parser(
        "tenants", help="one tenant's flood of long prompts against another's small turns, fair and FIFO",
        description="Starts kvpool up on its defaults with an API keys file of two tenants, twice, one after the "
        "other: fair (the default) and FIFO (tenant_fair = false for the router and the stages). On each, the victim "
        "tenant's small turns alone, and rounds of the flooder tenant's long prompts, alone and during the victim's "
        "turns in turn. Reports the victim's TTFT during the flood over alone on each side and the "
        "flooder's throughput during it over alone.",
    )
    add_report_flags(tenants)
    tenants.add_argument("--flood-prompts", type=int, default=3,
                         help="rounds of the flood during the victim's turns, each after one of the flood alone")
    tenants.add_argument("--flood-tokens", type=int, default=30000, help="tokens in each flood prompt")
    tenants.add_argument("--flood-concurrency", type=int, default=1,
                         help="flood prompts in a round, in flight at once (on kvpool up's defaults decode's "
                         "receive arena holds about one 30K-token prompt: the others wait for room, and one waiting "
                         "past the router's 30 s queue timeout gets 429)")
    tenants.add_argument("--victim-tokens", type=int, default=256, help="tokens in each of the victim's turns")
    tenants.add_argument("--victim-rate", type=float, default=1.0, help="the victim's turns a second")
    tenants.add_argument("--victim-turns", type=int, default=20,
                         help="the victim's turns alone (half before the flood, half after)")
    tenants.add_argument("--victim-delay-s", type=float, default=1.0,
                         help="the victim's first turn during the flood comes this long after the flood's first")
    tenants.add_argument("--sides", default="fair,fifo", help="which sides to run, in order (fair, fifo)")
    tenants.add_argument("--workdir", default="", help="keep the clusters' logs here")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the command names (its module loads only then)."""
    if args.bench_command == "faults":
        from kvpool.tools.bench.faults_bench import main as bench_faults

        return bench_faults(args)
    if args.bench_command == "handoff":
        from kvpool.tools.bench.handoff_bench import main as bench_handoff

        return bench_handoff(args)
    if args.bench_command == "restore":
        from kvpool.tools.bench.restore_bench import main as bench_restore

        return bench_restore(args)
    if args.bench_command == "prefill":
        from kvpool.tools.bench.prefill_bench import main as bench_prefill

        return bench_prefill(args)
    if args.bench_command == "ab":
        from kvpool.tools.bench.ab_bench import main as bench_ab

        return bench_ab(args)
    if args.bench_command == "path":
        from kvpool.tools.bench.path_bench import main as bench_path

        return bench_path(args)
    if args.bench_command == "master":
        from kvpool.tools.bench.master_bench import main as bench_master

        return bench_master(args)
    if args.bench_command == "tenants":
        from kvpool.tools.bench.tenants_bench import main as bench_tenants

        return bench_tenants(args)
    if args.bench_command == "tracing":
        from kvpool.tools.bench.tracing_bench import main as bench_tracing

        return bench_tracing(args)
    if args.bench_command == "decode":
        from kvpool.tools.bench.decode_bench import main as bench_decode

        return bench_decode(args)
    from kvpool.tools.bench.pool_bench import main as bench_pool

    return bench_pool(args)
