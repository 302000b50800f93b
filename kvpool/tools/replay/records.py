"""What a replay is asked to do and what it brings back: its options, one record per request, the result.

Plain values shared by the engine (which fills them) and the report (which
reads them), so neither has to import the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.tools.replay.probes import Metrics

CHUNK_SIZE = 256  # the prefill stages' default chunk size


@dataclass(slots=True, frozen=True)
class ReplayOptions:
    """How to replay: load, time compression, bounds of the run."""

    concurrency: int = 1
    think_scale: float = 1.0
    duration_s: float | None = None
    model: str = ""  # "" asks the router's /v1/models
    chunk_size: int = CHUNK_SIZE
    request_timeout_s: float = 600.0
    progress: bool = False
    # session-aware prefill's hints on every turn: expected_next_s (the next turn's think time as replayed),
    # session_end on a session's last turn
    session_hints: bool = False

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if self.think_scale < 0:
            raise ValueError(f"think_scale: must be >= 0, got {self.think_scale}")


@dataclass(slots=True)
class TurnRecord:
    """One request as the client saw it, with the router's ``usage.kvpool`` figures."""

    session_id: str
    turn: int  # index in the session's kept turns
    agent_id: str | None
    issue_index: int
    prompt_tokens: int
    max_tokens: int
    issued_at: float = 0.0  # seconds since the replay started
    latency_s: float = 0.0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    device_tokens: int = 0
    pool_tokens: int = 0
    computed_tokens: int = 0
    handoff_transfers: int = 0
    handoff_bytes: int = 0
    server_ttft_s: float = 0.0
    pipeline: str = ""
    shard: str = ""
    error: str | None = None
    status: int = 0  # the HTTP status of a refused request; 0: none (an error event, a transport error)
    lost: bool = False  # the stream ended without [DONE] or usage and without saying it failed
    text: str = ""  # the answer as streamed


@dataclass(slots=True)
class ReplayResult:
    """One replay at one concurrency: per-request records, service figures, and the summary of it all."""

    concurrency: int
    wall_s: float
    records: list[TurnRecord]
    metrics_before: dict[str, Metrics] = field(default_factory=dict)
    metrics_after: dict[str, Metrics] = field(default_factory=dict)
    pool: dict[str, Any] | None = None
    decode_utilization: list[float] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0  # time.perf_counter() when the first session started

    @property
    def errors(self) -> int:
        return sum(r.error is not None for r in self.records)
