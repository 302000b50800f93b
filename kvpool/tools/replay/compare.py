"""The seed's side-by-side comparisons: the same sessions replayed on two topologies, one after the other.

- ``pool=shared,split``: K logical servers with one pool over every store
  against one pool per server over its prefill-side store, the split side
  twice: ``split-moving`` with the router's own session affinity (a session
  moves off a pipeline with a long queue, leaving its history in the other
  server's pool) and ``split-strict`` (a session's turns always go to its home
  server, waiting there). ``shared_over_split_moving`` and
  ``shared_over_split_strict`` are the prompt throughput ratios at the highest
  concurrency, the shared side at the router's own affinity;
  ``shared_over_split`` is the moving one, as it always was. ``pool=shared,
  split-moving`` or ``pool=shared,split-strict`` runs one baseline only.
- ``groups=on,off``: whole-group eviction against per-object eviction (the
  master's ``--eviction group|object``); ``reuse_groups_on`` and
  ``reuse_groups_off`` are the prompt-token reuse of each.

Every side gets a fresh cluster per concurrency level (no side starts on
another's warm caches) and the very same workload. The regime the seed
measured is a working set larger than one server's pool and smaller than the
shared pool; ``regime`` says, from the chunks actually sent, whether a run was
in it. With ``kill_server`` every process of that server is killed ``kill_at_s``
into each replay: every request sent after it must come back answered or
failed (``silently_lost`` counts any that did neither); the reuse before and
after it is reported per side, and ``reuse_lost`` against the same side
replayed again with no kill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.core.chunk_hash import chunk_hashes
from kvpool.model.config import CONFIGS
from kvpool.tools.cluster import Cluster
from kvpool.tools.replay.engine import run_replay
from kvpool.tools.replay.probes import ClusterProbes
from kvpool.tools.replay.records import ReplayOptions, ReplayResult
from kvpool.tools.replay.topology import AFFINITY_STRICT, TopologySettings, side_topology
from kvpool.tools.replay.workload import ReplayWorkload
from kvpool.sizes import format_size, parse_size

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
COMPARISONS = {"pool": ("shared", "split-moving", "split-strict"), "groups": ("on", "off"), "locality": ("on", "off"),
               "sched": ("fifo", "session")}
# the master's watermarks: a pool holds about low_watermark of its bytes once eviction runs
USABLE_SHARE = 0.85


# the side whose queue --find-load steps the load up for: the one the other is measured against
BASELINES = {"pool": ("split-moving", "split-strict"), "groups": ("off",), "locality": ("off",), "sched": ("fifo",)}
# pool=: "split" is both split baselines
SIDE_ALIASES = {"pool": {"split": ("split-moving", "split-strict")}}


def parse_compare(text: str) -> tuple[str, tuple[str, ...]]:
    """``"pool=shared,split"`` → ``("pool", ("shared", "split-moving", "split-strict"))``; only the
    comparisons above."""
    what, _, sides_text = text.partition("=")
    aliases = SIDE_ALIASES.get(what, {})
    sides = tuple(side for s in sides_text.split(",") if s.strip() for side in aliases.get(s.strip(), (s.strip(),)))
    if what not in COMPARISONS or not sides or set(sides) - set(COMPARISONS[what]) or len(set(sides)) != len(sides):
        raise ValueError(f"--compare: expected pool=shared,split (split: split-moving and split-strict), "
                         f"groups=on,off, locality=on,off or sched=fifo,session, got {text!r}")
    return what, sides


def side_settings(base: TopologySettings, what: str, side: str) -> TopologySettings:
    if what == "pool":
        return dataclasses.replace(base, pool="shared" if side == "shared" else "split",
                                   affinity_max_queue=AFFINITY_STRICT if side == "split-strict" else 0)
    if what == "locality":
        return dataclasses.replace(base, locality=side == "on")
    if what == "sched":
        return dataclasses.replace(base, sched=side)
    return dataclasses.replace(base, eviction="group" if side == "on" else "object")


def chunk_nbytes(model: str, kv_dtype: str, chunk_size: int) -> int:
    """One chunk's KV over every layer (the bytes of a whole group)."""
    config = CONFIGS[model]
    entry = config.kv_lora_rank + config.qk_rope_head_dim
    return config.num_hidden_layers * chunk_size * entry * DTYPE_BYTES[kv_dtype]


def working_set_bytes(prompts: Sequence[Sequence[int]], chunk_size: int, group_bytes: int) -> int:
    """Distinct full chunks over ``prompts`` × a group's bytes: what an unlimited pool would hold."""
    distinct: set[bytes] = set()
    for prompt in prompts:
        distinct.update(chunk_hashes("", prompt, chunk_size))
    return len(distinct) * group_bytes


def workload_prompts(workload: ReplayWorkload) -> list[list[int]]:
    return [s.token_ids(t, workload.scale, workload.vocab_size) for s in workload.sessions for t in s.turns]


def auto_segment_size(working_set: float, servers: int) -> int:
    """Each store's bytes so the shared pool (2 stores a server) holds the working set with 15% to spare;
    one server's split pool (1 store) then holds 0.68 of its server's share: the seed's regime."""
    need = 1.15 * working_set / (2 * servers * USABLE_SHARE)
    return max(8 << 20, math.ceil(need / (1 << 20)) << 20)


def regime(working_set: int, segment_bytes: int, servers: int) -> dict[str, Any]:
    """Where a run stands against the seed's regime (working set > one server's pool, < the shared pool).

    A server's share of the working set is ``working_set / servers`` (the
    router spreads sessions); a pool counts ``USABLE_SHARE`` of its bytes.
    """
    one_server = USABLE_SHARE * segment_bytes
    shared = USABLE_SHARE * segment_bytes * 2 * servers
    per_server = working_set / servers
    inside = one_server < per_server and working_set < shared
    text = (f"working set {format_size(working_set)} ({format_size(per_server)} a server) against "
            f"{format_size(one_server)} usable in one server's split pool and {format_size(shared)} in the "
            f"shared pool: " + ("IN the seed's regime (larger than one server's pool, smaller than the shared "
                                "pool)" if inside else "NOT in the seed's regime")
            + ("; even the shared pool must evict" if working_set >= shared else ""))
    return {"working_set_bytes": working_set, "per_server_bytes": int(per_server),
            "split_pool_usable_bytes": int(one_server), "shared_pool_usable_bytes": int(shared),
            "in_regime": inside, "eviction_pressure": working_set >= shared, "text": text}


@dataclass(slots=True, frozen=True)
class Fault:
    """Kill every process of server ``server`` ``at_s`` seconds into each replay."""

    server: int
    at_s: float


def probes_for(cluster: Cluster) -> ClusterProbes:
    def root(proc: Any, host: str) -> str:
        return f"http://{host}:{proc.ready['admin_port']}"

    stages = {p.name: root(p, s.address) for s in cluster.servers for p in s.services if "-stage" in p.name}
    # the report reads decode figures from probes named decode*
    decode = {f"decode-s{s.index}": root(p, s.address) for s in cluster.servers for p in s.services
              if p.name.endswith("-decode")}
    # shared: the one master; split has one a server and no single pool figure
    master = cluster.master_address if cluster.master is not None else ""
    router = cluster.router
    assert router is not None
    return ClusterProbes(router=root(router, "127.0.0.1"), stages=stages, decode=decode, master=master)


async def _replay(cluster: Cluster, workload: ReplayWorkload, options: ReplayOptions,
                  fault: Fault | None) -> tuple[ReplayResult, dict[str, Any] | None]:
    task = asyncio.ensure_future(run_replay(cluster.http_url, workload, options, probes_for(cluster)))
    if fault is None:
        return await task, None
    loop = asyncio.get_running_loop()
    started = loop.time()
    done, _ = await asyncio.wait({task}, timeout=fault.at_s)  # the fault's moment, the replay runs meanwhile
    killed: list[str] = []
    killed_at = reaped_at = None
    if not done:
        killed_at = loop.time() - started
        killed = await asyncio.to_thread(cluster.kill_server, fault.server)
        reaped_at = loop.time() - started
    result = await task
    return result, {"server": fault.server, "at_s": fault.at_s, "killed": killed, "killed_at_s": killed_at,
                    "reaped_at_s": reaped_at}


def fault_report(result: ReplayResult, at_s: float) -> dict[str, Any]:
    """What the kill cost: requests failed or silently lost after it, reuse before and after."""
    def reuse(records: list[Any]) -> float:
        prompt = sum(r.prompt_tokens for r in records)
        return (sum(r.device_tokens + r.pool_tokens for r in records) / prompt) if prompt else math.nan

    before = [r for r in result.records if r.issued_at < at_s and r.error is None]
    after = [r for r in result.records if r.issued_at >= at_s]
    answered = [r for r in after if r.error is None and r.completion_tokens > 0]
    failed = [r for r in result.records if r.error is not None]  # in flight at the kill, or sent after it
    # neither answered nor failed: what a router must never do
    silent = [r for r in result.records if r.error is None and r.completion_tokens == 0]
    return {"sent_after_kill": len(after), "answered_after_kill": len(answered),
            "failed_after_kill": sum(1 for r in failed if r.issued_at >= at_s),
            "failed_in_flight_at_kill": sum(1 for r in failed if r.issued_at < at_s),
            "silently_lost": len(silent),
            "failed_errors": sorted({(r.error or "")[:160] for r in failed})[:5],
            "reuse_before_kill": reuse(before), "reuse_after_kill": reuse(answered)}


def session_moves(result: ReplayResult) -> int:
    """Turns answered by another pipeline than the session's turn before (strict affinity: none but a
    failure's)."""
    last: dict[str, str] = {}
    moves = 0
    for r in sorted(result.records, key=lambda r: (r.session_id, r.turn)):
        if not r.pipeline:
            continue
        moves += r.session_id in last and last[r.session_id] != r.pipeline
        last[r.session_id] = r.pipeline
    return moves


def run_side(settings: TopologySettings, workload: ReplayWorkload, options: ReplayOptions,
             fault: Fault | None = None, workdir: Path | None = None) -> dict[str, Any]:
    """One side at one concurrency on a fresh cluster: the engine's summary plus links, regime and fault."""
    cluster = Cluster(side_topology(settings), workdir=workdir)
    cluster.start()
    try:
        links_before = cluster.link_bytes()
        result, killed = asyncio.run(_replay(cluster, workload, options, fault))
        links_after = cluster.link_bytes()
    finally:
        cluster.stop()
    summary = dict(result.summary)
    sent = {(r.session_id, r.turn) for r in result.records}
    by_id = {s.id: s for s in workload.sessions}
    prompts = [by_id[sid].token_ids(by_id[sid].turns[turn], workload.scale, workload.vocab_size)
               for sid, turn in sorted(sent)]
    group_bytes = chunk_nbytes(settings.model, settings.kv_dtype, options.chunk_size)
    summary["regime"] = regime(working_set_bytes(prompts, options.chunk_size, group_bytes),
                               parse_size(settings.segment_size), settings.servers)
    summary["session_moves"] = session_moves(result)
    summary["network_mode"] = cluster.network_mode
    summary["link_bytes"] = [None if a is None or b is None else {"in": a[0] - b[0], "out": a[1] - b[1]}
                             for a, b in zip(links_after, links_before, strict=True)]
    if killed is not None and fault is not None:
        summary["kill"] = {**killed, **fault_report(result, fault.at_s)}
        if not killed["killed"]:
            summary["kill"]["note"] = f"the replay ended before {fault.at_s:g} s: nothing was killed"
    return summary


def baseline_side(what: str, sides: Sequence[str]) -> str:
    """The side a load is found for: sched's fifo, pool's first split side, groups' or locality's off."""
    return next((side for side in sides if side in BASELINES[what]), sides[0])


def prefill_queueing(summary: dict[str, Any]) -> dict[str, Any]:
    """Whether a side's prefill queued: the median wait in front of prefill (the sum of the medians of the
    router's admission queue, stage 0's gate and stage 0's wait for device blocks, each estimated from its
    histogram) against the median prefill service time (stage 0's pipeline compute). ``queues``: the wait is at
    least the service time, so at least about half the requests waited a whole service time. A mean would not
    do: a few long waits lift it while most requests pass at once."""
    waits = [summary.get(k) for k in ("router_queue_wait_p50_s", "prefill_gate_wait_p50_s",
                                       "prefill_queue_wait_p50_s")]
    wait = sum(w for w in waits if isinstance(w, (int, float)) and math.isfinite(w))
    service = summary.get("prefill_compute_p50_s", math.nan)
    return {"prefill_wait_p50_s": wait, "prefill_service_p50_s": service,
            "queues": bool(math.isfinite(service) and wait >= service)}


def run_compare(what: str, sides: Sequence[str], base: TopologySettings, workload: ReplayWorkload,
                levels: Sequence[int], options: ReplayOptions, fault: Fault | None = None,
                workdir: Path | None = None, on_side: Any = None, at_once: bool = False,
                ran: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every side at every level (fresh topologies), then the comparison's headline figures; ``at_once``:
    the sides of a level run at the same time (without a fault), so a load that moves moves for both.
    ``ran``: sides already run at the one level (the load finder's last step), not run again."""
    per_side: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    ran = ran or {}
    if ran and (len(levels) != 1 or at_once or fault is not None):
        raise ValueError("ran: only for one level, the sides one after the other, and no fault")
    for level in levels:
        def one_side(side: str) -> tuple[dict[str, Any], Path | None, TopologySettings, ReplayOptions]:
            where = workdir / f"{what}-{side}-c{level}" if workdir is not None else None
            settings, level_options = side_settings(base, what, side), dataclasses.replace(options, concurrency=level)
            if what == "sched":  # the session side's clients send the hints
                level_options = dataclasses.replace(level_options, session_hints=side == "session")
            return run_side(settings, workload, level_options, fault, where), where, settings, level_options

        if at_once and fault is None:  # every side at the same time: each sees the host's load as the others do
            with ThreadPoolExecutor(len(sides)) as pool:
                done = list(pool.map(one_side, sides))
        else:
            done = [(ran[side], None, side_settings(base, what, side), options) if side in ran else one_side(side)
                    for side in sides]
        for side, (summary, where, settings, level_options) in zip(sides, done):
            if fault is not None and summary.get("kill", {}).get("killed"):
                # the reuse a kill costs: against the same side and requests with no kill
                calm = run_side(settings, workload, level_options, None,
                                where.with_name(where.name + "-nokill") if where is not None else None)
                summary["kill"]["reuse_no_kill"] = calm["reuse_ratio"]
                summary["kill"]["reuse_lost"] = calm["reuse_ratio"] - summary["reuse_ratio"]
            summary["side"] = side
            per_side[side].append(summary)
            if on_side is not None:
                on_side(side, summary)
    out: dict[str, Any] = {"compare": what, "servers": base.servers, "levels": list(levels),
                           "sides": {side: rows[-1] for side, rows in per_side.items()}}
    if len(levels) > 1:
        out["by_level"] = per_side
    top = {side: rows[-1] for side, rows in per_side.items()}
    if what == "pool":
        out.update(pool_ratios(top))
    for side, row in top.items():
        if "reuse_lost" in row.get("kill", {}):
            out[f"reuse_lost_{side.replace('-', '_')}"] = row["kill"]["reuse_lost"]
    if what == "groups":
        for side in sides:
            out[f"reuse_groups_{side}"] = top[side]["reuse_ratio"]
    if what == "locality":
        for side in sides:
            out[f"cross_server_handoff_share_{side}"] = top[side]["cross_server_handoff_share"]
    if what == "sched" and {"fifo", "session"} <= set(top):
        out.update(sched_ratios(top["fifo"], top["session"]))
    out["regime"] = next(iter(top.values()))["regime"]
    return out


def pool_ratios(top: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Shared over each split baseline run (prompt tokens/s), each side's reuse and errors; ``shared_over_split``
    and ``reuse_split`` are the moving baseline's, as before the strict one was added."""
    out: dict[str, Any] = {}
    shared = top.get("shared")
    for side in ("split-moving", "split-strict"):
        if shared is not None and side in top:
            split = top[side]["prompt_tok_s"]
            out[f"shared_over_{side.replace('-', '_')}"] = shared["prompt_tok_s"] / split if split else math.nan
    if "shared_over_split_moving" in out:
        out["shared_over_split"] = out["shared_over_split_moving"]
    for side, row in top.items():
        out[f"reuse_{side.replace('-', '_')}"] = row["reuse_ratio"]
    if "split-moving" in top:
        out["reuse_split"] = top["split-moving"]["reuse_ratio"]
    for side, row in top.items():
        out[f"errors_{side.replace('-', '_')}"] = row["errors"]
    out["errors"] = sum(row["errors"] for row in top.values())
    return out


def sched_ratios(fifo: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
    """The session-aware side over the FIFO side, the same keys as ``kvpool simulate --compare sched=...``."""
    def over(key: str) -> float:
        return session[key] / fifo[key] if fifo.get(key) else math.nan

    prefetched = session.get("prefetched_bytes", 0)
    return {"ttft_p50_session_over_fifo": over("ttft_p50_s"), "ttft_p99_session_over_fifo": over("ttft_p99_s"),
            "throughput_session_over_fifo": over("prompt_tok_s"),
            "restore_wait_total_session_over_fifo": over("restore_wait_total_s"),
            "reuse_session": session["reuse_ratio"], "reuse_fifo": fifo["reuse_ratio"],
            "prefetched_bytes": prefetched, "prefetch_used_bytes": session.get("prefetch_used_bytes", 0),
            "prefetch_wasted_bytes": session.get("prefetch_wasted_bytes", 0),
            "wasted_prefetch_share": session.get("prefetch_wasted_bytes", 0) / prefetched if prefetched else 0.0,
            "errors": fifo["errors"] + session["errors"]}
