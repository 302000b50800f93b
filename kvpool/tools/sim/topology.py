"""What the simulator runs: the cluster's shape and one run's settings.

Pure values. Invariants (checked on construction, ``ValueError`` naming the
field): every count and size positive; each server's GPUs are exactly its
prefill stages plus its decode GPUs; ``pool`` is ``shared`` or ``split``.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

GIB = 1 << 30
CONTEXT_AS_RECORDED = 1 << 20  # above every recorded prompt + output (the longest: 838K tokens): nothing is cut


@dataclass(frozen=True, slots=True)
class Topology:
    """Servers alike: ``pipelines_per_server`` pipelines of ``num_stages`` GPUs, then decode shards.

    Stores: one per NUMA node; store 0 is on the prefill side, the others on
    the decode side (the seed: the decode side holds no history in a split pool).
    """

    num_servers: int = 4
    gpus_per_server: int = 8
    num_stages: int = 4
    pipelines_per_server: int = 1
    gpus_per_decode_shard: int = 4
    # MI355X: 288 GB HBM - 168 GB of fp8 weights per GPU (671 GB / 4) - activations
    device_kv_gib_per_gpu: float = 100.0
    decode_kv_gib_per_gpu: float | None = None  # None: as much as a prefill GPU
    stores_per_server: int = 2
    store_gib: float = 768.0
    # one 400 Gb/s NIC's worth per server, shared by the transfers crossing it (``network.Network``)
    nic_gbps: float = 50.0
    decode_page_tokens: int = 64
    decode_max_batch: int = 256
    # the longest prompt + output a turn may have: DeepSeek-V3's max_position_embeddings, which cuts 9.5% of the
    # recorded prompts (``workload.fit_to_context``); CONTEXT_AS_RECORDED cuts none (``--max-context``)
    max_context: int = 163_840

    def __post_init__(self) -> None:
        for name in ("num_servers", "gpus_per_server", "num_stages", "pipelines_per_server",
                     "gpus_per_decode_shard", "stores_per_server", "decode_page_tokens", "decode_max_batch",
                     "max_context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"topology.{name}: must be positive, got {getattr(self, name)}")
        for name in ("device_kv_gib_per_gpu", "store_gib", "nic_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"topology.{name}: must be positive, got {getattr(self, name)}")
        decode_gpus = self.gpus_per_server - self.pipelines_per_server * self.num_stages
        if decode_gpus <= 0 or decode_gpus % self.gpus_per_decode_shard:
            raise ValueError(
                f"topology.gpus_per_decode_shard: {decode_gpus} decode GPUs per server "
                f"({self.gpus_per_server} - {self.pipelines_per_server} x {self.num_stages} prefill) "
                f"do not split into shards of {self.gpus_per_decode_shard}"
            )

    @property
    def decode_kv_gib(self) -> float:
        return self.device_kv_gib_per_gpu if self.decode_kv_gib_per_gpu is None else self.decode_kv_gib_per_gpu

    @property
    def shards_per_server(self) -> int:
        return (self.gpus_per_server - self.pipelines_per_server * self.num_stages) // self.gpus_per_decode_shard

    @property
    def num_gpus(self) -> int:
        return self.num_servers * self.gpus_per_server


@dataclass(frozen=True, slots=True)
class RunSettings:
    """One simulated run."""

    num_sessions: int = 112
    duration_s: float = 3600.0
    warmup_s: float = 300.0  # figures count turns whose prefill ends after this
    pool: str = "shared"
    think: bool = True
    think_scale: float | None = None  # each turn's think time is the trace's times this (None: the cost model's [fit])
    start_spread_s: float = 30.0  # sessions start evenly over this
    # the router's session affinity: stay while the session's pipeline has fewer in flight than this;
    # AFFINITY_STRICT: always stay; AFFINITY_NONE: every turn goes to the least-loaded pipeline
    affinity_max_queue: int = 4
    fail_server_at_s: float | None = None  # every store of server 0 dies then
    window_s: float = 60.0
    restart_sessions: bool = True  # a finished trace makes way for a new instance (the load stays constant)
    max_turns: int | None = None  # end the run when this many turns have ended (decode done or refused)
    max_instances: int | None = None  # with restarts: stop starting sessions after this many (then the run ends)
    seed_offset: int = 0  # session k plays trace (k + seed_offset) % num_traces
    # "fifo": the seed's prefill queue; "session": session-aware prefill (the work-aware queue with aging,
    # retention by session, prefetch during think time: kvpool.core.prefill.queue, kvpool.core.sessions.table)
    sched: str = "fifo"
    max_wait_s: float = 4.0  # the work-aware queue's aging bound (docs/simulation.md: the sweep that chose it); inf: none
    # sched=session: the queue's bypass budget, seconds of estimated work younger turns may overtake a turn by
    # (kvpool.core.prefill.queue: a turn then waits at most what FIFO would make it wait plus this); inf: none
    max_bypass_s: float = math.inf
    # sched=session: the queue's backlog gate, seconds of estimated work queued at or over which it pops in
    # arrival order (kvpool.core.prefill.queue); inf: none
    reorder_below_s: float = math.inf
    # sched=session: the queue's order, "work" (least work first, aging at max_wait_s) or "ratio" (highest
    # response ratio next: kvpool.core.prefill.queue)
    session_order: str = "work"
    # open loop: a new session (the next trace) starts every 1/rate s whatever the system does, and each
    # plays its trace once (think, turn, think...); None: the closed loop of ``num_sessions`` slots
    open_loop_sessions_per_s: float | None = None
    # open loop: sessions already running at the start (over ``start_spread_s``), so the load is near its
    # steady state after a shorter warm-up (a session lives ~20 minutes at the calibrated pace)
    open_loop_initial_sessions: int = 0
    # the router's queue: a turn waits this long for decode room, then leaves unserved (``expired_in_queue``)
    queue_timeout_s: float = 30.0  # the router's default
    # every session is one agent's: they share their system and tool prefix (``workload.own_block_ids``)
    agent_prefix: bool = False
    # the summary also carries every counted turn's TTFT (``ttft_samples``): the comparisons pool runs' turns
    keep_ttft_samples: bool = False

    def __post_init__(self) -> None:
        if self.sched not in SCHEDS:
            raise ValueError(f"sched: must be one of {', '.join(SCHEDS)}, got {self.sched!r}")
        if self.open_loop_sessions_per_s is not None and not self.open_loop_sessions_per_s > 0:
            raise ValueError(f"open_loop_sessions_per_s: must be positive, got {self.open_loop_sessions_per_s}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s: must be positive, got {self.max_wait_s}")
        if not self.max_bypass_s >= 0:
            raise ValueError(f"max_bypass_s: must be >= 0, got {self.max_bypass_s}")
        if not self.reorder_below_s > 0:
            raise ValueError(f"reorder_below_s: must be positive, got {self.reorder_below_s}")
        if self.session_order not in ("work", "ratio"):
            raise ValueError(f"session_order: must be 'work' or 'ratio', got {self.session_order!r}")
        if self.pool not in ("shared", "split"):
            raise ValueError(f"pool: must be 'shared' or 'split', got {self.pool!r}")
        if self.num_sessions <= 0:
            raise ValueError(f"sessions: must be positive, got {self.num_sessions}")
        if not self.duration_s > 0 or self.warmup_s < 0 or self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s: must be in [0, duration_s), got {self.warmup_s} of {self.duration_s}")
        if (self.think_scale is not None and self.think_scale < 0) or self.start_spread_s < 0 or not self.window_s > 0:
            raise ValueError("think_scale, start_spread_s must be >= 0 and window_s > 0")
        if self.affinity_max_queue < 0:
            raise ValueError(f"affinity_max_queue: must be >= 0, got {self.affinity_max_queue}")


SCHEDS = ("fifo", "session")
AFFINITY_STRICT = 1 << 30
AFFINITY_NONE = 0


def affinity_label(threshold: int) -> str:
    return {AFFINITY_STRICT: "strict", AFFINITY_NONE: "none"}.get(threshold, str(threshold))


def parse_affinity(label: str) -> int:
    """``strict``, ``none`` or a positive threshold; ValueError naming the flag otherwise."""
    if label in ("strict", "none"):
        return AFFINITY_STRICT if label == "strict" else AFFINITY_NONE
    if label.isdigit() and int(label) > 0:
        return int(label)
    raise ValueError(f"--affinity: expected strict, none or a positive integer, got {label!r}")
