"""The simulator's outputs: the run matrix, a table, the final JSON object, PNG plots.

The matrix: the single-server calibration run (112 sessions); the seed's
4-server comparison, shared against split pools, at 96 and 112 sessions in
both readings of the seed's words (in total: 24 and 28 per server; per
server: 96 and 112 each), each at every router affinity threshold (strict,
2, 4, 8, none); and the pool past four servers (8, 16, 32 servers at the
calibrated saturating load per server, shared, one server's stores dying
mid-run, each with its twin without the failure and a split twin, at the
run settings' affinity threshold; and both without the failure at strict
affinity, ``scale-N-strict`` and ``scale-N-split-strict``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.tools.sim.topology import AFFINITY_NONE, AFFINITY_STRICT, affinity_label

SEED_SERVERS = 4
SEED_SESSIONS = (96, 112)
READINGS = ("total", "per_server")
THRESHOLDS = (AFFINITY_STRICT, 2, 4, 8, AFFINITY_NONE)
SCALE_SERVERS = (8, 16, 32, 64)
# the seed's capacity mechanism: 4 servers, prompts as recorded, every session one agent's (their system and tool
# prefix shared), sessions per server from where one split server's store holds its live histories to past it
CAPACITY_SESSIONS = (112, 224)
CONTEXT_AS_RECORDED = 1 << 20  # (topology.CONTEXT_AS_RECORDED)


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One run of the matrix: ``sessions`` per server."""

    label: str
    servers: int
    sessions_per_server: int
    pool: str
    duration_s: float
    fail_at_s: float | None = None
    affinity: int | None = None  # the router's affinity threshold (None: the run settings')
    reading: str = ""  # seed runs: "total" or "per_server"
    seed_sessions: int = 0  # seed runs: 96 or 112 as the seed says it
    warmup_s: float | None = None  # None: the run settings'
    max_context: int | None = None  # None: the topology's
    agent_prefix: bool = False  # every session one agent's (RunSettings.agent_prefix)


def seed_label(reading: str, sessions: int, pool: str, affinity: int) -> str:
    return f"seed-{reading}-{sessions}-{pool}-{affinity_label(affinity)}"


def matrix(duration_s: float, scale_duration_s: float, quick: bool, scale_sessions: int = 112,
           scale_warmup_s: float | None = None, capacity_duration_s: float = 2700.0,
           capacity_warmup_s: float = 1500.0, capacity_sessions: tuple[int, ...] = CAPACITY_SESSIONS,
           capacity_servers: int = SEED_SERVERS) -> list[RunSpec]:
    """The runs; the scale-out's store failure comes at two thirds of its duration (after warm-up)."""
    if quick:
        specs = [RunSpec("calibration", 1, 16, "shared", duration_s)]
        specs += [RunSpec(seed_label("per_server", 16, pool, a), 2, 16, pool, duration_s, affinity=a,
                          reading="per_server", seed_sessions=16)
                  for a in (AFFINITY_STRICT, 4) for pool in ("shared", "split")]
        return specs + [RunSpec("scale-4", 4, 8, "shared", scale_duration_s, scale_duration_s * 2 / 3),
                        RunSpec("scale-4-nofail", 4, 8, "shared", scale_duration_s),
                        RunSpec("scale-4-split", 4, 8, "split", scale_duration_s),
                        RunSpec("scale-4-split-strict", 4, 8, "split", scale_duration_s, affinity=AFFINITY_STRICT),
                        *capacity_specs((8,), duration_s, duration_s / 4, servers=2)]
    specs = [RunSpec("calibration", 1, 112, "shared", duration_s)]
    for reading in READINGS:
        for n in SEED_SESSIONS:
            per_server = n // SEED_SERVERS if reading == "total" else n
            specs += [RunSpec(seed_label(reading, n, pool, a), SEED_SERVERS, per_server, pool, duration_s,
                              affinity=a, reading=reading, seed_sessions=n)
                      for a in THRESHOLDS for pool in ("shared", "split")]
    w = scale_warmup_s
    for s in SCALE_SERVERS:  # each with its twin without the failure (the loss is their difference) and split
        specs += [RunSpec(f"scale-{s}", s, scale_sessions, "shared", scale_duration_s, scale_duration_s * 2 / 3,
                          warmup_s=w),
                  RunSpec(f"scale-{s}-nofail", s, scale_sessions, "shared", scale_duration_s, warmup_s=w),
                  RunSpec(f"scale-{s}-split", s, scale_sessions, "split", scale_duration_s, warmup_s=w)]
        # the split baseline as an operator would run it (sessions never leave their pipeline), and its shared twin
        specs += [RunSpec(f"scale-{s}-{twin}strict", s, scale_sessions, pool, scale_duration_s,
                          affinity=AFFINITY_STRICT, warmup_s=w) for twin, pool in (("", "shared"), ("split-", "split"))]
    return specs + capacity_specs(capacity_sessions, capacity_duration_s, capacity_warmup_s, capacity_servers)


def capacity_specs(sessions: tuple[int, ...], duration_s: float, warmup_s: float,
                   servers: int = SEED_SERVERS) -> list[RunSpec]:
    """The capacity scenario at each sessions per server: shared, split with the router's affinity (sessions
    move) and split with strict affinity (sessions kept home), prompts as recorded, one agent's prefix shared."""
    return [RunSpec(f"capacity-{n}-{side}", servers, n, "split" if side != "shared" else "shared", duration_s,
                    affinity=AFFINITY_STRICT if side == "split-strict" else None, warmup_s=warmup_s,
                    max_context=CONTEXT_AS_RECORDED, agent_prefix=True)
            for n in sessions for side in ("shared", "split", "split-strict")]


COLUMNS = (
    ("run", "label", "{}"), ("srv", "servers", "{}"), ("sess/srv", "sessions_per_server", "{}"),
    ("pool", "pool", "{}"), ("aff", "affinity_label", "{}"), ("tok/s/GPU", "throughput_per_gpu", "{:,.0f}"),
    ("computed tok/s/GPU", "throughput_per_gpu_computed", "{:,.0f}"), ("reuse", "reuse_ratio", "{:.1%}"),
    ("bound", "trace_bound", "{:.1%}"), ("device", "device_share", "{:.1%}"), ("pool%", "pool_share", "{:.1%}"),
    ("computed", "computed_share", "{:.1%}"), ("TTFT p50", "ttft_p50_s", "{:.2f}s"), ("p99", "ttft_p99_s", "{:.2f}s"),
    ("restore", "restore_p50_ms", "{:.0f}ms"), ("dec KV", "decode_kv_use_p50", "{:.0%}"),
    ("queue p90", "queue_p90_s", "{:.2f}s"), ("x-srv GB/s/NIC", "cross_server_gbps_per_nic", "{:.2f}"),
    ("NIC use", "nic_use", "{:.0%}"), ("master ops/s", "master_ops_per_s", "{:,.0f}"),
    ("master busy", "master_utilization", "{:.0%}"), ("evict/s", "master_evictions_per_s", "{:.1f}"),
    ("sim x", "sim_speed", "{:.1f}"),
)


def table(results: list[dict[str, Any]]) -> str:
    rows = [[title for title, _, _ in COLUMNS]]
    for r in results:
        rows.append([fmt.format(r.get(key, "")) if key in r else "-" for _, key, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def shared_over_split(results: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per reading and sessions: shared / split throughput at each threshold, and the best of each.

    ``shared_over_split_best``: the best shared threshold's throughput over the best split threshold's, and
    the lowest shared TTFT p99 over the lowest split TTFT p99 (below 1: shared answers sooner)."""
    per: dict[str, Any] = {}
    best: dict[str, Any] = {}
    seed = [r for r in results if r.get("reading")]
    for reading in sorted({r["reading"] for r in seed}):
        for n in sorted({r["seed_sessions"] for r in seed if r["reading"] == reading}):
            rows = {(r["pool"], r["affinity_label"]): r for r in seed
                    if r["reading"] == reading and r["seed_sessions"] == n}
            ratios = {a: rows[("shared", a)]["throughput_per_gpu"] / rows[("split", a)]["throughput_per_gpu"]
                      for (pool, a) in rows if pool == "shared" and ("split", a) in rows
                      and rows[("split", a)]["throughput_per_gpu"] > 0}
            per.setdefault(reading, {})[str(n)] = ratios
            shared = [r for (pool, _), r in rows.items() if pool == "shared"]
            split = [r for (pool, _), r in rows.items() if pool == "split"]
            if not shared or not split:
                continue
            top_shared = max(shared, key=lambda r: r["throughput_per_gpu"])
            top_split = max(split, key=lambda r: r["throughput_per_gpu"])
            fast_shared = min(shared, key=lambda r: r["ttft_p99_s"])
            fast_split = min(split, key=lambda r: r["ttft_p99_s"])
            best.setdefault(reading, {})[str(n)] = {
                "throughput": top_shared["throughput_per_gpu"] / max(top_split["throughput_per_gpu"], 1e-9),
                "throughput_thresholds": [top_shared["affinity_label"], top_split["affinity_label"]],
                "ttft_p99": fast_shared["ttft_p99_s"] / max(fast_split["ttft_p99_s"], 1e-9),
                "ttft_p99_thresholds": [fast_shared["affinity_label"], fast_split["affinity_label"]],
            }
    return per, best


SCALE_KEYS = ("throughput_per_gpu", "throughput_per_gpu_computed", "reuse_ratio", "trace_bound", "pool_share",
              "ttft_p50_s", "ttft_p99_s", "cross_server_gbps_per_nic", "nic_use", "nic_use_peak",
              "master_ops_per_s", "master_capacity_ops_per_s", "master_utilization", "lookup_wait_p99_ms",
              "master_lookups_per_s", "master_puts_per_s", "master_evictions_per_s")


STRICT_KEYS = ("throughput_per_gpu", "reuse_ratio", "pool_share", "ttft_p50_s", "ttft_p99_s", "turns_per_s",
               "master_utilization", "nic_use")


def final_object(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The last JSON line: the seed's comparisons, the calibration run and the scale-out, from the runs' figures."""
    by_label = {r["label"]: r for r in results}
    ratios, best = shared_over_split(results)
    simulated = sum(r["duration_s"] for r in results)
    out: dict[str, Any] = {
        "shared_over_split": ratios,
        "shared_over_split_best": best,
        "sim_speed": simulated / max(wall_s, 1e-9),
        "sim_speed_per_run": {r["label"]: round(r["sim_speed"], 1) for r in results},
        "wall_s": wall_s,
    }
    if "calibration" in by_label:
        c = by_label["calibration"]
        out["calibration"] = {k: c[k] for k in (
            "throughput_per_gpu", "throughput_per_gpu_computed", "reuse_ratio", "trace_bound", "pool_share",
            "ttft_p50_s", "restore_p50_ms", "decode_kv_use_p50", "stage_spread_mean_s", "trace_policy")}
    out["scale_out"] = {}
    for r in results:  # each size's shared run without the failure, against both split baselines
        if not (r["label"].startswith("scale-") and r["label"].endswith("-nofail")):
            continue
        n = r["servers"]
        out["scale_out"][str(n)] = scale_row(r, by_label.get(f"scale-{n}-split"),
                                             by_label.get(f"scale-{n}-split-strict"))
    for r in results:
        base = by_label.get(f"{r['label']}-nofail")
        if not r["label"].startswith("scale-") or base is None:
            continue
        figures = out["scale_out"][str(r["servers"])]
        figures["dropped_objects"] = r["dropped_objects"]
        figures.update(failure_figures(r["windows"], base["windows"], r["fail_at_s"], r["window_s"]))
    capacity = capacity_rows(results)
    if capacity:
        out["capacity"] = capacity
    for r in results:  # strict affinity at scale: shared against split, each from its own run
        split = by_label.get(f"scale-{r['servers']}-split-strict")
        if r["label"] != f"scale-{r['servers']}-strict" or split is None:
            continue
        out["scale_out"].setdefault(str(r["servers"]), {})["strict"] = {
            "shared_over_split": r["throughput_per_gpu"] / max(split["throughput_per_gpu"], 1e-9),
            **{k: r[k] for k in STRICT_KEYS}, **{f"split_{k}": split[k] for k in STRICT_KEYS}}
    return out


def _over(shared: dict[str, Any], split: dict[str, Any] | None) -> float | None:
    return None if split is None else shared["throughput_per_gpu"] / max(split["throughput_per_gpu"], 1e-9)


# what a server count's pool can be limited by: each resource's busy share in the shared run
LIMITS = ("master_busy", "prefill_busy", "nic_busy")


def scale_row(shared: dict[str, Any], split: dict[str, Any] | None, strict: dict[str, Any] | None) -> dict[str, Any]:
    """One server count: the shared pool's run (the router's affinity) against the split pools with sessions
    moving (``split``, the same affinity) and kept home (``strict``); ``steady`` when all three settled;
    ``limit``: the resource nearest saturation in the shared run (master, prefill or the busiest NIC)."""
    row: dict[str, Any] = {k: shared[k] for k in SCALE_KEYS}
    row.update(servers=shared["servers"], shards=shared["masters"], sessions_per_server=shared["sessions_per_server"],
               master_busy=shared["master_utilization"], prefill_busy=shared["prefill_busy"],
               nic_busy=shared["nic_use_peak"],
               shared_over_split_moving=_over(shared, split), shared_over_split_strict=_over(shared, strict),
               steady=all(r is not None and r.get("steady", False) for r in (shared, split, strict)),
               steady_runs={label: r.get("steady", False) for label, r in
                            (("shared", shared), ("split", split), ("split_strict", strict)) if r is not None},
               duration_s=shared["duration_s"], warmup_s=shared["warmup_s"])
    row["shared_over_split"] = row["shared_over_split_moving"]
    if split is not None:
        row["split_master_utilization"] = split["master_utilization"]
    row["limit"] = max(LIMITS, key=lambda k: row[k])
    return row


def capacity_rows(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The capacity scenario per sessions a server: shared over split (moving and strict), and whether the split
    side's stores evicted (its masters' evictions a second and pool use) while the shared one's did not."""
    by_label = {r["label"]: r for r in results}
    out: dict[str, Any] = {}
    for r in results:
        parts = r["label"].split("-")
        if parts[0] != "capacity" or parts[2:] != ["shared"]:
            continue
        split, strict = by_label.get(f"capacity-{parts[1]}-split"), by_label.get(f"capacity-{parts[1]}-split-strict")
        row: dict[str, Any] = {"servers": r["servers"], "sessions_per_server": r["sessions_per_server"],
                               "shared_over_split_moving": _over(r, split),
                               "shared_over_split_strict": _over(r, strict),
                               "steady": all(x is not None and x.get("steady", False) for x in (r, split, strict))}
        for side, x in (("shared", r), ("split", split), ("split_strict", strict)):
            if x is not None:
                row[side] = {k: x[k] for k in ("throughput_per_gpu", "reuse_ratio", "pool_share", "device_share",
                                                "ttft_p50_s", "pool_use_p50", "master_evictions_per_s", "steady",
                                                "prefill_busy", "master_utilization", "decode_kv_reserved_p50",
                                                "errors", "turns_per_s", "settling")}
                row[side]["arrivals"] = x["trace_policy"]["arrivals"]
        row["split_evicts"] = bool(strict is not None and strict["master_evictions_per_s"] > 0)
        out[parts[1]] = row
    return out


def failure_figures(failed: list[dict[str, float]], base: list[dict[str, float]], fail_at: float,
                    window_s: float) -> dict[str, float]:
    """What one server's stores dying costs: the run with the failure against its twin without it.

    Both runs are identical until ``fail_at`` (the simulation is deterministic), so the difference of
    their per-window reuse after it is the failure's doing. ``fail_hit_loss``: the largest drop (points
    of prompt reuse in one window); ``fail_lost_share``: the drop averaged over the windows after the
    failure; ``fail_recovery_s``: from the failure to the end of the first window, from the largest drop
    on, within 1 point of the twin (-1: not within the run).
    """
    reuse = {w["t"]: w["reuse"] for w in base}
    drops = [(w["t"], reuse[w["t"]] - w["reuse"]) for w in failed if w["t"] >= fail_at and w["t"] in reuse]
    if not drops:
        return {"fail_hit_loss": 0.0, "fail_lost_share": 0.0, "fail_recovery_s": 0.0, "fail_throughput_loss": 0.0}
    done = {w["t"]: w.get("tokens_done", 0) for w in base}
    after = sum(w.get("tokens_done", 0) for w in failed if w["t"] >= fail_at)
    before = sum(v for t, v in done.items() if t >= fail_at)
    worst = max(range(len(drops)), key=lambda i: drops[i][1])
    recovery = next((t + window_s - fail_at for t, d in drops[worst:] if d < 0.01), -1.0)
    return {"fail_hit_loss": drops[worst][1], "fail_lost_share": sum(d for _, d in drops) / len(drops),
            "fail_recovery_s": recovery, "fail_throughput_loss": 1 - after / before if before else 0.0}


def plot(results: list[dict[str, Any]], directory: Path | str) -> list[Path]:
    """PNGs (matplotlib, Agg): throughput and TTFT p99 by affinity threshold, shared against split, per
    reading; reuse per minute in the runs where a server's stores die."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    seed = [r for r in results if r.get("reading")]
    for reading in sorted({r["reading"] for r in seed}):
        for key, title in (("throughput_per_gpu", "tokens/s per GPU"), ("ttft_p99_s", "TTFT p99 (s)")):
            fig, ax = plt.subplots(figsize=(6, 4))
            for n in sorted({r["seed_sessions"] for r in seed if r["reading"] == reading}):
                for pool, style in (("shared", "-"), ("split", "--")):
                    rows = [r for r in seed if r["reading"] == reading and r["seed_sessions"] == n
                            and r["pool"] == pool]
                    ax.plot([r["affinity_label"] for r in rows], [r[key] for r in rows], style, marker="o",
                            label=f"{n} sessions, {pool}")
            ax.set_xlabel("router affinity threshold")
            ax.set_title(f"{title}, 4 servers, sessions {reading.replace('_', ' ')}")
            ax.legend(fontsize=7)
            path = directory / f"{key}_{reading}.png"
            fig.savefig(path, dpi=100, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    for r in (r for r in results if r.get("windows") and r.get("fail_at_s") is not None):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([w["t"] for w in r["windows"]], [w["reuse"] for w in r["windows"]], label="reuse")
        ax.plot([w["t"] for w in r["windows"]], [w["pool_share"] for w in r["windows"]], label="pool share")
        ax.axvline(r["fail_at_s"], color="red", ls=":", label="server 0's stores die")
        ax.set_xlabel("simulated s")
        ax.set_title(f"{r['servers']} servers, shared pool")
        ax.legend()
        path = directory / f"failure_{r['servers']}_servers.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
