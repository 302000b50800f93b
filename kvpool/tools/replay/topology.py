"""K logical servers on this host, their pool shared or split, behind one router.

Each logical server has its own prefill pipeline, its own decode shard and two
store daemons, the seed's NUMA halves: a prefill-side one and a decode-side one.

- ``pool="shared"``: one master over every store of every server.
- ``pool="split"``: one master per server over that server's prefill-side
  store only; the decode-side store is not started (in the seed it holds no
  history, so its DRAM is in nobody's pool).

One router over every server's pipeline and shard places sessions as it
always does: a session stays on its pipeline while fewer than the router's
``--affinity-max-queue`` requests are in flight there, and moves otherwise;
``affinity_max_queue=AFFINITY_STRICT`` keeps every session on the pipeline it
first went to, its turns waiting there however long the queue.
Each server's processes run under a host name of their own (``kvr-s{i}``,
placement's "the writer's own host first") and, where this host can make
them, in a network namespace of their own, reaching the others
over a veth link shaped to ``link_gbit`` (``kvpool.tools.cluster.netns``).
Where namespaces cannot be made the servers share loopback and the cluster's
``network_mode`` says why.

This module only describes a side (:func:`side_topology`); the one launcher,
``kvpool.tools.cluster.Cluster``, starts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.tools.cluster import (
    DecodeSpec,
    MasterSpec,
    PipelineSpec,
    RouterSpec,
    ServerSpec,
    StoreSpec,
    Topology,
)

POOL_MODES = ("shared", "split")
# the router's --affinity-max-queue for strict session affinity: a session stays on its pipeline however many
# requests are in flight there (the router never has this many), waiting there rather than moving
AFFINITY_STRICT = 1 << 30


@dataclass(slots=True, frozen=True)
class TopologySettings:
    """The shape of one side of a comparison; sizes are per process."""

    servers: int = 2
    pool: str = "shared"
    stages: int = 2
    segment_size: str = "128MiB"  # each store's DRAM
    device_cache_tokens: int = 8192  # each prefill stage's device KV
    model: str = "tiny"
    kv_dtype: str = "float32"
    eviction: str = "group"  # the master's --eviction
    netns: bool = True  # False: loopback even where namespaces work
    link_gbit: float = 10.0
    netns_lock_wait_s: float = 30.0  # one run at a time holds the namespaces; wait this long, then loopback
    decode_args: tuple[str, ...] = ()
    master_args: tuple[str, ...] = ()
    locality: bool = True  # the router prefers the decode shard on the pipeline's own server
    affinity_max_queue: int = 0  # the router's --affinity-max-queue (0: its default; AFFINITY_STRICT: never move)
    sched: str = "fifo"  # stage 0's and the router's --sched: the gate's and the admission queue's order
    sched_slots: int = -1  # stage 0's --sched-slots (-1: its default)
    sched_max_wait_s: float = 0.0  # stage 0's and the router's --sched-max-wait-s (0: their default)
    sched_max_bypass_s: float | None = None  # stage 0's and the router's --sched-max-bypass-s (None: theirs, none)
    sched_reorder_below_s: float | None = None  # their --sched-reorder-below-s (None: theirs, none)
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.servers < 1 or self.stages < 1:
            raise ValueError(f"servers and stages must be >= 1, got {self.servers} and {self.stages}")
        if self.pool not in POOL_MODES:
            raise ValueError(f"pool must be one of {POOL_MODES}, got {self.pool!r}")
        if self.affinity_max_queue < 0:
            raise ValueError(f"affinity_max_queue must be >= 0, got {self.affinity_max_queue}")
        if self.link_gbit <= 0:
            raise ValueError(f"link_gbit must be positive, got {self.link_gbit}")
        if self.sched_max_bypass_s is not None and not self.sched_max_bypass_s >= 0:
            raise ValueError(f"sched_max_bypass_s must be >= 0, got {self.sched_max_bypass_s}")
        if self.sched_reorder_below_s is not None and not self.sched_reorder_below_s > 0:
            raise ValueError(f"sched_reorder_below_s must be positive, got {self.sched_reorder_below_s}")


def side_topology(settings: TopologySettings) -> Topology:
    """Server ``i`` is host ``kvr-s{i}``; its processes are ``s{i}-store-p``/``-store-d``, ``s{i}-stage{n}``,
    ``s{i}-decode`` and, split, ``s{i}-master``; a shared master is ``master``."""
    s = settings
    master_args = ("--eviction", s.eviction, *s.master_args)
    # the session side's bounds, the same at stage 0's gate and the router's queue (each ignores them in fifo)
    sched_bounds = (*(("--sched-max-wait-s", str(s.sched_max_wait_s)) if s.sched_max_wait_s > 0 else ()),
                    *(("--sched-max-bypass-s", str(s.sched_max_bypass_s)) if s.sched_max_bypass_s is not None
                      else ()),
                    *(("--sched-reorder-below-s", str(s.sched_reorder_below_s))
                      if s.sched_reorder_below_s is not None else ()))
    model = ("--model", s.model, "--kv-dtype", s.kv_dtype)
    sides = ("p", "d") if s.pool == "shared" else ("p",)
    servers = tuple(ServerSpec(
        host_name=f"kvr-s{i}",
        master=MasterSpec(f"s{i}-master", args=master_args) if s.pool == "split" else None,
        stores=tuple(StoreSpec(f"s{i}-store-{side}", ("--segment-size", s.segment_size, "--numa-node", "0",
                                                       "--segment-id", f"s{i}-store-{side}")) for side in sides),
        pipelines=(PipelineSpec(f"s{i}-", s.stages, (*model, "--device-cache-tokens", str(s.device_cache_tokens),
                                                        "--sched", s.sched,
                                                        *(("--sched-slots", str(s.sched_slots))
                                                          if s.sched_slots >= 0 else ()),
                                                        *sched_bounds)),),
        decode_shards=(DecodeSpec(f"s{i}-decode", (*model, *s.decode_args)),),
    ) for i in range(s.servers))
    return Topology(servers, master=MasterSpec(args=master_args) if s.pool == "shared" else None,
                    router=RouterSpec(args=("--model", s.model, "--locality" if s.locality else "--no-locality",
                                            "--sched", s.sched, *sched_bounds,
                                            *(("--affinity-max-queue", str(s.affinity_max_queue))
                                              if s.affinity_max_queue > 0 else ()))),
                    host="127.0.0.1",
                    common_args=("--log-level", s.log_level, "--log-format", "json"), netns=s.netns,
                    link_gbit=s.link_gbit, netns_lock_wait_s=s.netns_lock_wait_s)
