"""One simulated run: a cluster of the core's policy objects, a closed loop of trace sessions, a clock.

The cluster is the services' decisions without their processes: per server,
prefill pipelines (stage 0's ``PrefillDriver`` over its ``BlockManager``),
decode shards (``ShardRoom`` + ``DecodeScheduler``), store segments mounted on
pool masters (``PoolIndex``: one over every store of every server when the
pool is shared; one per server over its prefill-side store only when split),
and one router (``RouterRequest`` over ``Admission``: a turn's decode room is
reserved at its ticket, before prefill, or it queues). Stores heartbeat every second; a store that dies
stops, and the master drops it after its TTL (``expire_segments``). Each
master serves its operations one at a time and each server's NIC is shared by
the transfers crossing it (``network``).

A session is a closed loop: think (the trace's think time times
``think_scale``), send a turn, wait for its last token, think again; a
finished trace makes way for a new instance of the next trace, so
``num_sessions`` stay live. Trace handling (``trace_policy`` in the summary):
a prompt past the model's context is cut to its leading tokens
(``workload.fit_to_context``) and counted; a turn that still could not run
(more blocks than a device cache, or refused by decode) is counted by name;
none is dropped silently.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.core.admission.admission import Admission, ShardShape
from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.decode.regions import REGION_ALIGNMENT
from kvpool.core.decode.scheduler import DecodeScheduler
from kvpool.core.decode.shard_room import ShardRoom
from kvpool.core.errors import InvalidArgument, KvpoolError
from kvpool.core.prefill.planner import max_hit_chunks
from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.settings import IndexSettings
from kvpool.core.prefill.queue import PrefillQueue, QueueOrder, WorkWeights
from kvpool.core.admission.routing import RoutingPolicy
from kvpool.tools.sim.cost_model import CostModel
from kvpool.tools.sim.decode_sim import ShardSim
from kvpool.heap import HeapKeeper
from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.job import Job
from kvpool.tools.sim.metrics import Metrics
from kvpool.tools.sim.network import MasterQueue, Network
from kvpool.tools.sim.prefill_sim import PipelineSim
from kvpool.tools.sim.router_sim import RouterSim
from kvpool.tools.sim.session_sim import SessionAware
from kvpool.tools.sim.summary import summarize
from kvpool.tools.sim.topology import AFFINITY_NONE, GIB, RunSettings, Topology
from kvpool.tools.sim.workload import SessionPlay, placed_on
from kvpool.workload.weka import Session, Turn

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
    masters: list[MasterQueue] = field(default_factory=list)
    network: Network = field(init=False)
    pipelines: dict[str, PipelineSim] = field(default_factory=dict)
    shards: dict[str, ShardSim] = field(default_factory=dict)
    plays: dict[int, SessionPlay] = field(default_factory=dict)  # the live instances (``_end_session``)
    trace_policy: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("arrivals", "cut_to_context", "tokens_cut", "refused_device_cache", "refused_decode", "expired_in_queue"), 0))
    metrics: Metrics = field(init=False)
    router: RouterSim = field(init=False)
    sessions: SessionAware | None = None  # sched=session
    _next_instance: int = 0
    _acked: dict[str, int] = field(default_factory=dict)
    _dead_hosts: set[str] = field(default_factory=set)
    _seen: dict[int, set[str]] = field(default_factory=dict)  # chunk hashes each live instance prefilled
    _seen_blocks: dict[int, set[int]] = field(default_factory=dict)  # block ids each live instance prefilled
    _bound_hits: int = 0  # after warm-up: leading chunks an unlimited prefix cache would hold
    _block_hits: int = 0  # after warm-up: tokens of blocks seen before in the session (the trace's bound)
    dropped_objects: int = 0
    _finished: int = 0
    _turns_ended: int = 0

    def __post_init__(self) -> None:
        if not self.traces:
            raise ValueError("traces: no sessions to play")
        self.metrics = Metrics(self.settings.warmup_s, self.settings.window_s, self.loop.clock)
        self.network = Network(self.loop, self.topology.nic_gbps * 1e9)
        self._build()

    # ---- the cluster --------------------------------------------------------

    @property
    def think_scale(self) -> float:
        scale = self.settings.think_scale
        return self.cost.fit.think_scale if scale is None else scale

    def _build(self) -> None:
        topo, cost = self.topology, self.cost
        chunk = cost.model.chunk_tokens
        stage_bytes = [n * cost.model.kv_entry_bytes * chunk for n in layer_split(cost.model.num_layers, topo.num_stages)]
        num_blocks = int(topo.device_kv_gib_per_gpu * GIB // max(stage_bytes))
        store_bytes = int(topo.store_gib * GIB)
        shared = self.settings.pool == "shared"
        order = QueueOrder(self.settings.session_order) if self.settings.sched == "session" else QueueOrder.FIFO
        if self.settings.sched == "session":
            self.sessions = SessionAware(cost.model.kv_bytes_per_token * chunk)
        level = cost.fit.prefill_level
        weights = WorkWeights(chunk, cost.prefill.chunk_base_s * level, cost.prefill.chunk_per_context_token_s * level,
                              cost.restore_s(1, max(stage_bytes) / chunk) / chunk)
        for server in range(topo.num_servers):
            host = f"server{server}"
            if not shared or not self.indexes:
                self.indexes.append(PoolIndex(settings=self.index_settings, clock=self.loop.clock))
                self.masters.append(MasterQueue(self.loop, counted_from_s=self.settings.warmup_s))
            index, master = self.indexes[-1], self.masters[-1]
            # split: the decode-side stores hold no history (the seed's baseline)
            for numa in range(topo.stores_per_server if shared else 1):
                index.mount_segment(f"{host}/numa{numa}", f"{host}:{numa}", host, 0, store_bytes, numa)
            for p in range(topo.pipelines_per_server):
                name = f"p{server}.{p}"
                blocks = BlockManager(num_blocks, chunk)
                self.pipelines[name] = PipelineSim(
                    name, server, host, self.loop, cost, blocks, index, stage_bytes,
                    self.metrics, self._prefilled, self.network, master, self._dead_hosts,
                    PrefillQueue(order, self.settings.max_wait_s, self.settings.max_bypass_s,
                                 self.settings.reorder_below_s), weights,
                    self.sessions.policy(name, blocks) if self.sessions else None,
                )
            pages = int(topo.gpus_per_decode_shard * topo.decode_kv_gib * GIB
                        // (cost.model.kv_bytes_per_token * topo.decode_page_tokens))
            for d in range(topo.shards_per_server):
                name = f"d{server}.{d}"
                scheduler = DecodeScheduler(pages, topo.decode_page_tokens, topo.decode_max_batch, topo.max_context,
                                            self.loop.clock)
                self.shards[name] = ShardSim(name, server, self.loop, cost, ShardRoom(scheduler), self._done,
                                             self._first_token)
        rooms = {name: shard.room for name, shard in self.shards.items()}
        self.router = RouterSim(self.loop, self._admission(num_blocks, pages), rooms, self._served, self._unserved)

    def _admission(self, num_blocks: int, num_pages: int) -> Admission:
        """The router's admission over every pipeline and shard, each shape known, each shard telling when room
        comes back; its queue holds every waiting turn (``RunSettings.queue_timeout_s``)."""
        topo, chunk = self.topology, self.cost.model.chunk_tokens
        routing = RoutingPolicy.of(self.pipelines, self.shards,
                                   affinity_max_queue=max(1, self.settings.affinity_max_queue))
        admission = Admission(routing, {n: f"server{s.server}" for n, s in self.shards.items()},
                              {n: p.host for n, p in self.pipelines.items()}, max_queue=1 << 20,
                              queue_timeout_s=self.settings.queue_timeout_s)
        # the simulated shards count pages only: a receive arena as large as the longest prompt's region
        per_token = self.cost.model.kv_bytes_per_token
        arena = -(-topo.max_context * per_token // REGION_ALIGNMENT) * REGION_ALIGNMENT
        for name in self.pipelines:
            admission.set_pipeline_shape(name, num_blocks, chunk)
        for name in self.shards:
            admission.set_shard_shape(name, ShardShape(num_pages, topo.decode_page_tokens, arena, per_token, 0,
                                                       topo.max_context))
            admission.set_watched(name, True, 0)
        return admission

    # ---- sessions -----------------------------------------------------------

    def _start_session(self) -> None:
        instance = self._next_instance
        self._next_instance += 1
        trace = self.traces[(instance + self.settings.seed_offset) % len(self.traces)]
        play = self.plays[instance] = SessionPlay(instance, trace, agent_prefix=self.settings.agent_prefix)
        self._seen[instance] = set()
        self._seen_blocks[instance] = set()
        self._next_turn(play, first=True)

    def _next_turn(self, play: SessionPlay, first: bool = False) -> None:
        if not first:
            self._turns_ended += 1
            if self.settings.max_turns is not None and self._turns_ended >= self.settings.max_turns:
                self.loop.stop()
                return
        if play.done:
            self._end_session(play)
            if self.settings.open_loop_sessions_per_s is not None:
                return  # open loop: sessions arrive on their own clock
            limit = self.settings.max_instances
            if self.settings.restart_sessions and (limit is None or self._next_instance < limit):
                self._start_session()  # the slot goes on with the next trace
            else:
                self._finished += 1
                if self._finished >= self.settings.num_sessions:
                    self.loop.stop()  # every slot played its last session: nothing more will happen
            return
        turn = play.trace.turns[play.next_turn]
        think = 0.0 if first or not self.settings.think else turn.think_time * self.think_scale
        if not first and self.metrics.after_warmup():
            self.metrics.think_s.append(think)
        self.loop.after(think, self._arrive, play)

    def _end_session(self, play: SessionPlay) -> None:
        """The instance played its last turn (nothing of it runs again): what the run kept for it goes, so the
        run's memory follows the live sessions, not every session it ever started."""
        del self.plays[play.instance], self._seen[play.instance], self._seen_blocks[play.instance]

    def _arrive(self, play: SessionPlay) -> None:
        policy = self.trace_policy
        policy["arrivals"] += 1
        recorded = play.trace.turns[play.next_turn].input_tokens
        turn, cut = play.take_turn(self.cost.model.chunk_tokens, self.topology.max_context)
        if cut:
            policy["cut_to_context"] += 1
            policy["tokens_cut"] += recorded - turn.input_tokens
        job = Job(f"{play.key}.t{play.next_turn - 1}", play, turn, self.loop.now)
        # AFFINITY_NONE places every turn without its session key (the policy's least-loaded rule)
        self.router.arrive(job, "" if self.settings.affinity_max_queue == AFFINITY_NONE else play.key)

    def _served(self, job: Job) -> None:
        """The turn's shard holds its room: it goes to its ticket's pipeline."""
        assert job.ticket is not None
        pipeline = self.pipelines[job.ticket.pipeline]
        job.placed_as = placed_on(job.play, pipeline.server)
        pipeline.enqueue(job)  # its arrival (the session's turn started) at its place in stage 0's order

    def _unserved(self, job: Job, error: KvpoolError) -> None:
        """The router refused the turn: no device cache could hold it, no shard ever could, or its wait for
        decode room outlasted the queue's timeout. Counted by name; the session goes on."""
        if isinstance(error, InvalidArgument):
            self.trace_policy["refused_device_cache" if error.field == "prompt" else "refused_decode"] += 1
        else:
            self.trace_policy["expired_in_queue"] += 1
        self._next_turn(job.play)

    def _prefilled(self, job: Job) -> None:
        """Prefill ended: count the bounds, then hand the KV to decode (across the NICs when on another server)."""
        request = job.request
        assert request is not None and job.ticket is not None
        self._count_bounds(job.play, job.turn, request.chunk_hashes, request.num_tokens, request.chunk_size)
        pipeline = self.pipelines[job.ticket.pipeline]
        shard = self.shards[job.ticket.shard]
        nbytes = request.num_tokens * self.cost.model.kv_bytes_per_token
        job.handoff_parts = 2 if shard.server != pipeline.server else 1
        self.loop.after(self.cost.handoff_s(nbytes, self.topology.num_stages), self._handoff_part, job)
        if job.handoff_parts == 2:
            self.network.send(pipeline.host, f"server{shard.server}", nbytes, self._handoff_part, job)

    def _count_bounds(self, play: SessionPlay, turn: Turn, hashes: list, num_tokens: int, chunk: int) -> None:
        """After warm-up: what an unlimited prefix cache (chunks) and the trace itself (any earlier block) allow."""
        seen, blocks = self._seen[play.instance], self._seen_blocks[play.instance]
        if self.metrics.after_warmup():
            hits = 0
            for h in hashes[: max_hit_chunks(num_tokens, chunk)]:
                if h not in seen:
                    break
                hits += 1
            self._bound_hits += hits * chunk
            ids, size = turn.hash_ids, play.trace.block_size
            reused = sum(1 for h in ids if h in blocks) * size
            if ids and len(ids) * size > turn.input_tokens and ids[-1] in blocks:
                reused -= len(ids) * size - turn.input_tokens  # a last partial block holds only the tail
            self._block_hits += reused
        seen.update(hashes)
        blocks.update(turn.hash_ids)

    def _handoff_part(self, job: Job) -> None:
        job.handoff_parts -= 1
        if not job.handoff_parts:
            self._handed_off(job)

    def _handed_off(self, job: Job) -> None:
        """The KV landed on decode: prefill's blocks (held until now) go back, and the turn waits for the batch."""
        assert job.ticket is not None
        job.handed_off_at = self.loop.now
        self.pipelines[job.ticket.pipeline].handed_off(job)
        self.shards[job.ticket.shard].submit(job)

    def _first_token(self, job: Job) -> None:
        """The turn's first decoded token: TTFT ends here (the handoff, decode's queue and its first step in it)."""
        self.metrics.on_first_token(job)
        self.router.first_token(job)

    def _done(self, job: Job) -> None:
        self.router.ended(job)
        self.metrics.on_decode_done(job)
        self._turn_ended(job)
        self._next_turn(job.play)

    def _turn_ended(self, job: Job) -> None:
        """sched=session: the client's hints ride on the turn's end: ``session_end`` on its last turn,
        else ``expected_next_s`` (the next turn's think time as this run plays it)."""
        if self.sessions is None or job.ticket is None:
            return
        play = job.play
        end = play.done
        expected = None if end or not self.settings.think else play.trace.turns[play.next_turn].think_time * self.think_scale
        self.sessions.turn_ended(job, self.pipelines[job.ticket.pipeline], expected, end)

    # ---- stores, sampling, failure -----------------------------------------

    def _heartbeat(self) -> None:
        """Every live store beats and acknowledges the journal changes it was sent; masters drop the silent."""
        for index in self.indexes:
            for segment in list(index.segments.values()):
                if segment.host in self._dead_hosts:
                    continue
                more = True
                while more:
                    rows, more = index.heartbeat_rows(segment.segment_id, self._acked.get(segment.segment_id, 0))
                    if rows:
                        self._acked[segment.segment_id] = rows[-1][0]
            before = index.num_objects
            index.expire_segments()
            self.dropped_objects += before - index.num_objects
        self.loop.after(HEARTBEAT_S, self._heartbeat)

    def _fail_server(self, server: int) -> None:
        self._dead_hosts.add(f"server{server}")  # the pipelines' reads see it at once; the masters after the TTL

    def _sample(self) -> None:
        if self.loop.now >= self.settings.warmup_s:
            m = self.metrics
            for shard in self.shards.values():
                m.decode_use.append(shard.filled_pages() / shard.num_pages)
                m.decode_reserved.append(shard.scheduler.num_pages_used / shard.num_pages)
                m.decode_waiting.append(shard.scheduler.num_waiting)
            for pipeline in self.pipelines.values():
                m.prefill_queue.append(len(pipeline.queue))
            m.pool_use.append(sum(i.used_bytes for i in self.indexes) / max(1, sum(i.capacity for i in self.indexes)))
        self.loop.after(SAMPLE_S, self._sample)

    # ---- the run ------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        s = self.settings
        wall0 = time.perf_counter()
        if s.open_loop_sessions_per_s is not None:
            for k in range(s.open_loop_initial_sessions):
                self.loop.at(k * s.start_spread_s / s.open_loop_initial_sessions, self._start_session)
            for k in range(int(s.duration_s * s.open_loop_sessions_per_s) + 1):
                self.loop.at(k / s.open_loop_sessions_per_s, self._start_session)
        else:
            for k in range(s.num_sessions):
                self.loop.at(k * s.start_spread_s / s.num_sessions, self._start_session)
        self.loop.at(HEARTBEAT_S, self._heartbeat)
        self.loop.at(0.0, self._sample)
        if s.fail_server_at_s is not None:
            self.loop.at(s.fail_server_at_s, self._fail_server, 0)
        keeper = HeapKeeper()  # the index of every server: full collections would walk it again and again
        self.loop.housekeeping = lambda: keeper.tick(time.monotonic())
        try:
            self.loop.run(s.duration_s)
        finally:
            self.loop.housekeeping = None
            gc.unfreeze()  # this run's heap goes back to the collector (the next run in this worker starts clean)
        return self.summary(time.perf_counter() - wall0)

    def trace_bound(self) -> float:
        """The trace's own bound (any earlier block of the session) over the turns counted after warm-up."""
        return self._block_hits / (self.metrics.prompt_tokens or 1)

    def summary(self, wall_s: float) -> dict[str, Any]:
        return summarize(self, wall_s)
