"""``kvpool simulate --calibrate``: fit four of the cost model's ``[fit]`` inputs to the seed's single server.

The seed's one 8-GPU server at 112 sessions: ~44K tokens/s per GPU, the pool
serving 46% of prompt tokens, decode KV a median 91% full, TTFT p50 ~7 s with
requests queueing in front of prefill, reuse above 95% close to the traces'
bound. Four inputs, each moving mainly one figure, are fitted by a damped
fixed-point iteration (each step is one simulated run; no gradient, no grid):

- ``device_kv_gib_per_gpu`` → the device's share of prompt tokens, hence the
  pool's. The share falls off a cliff once the device LRU holds less than
  the sessions' live history (each history is evicted just before its
  session returns), so this input is found by bisection on a bracket;
- ``prefill_level`` → throughput: at saturation the server serves what its
  prefill pipeline can, so the compute time per turn is set to what the
  target rate leaves after the lookup and the restore;
- ``decode_kv_gib_per_gpu`` → decode KV use, the pages the shards hold: a
  turn's pages are held from its router ticket, before prefill, to its last
  token, so the pages held are rate × (queue + prefill + decode time) × a
  turn's pages (Little's law), whatever the capacity, while the router's queue
  is empty; the capacity is set to hold them at 91%. Full (the router's queue
  holds turns back), the capacity grows by a damped step;
- ``think_scale`` → TTFT: the closed loop's cycle (112 sessions / rate) is
  think + TTFT + decode, so the think time left is what makes TTFT 7 s.

``decode_level`` is not fitted (1: the decode step is the hardware's). A
step sees only its run's ``fit_view`` (the four fitted figures and what
steers the step). Checked, not fitted, and read only once the fit is frozen:
96 sessions (throughput within 10% of 44K, TTFT below 112's), the restore
p50 and the first-to-last stage time against the seed's ranges (×1.5), the
queue in front of prefill, reuse and its distance from the trace bound, and
both runs steady by the settling rule (``metrics.settling``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvpool.tools.sim.cost_model import CostModel, FitInputs

SEED_TOKENS_PER_S_PER_GPU = 44_000.0
GPUS_PER_SERVER = 8


@dataclass(frozen=True, slots=True)
class Target:
    """One figure: ``key`` in a run's summary, the seed's value and what counts as within."""

    name: str
    key: str
    seed: str
    check: Callable[[float], bool]
    fitted: bool = True


def _within(lo: float, hi: float) -> Callable[[float], bool]:
    return lambda v: lo <= v <= hi


TARGETS_112 = (
    Target("tokens/s per GPU", "throughput_per_gpu", "44K ± 10%", _within(39_600, 48_400)),
    Target("pool share", "pool_share", "46% ± 8 points", _within(0.38, 0.54)),
    Target("decode KV use p50 (pages held)", "decode_kv_reserved_p50", "91% ± 5 points", _within(0.86, 0.96)),
    Target("TTFT p50 (to the first decoded token)", "ttft_p50_s", "~7 s within x1.5", _within(7 / 1.5, 7 * 1.5)),
    Target("prefill queue (mean, sampled)", "prefill_queue_mean", "non-empty: requests queue", lambda v: v > 0,
           fitted=False),
    Target("reuse", "reuse_ratio", "> 95%", lambda v: v > 0.95, fitted=False),
    Target("reuse below the trace bound", "bound_gap", "within 1 point", lambda v: 0 <= v <= 0.01, fitted=False),
    Target("restore p50", "restore_p50_ms", "150-220 ms within x1.5", _within(150 / 1.5, 220 * 1.5), fitted=False),
    Target("first stage start to last stage end (mean)", "stage_spread_mean_s", "0.4-1.2 s within x1.5",
           _within(0.4 / 1.5, 1.2 * 1.5), fitted=False),
)

# The fitted inputs, at most four, each with the one figure it is fitted to (every other figure is a check,
# read only after the fit is frozen: ``fit_view`` is all a step sees of its run)
FITTED = {"device_kv_gib_per_gpu": "pool_share", "prefill_level": "throughput_per_gpu",
          "decode_kv_gib_per_gpu": "decode_kv_reserved_p50", "think_scale": "ttft_p50_s"}
# what a fit step reads of its run: the fitted figures and what steers the step (saturation, the closed loop's
# parts); never a checked figure
_STEERING = ("prefill_busy", "ttft_mean_s", "think_mean_s")


def fit_view(run: dict[str, Any]) -> dict[str, float]:
    return {k: float(run[k]) for k in (*FITTED.values(), *_STEERING)}


def fitted_rows(fit: FitInputs, run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each fitted input with its value and the figure it was fitted to (its value at the frozen fit, its target)."""
    targets = {t.key: t for t in TARGETS_112}
    return [{"input": f"[fit] {name}", "value": getattr(fit, name), "fitted_to": key, "name": targets[key].name,
             "figure": float(run[key]), "target": targets[key].seed, "within": bool(targets[key].check(run[key]))}
            for name, key in FITTED.items()]


def figures(run: dict[str, Any]) -> dict[str, float]:
    out = {t.key: float(run.get(t.key, math.nan)) for t in TARGETS_112 if t.key != "bound_gap"}
    out["bound_gap"] = run["trace_bound"] - run["reuse_ratio"]
    return out


def verdict(run112: dict[str, Any], run96: dict[str, Any] | None) -> dict[str, Any]:
    """Each figure with its target and whether it is within; ``calibrated`` when every one is."""
    got = figures(run112)
    rows = {t.key: {"name": t.name, "value": got[t.key], "target": t.seed, "fitted": t.fitted,
                    "within": bool(t.check(got[t.key]))} for t in TARGETS_112}
    if run96 is not None:
        rows["throughput_per_gpu_96"] = {
            "name": "tokens/s per GPU at 96 sessions", "value": run96["throughput_per_gpu"], "target": "44K ± 10%",
            "fitted": False, "within": 39_600 <= run96["throughput_per_gpu"] <= 48_400}
        rows["ttft_p50_s_96"] = {
            "name": "TTFT p50 at 96 sessions", "value": run96["ttft_p50_s"], "target": "below 112 sessions'",
            "fitted": False, "within": run96["ttft_p50_s"] < run112["ttft_p50_s"]}
    steady = [r["steady"] for r in (run112, run96) if r is not None and "steady" in r]
    return {"calibrated": all(r["within"] for r in rows.values()) and all(steady), "figures": rows}


def fitted_within(view: dict[str, float]) -> bool:
    """The four fitted figures within their targets (``view``: a run's ``fit_view``)."""
    return all(t.check(view[t.key]) for t in TARGETS_112 if t.fitted)


@dataclass(slots=True)
class KvBracket:
    """Device KV per GPU known to give a pool share above (``low``: too little KV) or below (``high``) 46%."""

    low: float | None = None
    high: float | None = None

    def next(self, kv: float, pool_share: float) -> float:
        if pool_share > 0.46:
            self.low = kv if self.low is None else max(self.low, kv)
        else:
            self.high = kv if self.high is None else min(self.high, kv)
        if self.low is None:
            return kv * 0.985
        if self.high is None:
            return kv * 1.015
        return math.sqrt(self.low * self.high)


def next_fit(fit: FitInputs, run: dict[str, Any], cost: CostModel, bracket: KvBracket,
             damping: float = 0.6) -> FitInputs:
    """One step from a run at ``fit`` (see the module doc); the factors are damped and bounded."""

    def damp(factor: float, lo: float = 0.7, hi: float = 1.4) -> float:
        return min(hi, max(lo, factor)) ** damping

    # prefill: at saturation throughput is the pipeline's capacity, inversely proportional to its level;
    # below it, the load (think time) is what is short, so prefill stays
    saturated = run["prefill_busy"] > 0.95
    prefill = damp(run["throughput_per_gpu"] / SEED_TOKENS_PER_S_PER_GPU) if saturated else 1.0
    # device KV: bisection (the share is a cliff, not a line)
    device_kv = bracket.next(fit.device_kv_gib_per_gpu, run["pool_share"]) / fit.device_kv_gib_per_gpu
    # decode capacity: pages held = rate x time held x a turn's pages (Little's law), over capacity; when
    # saturated the prefill step brings the rate to 44K, so the capacity must hold 91% at that rate. Full (the
    # router's queue holds turns back), what they would hold is not seen: grow it
    rate_after = SEED_TOKENS_PER_S_PER_GPU if saturated else run["throughput_per_gpu"]
    held = run["decode_kv_reserved_p50"]
    decode_kv = (damp(held / 0.91 * rate_after / max(run["throughput_per_gpu"], 1e-9)) if held < 0.97
                 else damp(1.25))
    decode_kv_now = fit.decode_kv_gib_per_gpu or fit.device_kv_gib_per_gpu
    # think: TTFT is the closed loop's remainder (cycle - think - decode): move think by TTFT's excess
    ratio = min(1.3, max(1.0, run["ttft_mean_s"] / run["ttft_p50_s"])) if run["ttft_p50_s"] > 0 else 1.2
    excess = run["ttft_mean_s"] - 7.0 * ratio
    recorded_mean = run["think_mean_s"] / fit.think_scale if fit.think_scale > 0 else 238.0
    think_mean = max(0.0, run["think_mean_s"] + damping * excess)
    return replace(fit, device_kv_gib_per_gpu=fit.device_kv_gib_per_gpu * device_kv,
                   prefill_level=fit.prefill_level * prefill, decode_kv_gib_per_gpu=decode_kv_now * decode_kv,
                   think_scale=think_mean / recorded_mean)


def fit_toml(fit: FitInputs) -> str:
    return "\n".join(["[fit]", f"device_kv_gib_per_gpu = {fit.device_kv_gib_per_gpu:.4g}",
                      f"prefill_level = {fit.prefill_level:.4g}", f"decode_level = {fit.decode_level:.4g}",
                      f"think_scale = {fit.think_scale:.4g}",
                      f"decode_kv_gib_per_gpu = {fit.decode_kv_gib_per_gpu:.4g}"])
