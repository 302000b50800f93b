"""The simulator's outputs: the run matrix, a table, the final JSON object, PNG plots.

The matrix follows the seed: shared vs split pools at 32, 64, 96 and 112
sessions per server on 4 servers, a single-server calibration run, and the
pool past four servers (8, 16, 32 servers, shared, one server's stores dying
mid-run). Session counts are per server: the seed's single server carries
96-112 sessions, and its 4-server comparison is at the same load per server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED_SESSIONS = (32, 64, 96, 112)
SCALE_SERVERS = (8, 16, 32)


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


def matrix(duration_s: float, scale_duration_s: float, quick: bool, scale_sessions: int = 56) -> list[RunSpec]:
    """The runs; the scale-out's store failure comes at two thirds of its duration (after warm-up)."""
    if quick:
        return [
            RunSpec("calibration", 1, 16, "shared", duration_s),
            *(RunSpec(f"seed-{pool}-16", 2, 16, pool, duration_s) for pool in ("shared", "split")),
            RunSpec("scale-4", 4, 8, "shared", scale_duration_s, scale_duration_s * 2 / 3),
            RunSpec("scale-4-nofail", 4, 8, "shared", scale_duration_s),
        ]
    specs = [RunSpec("calibration", 1, 112, "shared", duration_s)]
    for n in SEED_SESSIONS:
        specs += [RunSpec(f"seed-{pool}-{n}", 4, n, pool, duration_s) for pool in ("shared", "split")]
    for s in SCALE_SERVERS:  # each with its twin without the failure: the loss is their difference
        specs += [RunSpec(f"scale-{s}", s, scale_sessions, "shared", scale_duration_s, scale_duration_s * 2 / 3),
                  RunSpec(f"scale-{s}-nofail", s, scale_sessions, "shared", scale_duration_s)]
    return specs


COLUMNS = (
    ("run", "label", "{}"), ("srv", "servers", "{}"), ("sess/srv", "sessions_per_server", "{}"),
    ("pool", "pool", "{}"), ("tok/s/GPU", "throughput_per_gpu", "{:,.0f}"), ("reuse", "reuse_ratio", "{:.1%}"),
    ("bound", "trace_bound", "{:.1%}"), ("device", "device_share", "{:.1%}"), ("pool%", "pool_share", "{:.1%}"),
    ("computed", "computed_share", "{:.1%}"), ("TTFT p50", "ttft_p50_s", "{:.2f}s"), ("p90", "ttft_p90_s", "{:.2f}s"),
    ("restore", "restore_p50_ms", "{:.0f}ms"), ("dec KV", "decode_kv_use_p50", "{:.0%}"),
    ("queue p90", "queue_p90_s", "{:.2f}s"), ("x-srv GB/s/NIC", "cross_server_gbps_per_nic", "{:.2f}"),
    ("lookups/s", "master_lookups_per_s", "{:.1f}"), ("puts/s", "master_puts_per_s", "{:,.0f}"),
    ("evict/s", "master_evictions_per_s", "{:.1f}"), ("sim x", "sim_speed", "{:.0f}"),
)


def table(results: list[dict[str, Any]]) -> str:
    rows = [[title for title, _, _ in COLUMNS]]
    for r in results:
        rows.append([fmt.format(r.get(key, "")) if key in r else "-" for _, key, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def final_object(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The last JSON line: the seed's comparisons and the scale-out, from the runs' figures."""
    by_label = {r["label"]: r for r in results}
    ratios: dict[str, float] = {}
    for r in results:
        if r["label"].startswith("seed-shared-"):
            split = by_label.get(f"seed-split-{r['sessions_per_server']}")
            if split and split["throughput_per_gpu"] > 0:
                ratios[str(r["sessions_per_server"])] = r["throughput_per_gpu"] / split["throughput_per_gpu"]
    shared = [r for r in results if r["label"].startswith("seed-shared-")]
    top = max(shared, key=lambda r: r["sessions_per_server"]) if shared else results[0]
    simulated = sum(r["duration_s"] for r in results)
    keys = ("throughput_per_gpu", "reuse_ratio", "trace_bound", "pool_share", "ttft_p50_s", "restore_p50_ms",
            "decode_kv_use_p50")
    out: dict[str, Any] = {
        "shared_over_split": ratios,
        "sessions_per_server": top["sessions_per_server"],
        "reuse_ratio": top["reuse_ratio"], "trace_bound": top["trace_bound"], "pool_share": top["pool_share"],
        "device_share": top["device_share"], "computed_share": top["computed_share"],
        "ttft_p50_s": top["ttft_p50_s"], "ttft_p90_s": top["ttft_p90_s"],
        "sim_speed": simulated / max(wall_s, 1e-9),
        "sim_speed_per_run": {r["label"]: round(r["sim_speed"], 1) for r in results},
        "wall_s": wall_s,
    }
    if "calibration" in by_label:
        out["calibration"] = {k: by_label["calibration"][k] for k in keys}
    out["scale_out"] = {}
    for r in results:
        base = by_label.get(f"{r['label']}-nofail")
        if not r["label"].startswith("scale-") or base is None:
            continue
        figures = {k: base[k] for k in (
            "throughput_per_gpu", "reuse_ratio", "pool_share", "cross_server_gbps_per_nic", "master_lookups_per_s",
            "master_puts_per_s", "master_evictions_per_s")}
        figures["dropped_objects"] = r["dropped_objects"]
        figures.update(failure_figures(r["windows"], base["windows"], r["fail_at_s"], r["window_s"]))
        out["scale_out"][str(r["servers"])] = figures
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
        return {"fail_hit_loss": 0.0, "fail_lost_share": 0.0, "fail_recovery_s": 0.0}
    worst = max(range(len(drops)), key=lambda i: drops[i][1])
    recovery = next((t + window_s - fail_at for t, d in drops[worst:] if d < 0.01), -1.0)
    return {"fail_hit_loss": drops[worst][1], "fail_lost_share": sum(d for _, d in drops) / len(drops),
            "fail_recovery_s": recovery}


def plot(results: list[dict[str, Any]], directory: Path | str) -> list[Path]:
    """PNGs of the matrix (matplotlib, Agg): one figure per figure of merit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    seed = [r for r in results if r["label"].startswith("seed-")]
    for key, title in (("throughput_per_gpu", "throughput per GPU (tokens/s)"), ("reuse_ratio", "prompt reuse"),
                       ("pool_share", "pool share of prompt tokens"), ("ttft_p50_s", "TTFT p50 (s)"),
                       ("ttft_p90_s", "TTFT p90 (s)"), ("restore_p50_ms", "restore per GPU p50 (ms)"),
                       ("decode_kv_use_p50", "decode KV use p50"), ("queue_p90_s", "prefill queueing p90 (s)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for pool in ("shared", "split"):
            rows = sorted((r for r in seed if r["pool"] == pool), key=lambda r: r["sessions_per_server"])
            ax.plot([r["sessions_per_server"] for r in rows], [r[key] for r in rows], marker="o", label=pool)
        if key == "reuse_ratio":
            rows = sorted((r for r in seed if r["pool"] == "shared"), key=lambda r: r["sessions_per_server"])
            ax.plot([r["sessions_per_server"] for r in rows], [r["trace_bound"] for r in rows], ls="--",
                    label="trace bound")
        ax.set_xlabel("sessions per server (4 servers)")
        ax.set_title(title)
        ax.legend()
        path = directory / f"{key}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    seeds = sorted((r for r in seed if r["pool"] == "shared"), key=lambda r: r["sessions_per_server"])
    if seeds:
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [r["sessions_per_server"] for r in seeds]
        bottom = [0.0] * len(seeds)
        for key in ("device_share", "pool_share", "computed_share"):
            values = [r[key] for r in seeds]
            ax.bar([str(v) for v in x], values, bottom=bottom, label=key.removesuffix("_share"))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title("prompt tokens by source (shared pool, 4 servers)")
        ax.legend()
        path = directory / "token_sources.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    for r in (r for r in results if r.get("windows") and r.get("fail_at_s") is not None):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([w["t"] for w in r["windows"]], [w["reuse"] for w in r["windows"]], label="reuse")
        ax.plot([w["t"] for w in r["windows"]], [w["pool_share"] for w in r["windows"]], label="pool share")
        if r.get("fail_at_s") is not None:
            ax.axvline(r["fail_at_s"], color="red", ls=":", label="server 0's stores die")
        ax.set_xlabel("simulated s")
        ax.set_title(f"{r['servers']} servers, shared pool")
        ax.legend()
        path = directory / f"failure_{r['servers']}_servers.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
