"""What a simulated run counts, and its summary as plain numbers.

Invariants: ``device + pool + computed == prompt`` tokens over the turns
whose prefill ended (the core's plan guarantees it per request). Everything
reported counts only after ``warmup_s``: token shares, reuse and its bound
over the turns whose prefill ended after it (``counted_*``); throughput over
the turns whose decode ended after it; TTFT over turns that arrived after
it; restore, spread and queueing times and the sampled utilisations over
what happened after it. ``turn_tokens`` keeps every turn (the validation
compares them one by one).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from kvpool.tools.sim.job import Job


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass(slots=True)
class Metrics:
    warmup_s: float
    window_s: float
    now: Any = None  # the loop's clock
    # every turn prefilled
    turns_prefilled: int = 0
    write_back_chunks: int = 0
    # turns prefilled after warm-up: [prompt, device, pool, computed] tokens
    counted: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    # turns whose decode ended after warm-up
    window_prompt_tokens: int = 0
    window_output_tokens: int = 0
    window_computed_tokens: int = 0
    turns_done: int = 0
    counted_turns: int = 0  # turns prefilled after warm-up
    ttft_s: list[float] = field(default_factory=list)
    # per counted turn: its TTFT and its parts (queue, lookup, restore, after the restore: compute and handoff,
    # then decode: the wait for the batch and the first step)
    ttft_parts: list[tuple[float, float, float, float, float, float]] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)
    restore_tokens: list[int] = field(default_factory=list)
    spread_s: list[float] = field(default_factory=list)  # first stage starts -> last stage finishes
    prefill_busy_s: float = 0.0  # stage 0's time from a request's admission to its own compute's end
    compute_s: float = 0.0  # of which computing
    decode_s: list[float] = field(default_factory=list)  # first token -> last token
    first_token_wait_s: list[float] = field(default_factory=list)  # handoff's end -> first decoded token
    think_s: list[float] = field(default_factory=list)  # each think scheduled after warm-up
    lookup_wait_s: list[float] = field(default_factory=list)  # a lookup's time at its master, queue + service
    decode_use: list[float] = field(default_factory=list)  # filled pages / all pages, per shard and sample
    decode_reserved: list[float] = field(default_factory=list)  # pages reserved for admitted sequences / all
    prefill_queue: list[int] = field(default_factory=list)
    decode_waiting: list[int] = field(default_factory=list)
    pool_use: list[float] = field(default_factory=list)
    # the masters' work
    master_lookups: int = 0
    put_objects: int = 0
    put_committed: int = 0
    evicted_groups: int = 0
    # turns prefilled after warm-up by where they ran for their session (``Job.placed_as``):
    # [turns, prompt, device, pool] tokens
    by_placement: dict[str, list[int]] = field(default_factory=dict)
    # per turn, in prefill order: (job id, device, pool, computed) tokens
    turn_tokens: list[tuple[str, int, int, int]] = field(default_factory=list)
    # per window: [device, pool, computed] prompt tokens of turns prefilled in it
    windows: dict[int, list[int]] = field(default_factory=dict)
    done_windows: dict[int, int] = field(default_factory=dict)  # prompt + output tokens of turns ending in it

    def after_warmup(self) -> bool:
        return self.now() >= self.warmup_s

    def on_prefill_start(self, job: Job) -> None:
        if self.after_warmup():
            self.queue_s.append(job.prefill_start - job.arrival)

    def on_lookup(self, seconds: float) -> None:
        self.master_lookups += 1
        if self.after_warmup():
            self.lookup_wait_s.append(seconds)

    def on_restore(self, seconds: float, num_chunks: int) -> None:
        if num_chunks and self.after_warmup():
            self.restore_s.append(seconds)
            self.restore_tokens.append(num_chunks)

    def on_stage0_done(self, seconds: float) -> None:
        if self.after_warmup():
            self.prefill_busy_s += seconds

    def on_prefill_end(self, job: Job) -> None:
        request = job.request
        assert request is not None
        self.turns_prefilled += 1
        self.write_back_chunks += request.num_write_back_chunks
        counts = (request.num_device_tokens, request.num_pool_tokens, request.num_computed_tokens)
        self.turn_tokens.append((job.job_id, *counts))
        if self.after_warmup():
            self.counted_turns += 1
            self.spread_s.append(self.now() - job.prefill_start)
            self.compute_s += job.compute_s
            for i, n in enumerate((request.num_tokens, *counts)):
                self.counted[i] += n
            placed = self.by_placement.setdefault(job.placed_as, [0, 0, 0, 0])
            for i, n in enumerate((1, request.num_tokens, *counts[:2])):
                placed[i] += n
        window = self.windows.setdefault(int(self.now() // self.window_s), [0, 0, 0])
        for i, n in enumerate(counts):
            window[i] += n

    def on_first_token(self, job: Job) -> None:
        job.first_token_at = self.now()
        if job.arrival >= self.warmup_s:
            self.first_token_wait_s.append(self.now() - job.handed_off_at)
            self.ttft_s.append(self.now() - job.arrival)
            self.ttft_parts.append((self.now() - job.arrival, job.prefill_start - job.arrival,
                                    job.restore_start - job.prefill_start, job.restored_at - job.restore_start,
                                    job.handed_off_at - job.restored_at, self.now() - job.handed_off_at))

    def on_decode_done(self, job: Job) -> None:
        window = int(self.now() // self.window_s)
        self.done_windows[window] = self.done_windows.get(window, 0) + job.turn.input_tokens + job.turn.output_tokens
        if self.after_warmup():
            self.turns_done += 1
            self.decode_s.append(self.now() - job.first_token_at)
            self.window_prompt_tokens += job.turn.input_tokens
            self.window_output_tokens += job.turn.output_tokens
            if job.request is not None:
                self.window_computed_tokens += job.request.num_computed_tokens

    def on_save(self, num_objects: int, num_committed: int, num_evicted: int) -> None:
        self.put_objects += num_objects
        self.put_committed += num_committed
        self.evicted_groups += num_evicted

    # ---- summary ----------------------------------------------------------

    @property
    def prompt_tokens(self) -> int:
        return self.counted[0]

    def shares(self) -> dict[str, float]:
        total, device, pool, computed = self.counted
        total = total or 1
        return {
            "device_share": device / total,
            "pool_share": pool / total,
            "computed_share": computed / total,
            "reuse_ratio": (device + pool) / total,
        }

    def placements(self) -> dict[str, dict[str, float]]:
        """Per kind of placement: its share of the counted turns and of their prompt tokens, and the share
        of its own prompt tokens the device and the pool served."""
        turns, prompt = max(1, self.counted_turns), max(1, self.prompt_tokens)
        return {kind: {"turn_share": n / turns, "prompt_share": tokens / prompt,
                       "device_share": device / max(1, tokens), "pool_share": pool / max(1, tokens)}
                for kind, (n, tokens, device, pool) in sorted(self.by_placement.items())}

    def window_series(self) -> list[dict[str, float]]:
        series = []
        for index in sorted(self.windows):
            device, pool, computed = self.windows[index]
            total = device + pool + computed or 1
            series.append({"t": index * self.window_s, "reuse": (device + pool) / total, "pool_share": pool / total,
                           "prompt_tokens": device + pool + computed, "tokens_done": self.done_windows.get(index, 0)})
        return series

    @staticmethod
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0


# The settling rule: a run counts once its pool share has settled. Its counted span (after the warm-up) is cut in
# two halves of its whole windows; the pool share of each half (their prompt tokens the pool served, over their
# prompt tokens) may differ by at most SETTLE_POINTS, and the span must be at least SETTLE_MIN_S long. A share
# still climbing (the one-server runs' climbs for ~20 minutes after a cold start) differs between the halves.
SETTLE_POINTS = 0.03
SETTLE_MIN_S = 1200.0


def settling(windows: list[dict[str, float]], warmup_s: float, duration_s: float,
             window_s: float) -> dict[str, Any]:
    """The settling rule over a run's windows (``Metrics.window_series``): ``steady`` when it holds."""
    counted = [w for w in windows if w["t"] >= warmup_s and w["t"] + window_s <= duration_s]
    half = len(counted) // 2
    halves = [counted[:half], counted[len(counted) - half:]] if half else [[], []]
    shares = []
    for part in halves:
        tokens = sum(w.get("prompt_tokens", 0.0) for w in part)
        shares.append(sum(w["pool_share"] * w.get("prompt_tokens", 0.0) for w in part) / tokens if tokens else 0.0)
    span = len(counted) * window_s
    moved = abs(shares[1] - shares[0])
    return {"rule": f"pool share of the counted span's two halves within {SETTLE_POINTS:.0%} points, span >= "
                    f"{SETTLE_MIN_S:.0f} s", "counted_s": span, "windows": len(counted),
            "pool_share_first_half": shares[0], "pool_share_second_half": shares[1], "moved": moved,
            "steady": bool(span >= SETTLE_MIN_S and half and moved <= SETTLE_POINTS)}


def ttft_breakdown(parts: list[tuple[float, float, float, float, float, float]]) -> dict[str, dict[str, float]]:
    """Where turns' TTFT goes, as mean seconds of each part: over all counted turns, the turns around the
    median (TTFT between its 40th and 60th percentiles) and the slowest (at or above the 99th). TTFT ends at
    the first decoded token: ``first_token_s`` is from the handoff's end to it (decode's queue and first step)."""
    ttfts = sorted(p[0] for p in parts)

    def band(lo: float, hi: float) -> dict[str, float]:
        rows = [p for p in parts if lo <= p[0] <= hi]
        n = max(1, len(rows))
        return {"turns": len(rows), "ttft_s": sum(r[0] for r in rows) / n, "queue_s": sum(r[1] for r in rows) / n,
                "lookup_s": sum(r[2] for r in rows) / n, "restore_s": sum(r[3] for r in rows) / n,
                "after_restore_s": sum(r[4] for r in rows) / n, "first_token_s": sum(r[5] for r in rows) / n}

    if not ttfts:
        return {}
    return {"all": band(-math.inf, math.inf), "p40_p60": band(percentile(ttfts, 40), percentile(ttfts, 60)),
            "p99_up": band(percentile(ttfts, 99), math.inf)}

