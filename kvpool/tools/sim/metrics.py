"""What a simulated run counts, and its summary as plain numbers.

Invariants: ``device + pool + computed == prompt`` tokens over the turns
whose prefill ended (the core's plan guarantees it per request); token
shares and reuse count every turn of the run (the trace bound is over the
same turns); throughput, TTFT, queueing, restore times and the sampled
utilisations count only after ``warmup_s``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.tools.sim.prefill_sim import Job, PipelineSim


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
    prompt_tokens: int = 0
    device_tokens: int = 0
    pool_tokens: int = 0
    computed_tokens: int = 0
    turns_prefilled: int = 0
    write_back_chunks: int = 0
    # after warm-up
    window_prompt_tokens: int = 0
    window_output_tokens: int = 0
    turns_done: int = 0
    ttft_s: list[float] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)
    restore_tokens: list[int] = field(default_factory=list)
    decode_use: list[float] = field(default_factory=list)
    prefill_queue: list[int] = field(default_factory=list)
    decode_waiting: list[int] = field(default_factory=list)
    pool_use: list[float] = field(default_factory=list)
    refused: int = 0
    # the masters' work
    master_lookups: int = 0
    put_objects: int = 0
    put_committed: int = 0
    evicted_groups: int = 0
    # bytes that crossed between servers, by host: sent and received
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    # per turn, in prefill order: (job id, device, pool, computed) tokens
    turn_tokens: list[tuple[str, int, int, int]] = field(default_factory=list)
    # per window: [device, pool, computed] prompt tokens of turns prefilled in it
    windows: dict[int, list[int]] = field(default_factory=dict)

    def _after_warmup(self) -> bool:
        return self.now() >= self.warmup_s

    def on_prefill_start(self, job: Job) -> None:
        if self._after_warmup():
            self.queue_s.append(job.prefill_start - job.arrival)

    def on_restore(self, seconds: float, num_chunks: int) -> None:
        if num_chunks and self._after_warmup():
            self.restore_s.append(seconds)
            self.restore_tokens.append(num_chunks)

    def on_prefill_end(self, job: Job, pipeline: PipelineSim) -> None:
        request = job.request
        assert request is not None
        self.turns_prefilled += 1
        self.prompt_tokens += request.num_tokens
        self.device_tokens += request.num_device_tokens
        self.pool_tokens += request.num_pool_tokens
        self.computed_tokens += request.num_computed_tokens
        self.write_back_chunks += request.num_write_back_chunks
        self.turn_tokens.append(
            (job.job_id, request.num_device_tokens, request.num_pool_tokens, request.num_computed_tokens)
        )
        window = self.windows.setdefault(int(self.now() // self.window_s), [0, 0, 0])
        window[0] += request.num_device_tokens
        window[1] += request.num_pool_tokens
        window[2] += request.num_computed_tokens

    def on_first_token(self, job: Job) -> None:
        if job.arrival >= self.warmup_s:
            self.ttft_s.append(self.now() - job.arrival)

    def on_decode_done(self, job: Job) -> None:
        if self._after_warmup():
            self.turns_done += 1
            self.window_prompt_tokens += job.turn.input_tokens
            self.window_output_tokens += job.turn.output_tokens

    def on_save(self, num_objects: int, num_committed: int, num_evicted: int) -> None:
        self.put_objects += num_objects
        self.put_committed += num_committed
        self.evicted_groups += num_evicted

    def cross_bytes(self, host: str, by_peer: dict[str, int]) -> None:
        """Bytes between ``host`` and each peer (either direction crosses both NICs)."""
        total = sum(by_peer.values())
        self.sent[host] = self.sent.get(host, 0) + total
        for peer, nbytes in by_peer.items():
            self.received[peer] = self.received.get(peer, 0) + nbytes

    # ---- summary ----------------------------------------------------------

    def shares(self) -> dict[str, float]:
        total = self.prompt_tokens or 1
        return {
            "device_share": self.device_tokens / total,
            "pool_share": self.pool_tokens / total,
            "computed_share": self.computed_tokens / total,
            "reuse_ratio": (self.device_tokens + self.pool_tokens) / total,
        }

    def window_series(self) -> list[dict[str, float]]:
        series = []
        for index in sorted(self.windows):
            device, pool, computed = self.windows[index]
            total = device + pool + computed or 1
            series.append({"t": index * self.window_s, "reuse": (device + pool) / total, "pool_share": pool / total})
        return series

    @staticmethod
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0
