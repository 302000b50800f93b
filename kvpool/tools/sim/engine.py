"""One simulated run: a cluster of the core's policy objects, a closed loop of trace sessions, a clock.

The cluster is the services' decisions without their processes: per server,
prefill pipelines (``BlockManager`` + ``PrefillRequest``), decode shards
(``DecodeScheduler``), store segments mounted on pool masters
(``PoolIndex``: one over every store of every server when the pool is
shared; one per server over its prefill-side store only when split), and one
router (``RoutingPolicy``). Stores heartbeat every second; a store that dies
stops, and the master drops it after its TTL (``expire_segments``).

A session is a closed loop: think (the trace's think time, capped), send a
turn, wait for its last token, think again; a finished trace makes way for a
new instance of the next trace, so ``num_sessions`` stay live.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.core.block_manager import BlockManager
from kvpool.core.decode_pages import pages_for
from kvpool.core.decode_scheduler import DecodeScheduler
from kvpool.core.planner import max_hit_chunks
from kvpool.core.errors import InvalidArgument
from kvpool.core.pool_index import PoolIndex
from kvpool.core.pool_settings import IndexSettings
from kvpool.core.routing import RoutingPolicy
from kvpool.tools.sim.cost_model import CostModel
from kvpool.tools.sim.decode_sim import ShardSim
from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.metrics import Metrics, percentile
from kvpool.tools.sim.prefill_sim import Job, PipelineSim
from kvpool.tools.sim.topology import GIB, RunSettings, Topology
from kvpool.tools.sim.workload import SessionPlay
from kvpool.workload.bounds import trace_block_bound
from kvpool.workload.weka import Session

HEARTBEAT_S = 1.0
SAMPLE_S = 5.0


def layer_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible, the extra ones on the first stages."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (s < extra) for s in range(num_stages)]


@dataclass(slots=True)
class Simulation:
    topology: Topology
    settings: RunSettings
    cost: CostModel
    traces: Sequence[Session]
    index_settings: IndexSettings = field(default_factory=IndexSettings)
    loop: EventLoop = field(default_factory=EventLoop)
    indexes: list[PoolIndex] = field(default_factory=list)
    pipelines: dict[str, PipelineSim] = field(default_factory=dict)
    shards: dict[str, ShardSim] = field(default_factory=dict)
    plays: dict[int, SessionPlay] = field(default_factory=dict)
    prefilled: dict[int, list[int]] = field(default_factory=dict)  # turn indices each instance prefilled
    metrics: Metrics = field(init=False)
    router: RoutingPolicy = field(init=False)
    _next_instance: int = 0
    _acked: dict[str, int] = field(default_factory=dict)
    _dead_hosts: set[str] = field(default_factory=set)
    _seen: dict[int, set[str]] = field(default_factory=dict)
    _bound_hits: int = 0
    dropped_objects: int = 0
    _finished: int = 0
    _turns_ended: int = 0

    def __post_init__(self) -> None:
        if not self.traces:
            raise ValueError("traces: no sessions to play")
        self.metrics = Metrics(self.settings.warmup_s, self.settings.window_s, self.loop.clock)
        self._build()

    # ---- the cluster --------------------------------------------------------

    def _build(self) -> None:
        topo, cost = self.topology, self.cost
        chunk = cost.model.chunk_tokens
        stage_bytes = [n * cost.model.kv_entry_bytes * chunk for n in layer_split(cost.model.num_layers, topo.num_stages)]
        num_blocks = int(topo.device_kv_gib_per_gpu * GIB // max(stage_bytes))
        store_bytes = int(topo.store_gib * GIB)
        shared = self.settings.pool == "shared"
        if shared:
            self.indexes = [PoolIndex(settings=self.index_settings, clock=self.loop.clock)]
        for server in range(topo.num_servers):
            host = f"server{server}"
            if not shared:
                self.indexes.append(PoolIndex(settings=self.index_settings, clock=self.loop.clock))
            index = self.indexes[-1]
            # split: the decode-side stores hold no history (the seed's baseline)
            for numa in range(topo.stores_per_server if shared else 1):
                index.mount_segment(f"{host}/numa{numa}", f"{host}:{numa}", host, 0, store_bytes, numa)
            for p in range(topo.pipelines_per_server):
                name = f"p{server}.{p}"
                self.pipelines[name] = PipelineSim(
                    name, server, host, self.loop, cost, BlockManager(num_blocks, chunk), index, stage_bytes,
                    self.metrics, self._prefilled, self._dead_hosts,
                )
            pages = int(topo.gpus_per_decode_shard * topo.decode_kv_gib * GIB
                        // (cost.model.kv_bytes_per_token * topo.decode_page_tokens))
            for d in range(topo.shards_per_server):
                name = f"d{server}.{d}"
                scheduler = DecodeScheduler(pages, topo.decode_page_tokens, topo.decode_max_batch, topo.max_context,
                                            self.loop.clock)
                self.shards[name] = ShardSim(name, server, self.loop, cost, scheduler, self._admitted, self._done)
        self.router = RoutingPolicy.of(self.pipelines, self.shards, affinity_max_queue=self.settings.affinity_max_queue)

    # ---- sessions -----------------------------------------------------------

    def _start_session(self) -> None:
        instance = self._next_instance
        self._next_instance += 1
        trace = self.traces[(instance + self.settings.seed_offset) % len(self.traces)]
        play = self.plays[instance] = SessionPlay(instance, trace)
        self._seen[instance] = set()
        self._next_turn(play, first=True)

    def _next_turn(self, play: SessionPlay, first: bool = False) -> None:
        if not first:
            self._turns_ended += 1
            if self.settings.max_turns is not None and self._turns_ended >= self.settings.max_turns:
                self.loop.stop()
                return
        if play.done:
            limit = self.settings.max_instances
            if self.settings.restart_sessions and (limit is None or self._next_instance < limit):
                self._start_session()  # the slot goes on with the next trace
            else:
                self._finished += 1
                if self._finished >= self.settings.num_sessions:
                    self.loop.stop()  # every slot played its last session: nothing more will happen
            return
        turn = play.trace.turns[play.next_turn]
        think = 0.0 if first or not self.settings.think else min(turn.think_time, self.settings.think_cap_s)
        self.loop.after(think, self._arrive, play)

    def _arrive(self, play: SessionPlay) -> None:
        turn = play.take_turn(self.cost.model.chunk_tokens)
        # the edge refuses what could never run: past the model's context, or more than a device cache
        pipeline = next(iter(self.pipelines.values()))
        try:
            next(iter(self.shards.values())).scheduler.check(turn.input_tokens, max(1, turn.output_tokens))
            too_long = pipeline.blocks.num_blocks_needed(turn.input_tokens) > pipeline.blocks.num_blocks
        except InvalidArgument:
            too_long = True
        if too_long:
            self.metrics.refused += 1
            self._next_turn(play)
            return
        job = Job(f"{play.key}.t{play.next_turn - 1}", play, turn, self.loop.now)
        job.decode_pages = pages_for(turn.input_tokens + max(1, turn.output_tokens) - 1, self.topology.decode_page_tokens)
        for shard in self.shards.values():
            self.router.report_free_pages(shard.name, shard.free_pages())
        job.placement = self.router.place(play.key, job.decode_pages)
        self.pipelines[job.placement.pipeline].enqueue(job)

    def _prefilled(self, job: Job) -> None:
        """Prefill ended: count the infinite-cache bound, then hand the KV to decode."""
        request = job.request
        assert request is not None and job.placement is not None
        self.prefilled.setdefault(job.play.instance, []).append(job.play.next_turn - 1)
        seen = self._seen[job.play.instance]
        cap = max_hit_chunks(request.num_tokens, request.chunk_size)
        hits = 0
        for h in request.chunk_hashes[:cap]:
            if h not in seen:
                break
            hits += 1
        self._bound_hits += hits * request.chunk_size
        seen.update(request.chunk_hashes)
        pipeline = self.pipelines[job.placement.pipeline]
        shard = self.shards[job.placement.shard]
        nbytes = request.num_tokens * self.cost.model.kv_bytes_per_token
        if shard.server != pipeline.server:
            self.metrics.cross_bytes(pipeline.host, {f"server{shard.server}": nbytes})
        self.loop.after(self.cost.handoff_s(nbytes, self.topology.num_stages), self._handed_off, job)

    def _handed_off(self, job: Job) -> None:
        assert job.placement is not None
        self.pipelines[job.placement.pipeline].handed_off(job)
        self.metrics.on_first_token(job)
        if not self.shards[job.placement.shard].submit(job):
            self.metrics.refused += 1
            self.router.finish(job.placement, job.decode_pages)
            self._next_turn(job.play)

    def _admitted(self, job: Job) -> None:
        assert job.placement is not None
        self.router.admitted(job.placement, job.decode_pages)

    def _done(self, job: Job) -> None:
        assert job.placement is not None
        self.router.finish(job.placement)
        self.metrics.on_decode_done(job)
        self._next_turn(job.play)

    # ---- stores, sampling, failure -----------------------------------------

    def _heartbeat(self) -> None:
        """Every live store beats and acknowledges the journal changes it was sent; masters drop the silent."""
        for index in self.indexes:
            for segment in list(index.segments.values()):
                if segment.host in self._dead_hosts:
                    continue
                more = True
                while more:
                    changes, more = index.heartbeat(segment.segment_id, self._acked.get(segment.segment_id, 0))
                    if changes:
                        self._acked[segment.segment_id] = changes[-1].sequence
            before = len(index.objects)
            index.expire_segments()
            self.dropped_objects += before - len(index.objects)
        self.loop.after(HEARTBEAT_S, self._heartbeat)

    def _fail_server(self, server: int) -> None:
        self._dead_hosts.add(f"server{server}")  # the pipelines' reads see it at once; the masters after the TTL

    def _sample(self) -> None:
        if self.loop.now >= self.settings.warmup_s:
            m = self.metrics
            for shard in self.shards.values():
                m.decode_use.append(shard.scheduler.num_pages_used / shard.num_pages)
                m.decode_waiting.append(shard.scheduler.num_waiting)
            for pipeline in self.pipelines.values():
                m.prefill_queue.append(len(pipeline.queue))
            m.pool_use.append(sum(i.used_bytes for i in self.indexes) / max(1, sum(i.capacity for i in self.indexes)))
        self.loop.after(SAMPLE_S, self._sample)

    # ---- the run ------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        s = self.settings
        wall0 = time.perf_counter()
        for k in range(s.num_sessions):
            self.loop.at(k * s.start_spread_s / s.num_sessions, self._start_session)
        self.loop.at(HEARTBEAT_S, self._heartbeat)
        self.loop.at(0.0, self._sample)
        if s.fail_server_at_s is not None:
            self.loop.at(s.fail_server_at_s, self._fail_server, 0)
        self.loop.run(s.duration_s)
        return self.summary(time.perf_counter() - wall0)

    def trace_bound(self) -> float:
        """The trace's own bound over the turns prefilled (a refused turn reached no cache, so it counts nowhere)."""
        played = [replace(p.trace, turns=tuple(p.trace.turns[k] for k in self.prefilled.get(i, ())))
                  for i, p in self.plays.items()]
        return trace_block_bound(played)

    def summary(self, wall_s: float) -> dict[str, Any]:
        s, m, topo = self.settings, self.metrics, self.topology
        span = s.duration_s - s.warmup_s
        indexes = self.indexes
        out: dict[str, Any] = {
            "pool": s.pool, "servers": topo.num_servers, "sessions": s.num_sessions, "duration_s": s.duration_s,
            "turns": m.turns_prefilled, "turns_done": m.turns_done,
            "throughput_per_gpu": (m.window_prompt_tokens + m.window_output_tokens) / span / topo.num_gpus,
            **m.shares(),
            "trace_bound": self.trace_bound(),
            "chunk_prefix_bound": self._bound_hits / (m.prompt_tokens or 1),
            "ttft_p50_s": percentile(m.ttft_s, 50), "ttft_p90_s": percentile(m.ttft_s, 90),
            "queue_p50_s": percentile(m.queue_s, 50), "queue_p90_s": percentile(m.queue_s, 90),
            "restore_p50_ms": percentile(m.restore_s, 50) * 1e3,
            "restore_tokens_p50": percentile([float(n) for n in m.restore_tokens], 50) * self.cost.model.chunk_tokens,
            "decode_kv_use_p50": percentile(m.decode_use, 50),
            "decode_waiting_mean": sum(m.decode_waiting) / max(1, len(m.decode_waiting)),
            "prefill_queue_mean": sum(m.prefill_queue) / max(1, len(m.prefill_queue)),
            "pool_use_p50": percentile(m.pool_use, 50),
            "write_back_chunks": m.write_back_chunks, "refused": m.refused,
            "master_lookups_per_s": m.master_lookups / s.duration_s / len(indexes),
            "master_puts_per_s": m.put_objects / s.duration_s / len(indexes),
            "master_evictions_per_s": m.evicted_groups / s.duration_s / len(indexes),
            "cross_server_bytes_per_s_per_nic": (sum(m.sent.values()) + sum(m.received.values()))
            / s.duration_s / topo.num_servers,
            "dropped_objects": self.dropped_objects,
            "wall_s": wall_s, "sim_speed": s.duration_s / max(wall_s, 1e-9), "events": self.loop.num_events,
        }
        out["nic_use"] = out["cross_server_bytes_per_s_per_nic"] / (topo.nic_gbps * 1e9)
        out["windows"] = m.window_series()
        return out
