"""A simulated prefill pipeline: the core's ``PrefillRequest`` against the core's ``BlockManager`` and ``PoolIndex``.

A turn's arrival touches its session's cached device blocks (the most
recently used while it waits), as stage 0 does for every turn; before each
admission the waiting turns' sessions are touched in serving order, the
next served last (``BlockManager.touch_sessions``, as the gated stage 0
does). Stage 0
admits one request at a time, when it is free itself: admit (device
blocks) → one pool lookup from chunk 0 (``plan_lookup``), queued at the
pool's master → restore (each stage reads its own objects when it is free;
objects on other servers also cross both servers' NICs) → compute (the
stages as a flow shop over the request's forwarded pieces: ``stages``) →
save (``chunks_to_save`` as one put batch, every stage's object of each
chunk in its group, queued at the master) → the request's KV stays held
until its handoff to decode ends. The next request is admitted when stage 0
has computed its part, while the later stages still work on this one.

Times come from the cost model and the shared resources (``network``);
decisions only from the core. A save is put_start + put_end when the master
serves it, off the request's critical path; its bytes to another server's
store load both NICs but commit does not wait for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import group_id, object_key
from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import LookupResult, PutRequestItem, PutStatus
from kvpool.core.prefill.queue import PrefillQueue, WorkWeights, prefill_work_s
from kvpool.core.prefill.request import PrefillRequest, try_admit
from kvpool.tools.sim.cost_model import CostModel
from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.job import Job, session_of
from kvpool.tools.sim.metrics import Metrics
from kvpool.tools.sim.network import MasterQueue, Network
from kvpool.tools.sim.stages import StageFlow

if TYPE_CHECKING:
    from kvpool.tools.sim.session_sim import SessionAware


@dataclass(slots=True)
class PipelineSim:
    """One prefill pipeline on ``server``; ``index`` is the pool its saves and restores use."""

    name: str
    server: int
    host: str
    loop: EventLoop
    cost: CostModel
    blocks: BlockManager
    index: PoolIndex
    stage_object_bytes: list[int]
    metrics: Metrics
    on_prefilled: Callable[[Job], None]
    network: Network
    master: MasterQueue
    dead_hosts: set[str] = field(default_factory=set)  # stores that died (the master may not know yet)
    queue: PrefillQueue = field(default_factory=PrefillQueue)
    work_weights: WorkWeights = field(default_factory=WorkWeights)
    sessions: SessionAware | None = None  # sched=session: retention, session end, prefetch
    # the validation's hooks (set together): ``block_gate`` runs each of stage 0's block events (a turn's
    # touch of its session on arrival, "touch"; a release of a request's blocks or its save's, "free") and
    # ``pool_gate`` each pool operation (a lookup, a lease's release, each stage's put start and end)
    # when the cluster's recorded order reaches it; None: at once, without the per-stage puts
    block_gate: Callable[[tuple[str, str], Callable[[], object]], None] | None = None
    pool_gate: Callable[[tuple[str, str], Callable[[], int | None]], None] | None = None
    _waiting: dict[str, Job] = field(default_factory=dict)  # queued jobs by id
    busy: bool = False  # stage 0 holds a request (admitted, not yet through its own compute)
    flow: StageFlow | None = None  # the stages' next free times (made on first use: num_stages)

    @property
    def num_stages(self) -> int:
        return len(self.stage_object_bytes)

    @property
    def stage_bytes_per_token(self) -> float:
        """The largest stage's bytes of one token (the stages restore at once: the largest sets the time)."""
        return max(self.stage_object_bytes) / self.cost.model.chunk_tokens

    def enqueue(self, job: Job) -> None:
        self._waiting[job.job_id] = job
        # as stage 0 does on every turn's arrival: the session's cached free blocks become the most recent
        if self.block_gate is None:
            self.blocks.touch_session(session_of(job))
        else:
            self.block_gate(("touch", job.job_id), partial(self._touch, job))
        self.queue.push(job.job_id, self.estimate_work_s(job), self.loop.now)
        self.kick()

    def _touch(self, job: Job) -> None:
        self.blocks.touch_session(session_of(job))
        self.kick()  # its admission may be the next event

    def estimate_work_s(self, job: Job) -> float:
        """What the turn brings, as stage 0 sees it on arrival: the device's cached prefix (a read-only
        match), the pool's complete groups after it (read-only, no lease), the rest computed."""
        hashes, chunk = job.play.hashes, self.cost.model.chunk_tokens
        num_device = self.blocks.match_prefix(hashes)
        groups, ns = self.index.groups, job.play.namespace
        num_pool = 0
        for h in hashes[num_device:]:
            group = groups.get(group_id(ns, h))
            if group is None or not group.complete:
                break
            num_pool += 1
        num_tokens = job.turn.input_tokens
        cached = min((num_device + num_pool) * chunk, num_tokens - 1)
        return prefill_work_s(num_tokens, cached, min(cached, num_pool * chunk), self.work_weights)

    def kick(self) -> None:
        """Start the queue's next request (its order) when idle and its blocks fit (else wait for a handoff)."""
        if self.busy or not len(self.queue):
            return
        job = self._waiting[self.queue.peek(self.loop.now) or ""]
        if len(self.queue) > 1 and self.block_gate is None:
            # as stage 0's gate before an admission: the waiting histories in serving order, the next served
            # the last evicted (under validation the cluster runs ungated: it admits on arrival)
            self.blocks.touch_sessions([session_of(self._waiting[i]) for i in self.queue.serving_order(self.loop.now)])
        request = PrefillRequest(job.job_id, job.turn.input_tokens, self.cost.model.chunk_tokens, job.play.hashes)
        request.session = session_of(job)  # as stage 0's: its freed blocks are the session's
        if not try_admit(request, self.blocks, self.loop.now, math.inf):
            if self.sessions is not None and self.sessions.unpin_all(self):
                self.kick()  # held stagings yield to a real request (as stage 0's admission)
            return
        self.queue.pop(self.loop.now)
        del self._waiting[job.job_id]
        # under validation the recorded order alone admits: the cluster's stage 0 admits while earlier
        # requests are still looked up (holding it would stall an order where a later lookup came first)
        self.busy = self.block_gate is None
        job.request = request
        if self.sessions is not None:
            self.sessions.admitted(job, self)
        job.prefill_start = self.loop.now
        self.metrics.on_prefill_start(job)
        lookup_s = self.cost.lookup_s(len(request.lookup_candidates))
        if self.pool_gate is not None:  # the validation: the lookup at its place in the master's order
            self.master.call(lookup_s, self.pool_gate, ("lookup", job.job_id), partial(self._gated_lookup, job))
        else:
            self.master.call(lookup_s, self._looked_up, job)
        if not self.busy:  # the validation: the next recorded admission may follow at once
            self.kick()

    def _gated_lookup(self, job: Job) -> int:
        result = self._lookup(job)
        self._looked_up(job, result)
        return len(result.groups)

    def _lookup(self, job: Job) -> LookupResult:
        assert job.request is not None
        return self.index.lookup([group_id(job.play.namespace, h) for h in job.request.lookup_candidates])

    def _looked_up(self, job: Job, result: LookupResult | None = None) -> None:
        """The master served the lookup: plan, then read every stage's objects."""
        request = job.request
        assert request is not None
        self.metrics.on_lookup(self.loop.now - job.prefill_start)
        if result is None:
            result = self._lookup(job)
        plan = request.plan_lookup(len(result.groups))
        job.lease = result.lease_id
        restored = result.groups[plan.num_device_chunks : plan.num_hit_chunks]
        job.readable = self.leading_readable(restored)
        restore_s = self.cost.restore_s(plan.num_pool_chunks, max(self.stage_object_bytes) / self.cost.model.chunk_tokens)
        remote = self.remote_bytes(restored[: job.readable]) if restored else {}
        job.restore_parts = 1 + len(remote)
        job.read_s = restore_s
        job.restore_start = self.loop.now
        self.loop.after(restore_s, self._restore_part_done, job)
        for host, nbytes in remote.items():
            self.network.send(host, self.host, nbytes, self._restore_part_done, job)

    def _restore_part_done(self, job: Job) -> None:
        job.restore_parts -= 1
        if job.restore_parts:
            return
        request = job.request
        assert request is not None
        job.restored_at = self.loop.now
        num_chunks = request.restore_plan.num_pool_chunks if request.restore_plan else 0
        self.metrics.on_restore(self.loop.now - job.restore_start, num_chunks)
        if self.sessions is not None:  # as stage 0 does: the prefetch's lead follows the measured restores
            self.sessions.observe_restore(self, num_chunks, self.loop.now - job.restore_start)
        self._restored(job)

    def leading_readable(self, groups: list) -> int:
        """A read from a dead store fails (a miss): how far every stage can read, from the head."""
        if not self.dead_hosts:
            return len(groups)
        segments = self.index.segments
        for i, group in enumerate(groups):
            for obj in group.members.values():
                segment = segments.get(obj.segment_id)
                if segment is None or segment.host in self.dead_hosts:
                    return i
        return len(groups)

    def remote_bytes(self, groups: list) -> dict[str, int]:
        by_host: dict[str, int] = {}
        segments = self.index.segments
        for group in groups:
            for obj in group.members.values():
                segment = segments.get(obj.segment_id)
                if segment is not None and segment.host != self.host:
                    by_host[segment.host] = by_host.get(segment.host, 0) + obj.size
        return by_host

    def _restored(self, job: Job) -> None:
        request = job.request
        assert request is not None
        if self.pool_gate is not None:  # a lease of 0 (none) releases nothing, as the cluster's client sends nothing
            self.master.call(self.cost.release_s(), self.pool_gate, ("release", job.job_id),
                             partial(self.index.release_lease, job.lease))
            job.lease = 0
        elif job.lease:
            self.master.call(self.cost.release_s(), self.index.release_lease, job.lease)
            job.lease = 0
        # every stage reads its own objects; a dead store fails every stage's read of its groups alike
        request.apply_restore([job.readable] * self.num_stages, self.blocks)
        if request.chunks_to_save:  # as stage 0 does: the save reads these blocks, they stay off the free list
            self.blocks.hold(f"{job.job_id}/save", request.save_block_ids)
        if self.flow is None:
            self.flow = StageFlow(self.num_stages)
        times = self.cost.stage_times(request.compute_start, request.num_computed_tokens)
        ends = self.flow.schedule(job.restore_start, self.loop.now, job.read_s, times)
        job.compute_s = times.span_s
        self.loop.at(ends[0], self._stage0_done, job)
        self.loop.at(ends[-1], self._computed, job)

    def _stage0_done(self, job: Job) -> None:
        """Stage 0 computed its part: it admits the next request while the later stages go on."""
        self.metrics.on_stage0_done(self.loop.now - job.prefill_start)
        self.busy = False
        self.kick()

    def _computed(self, job: Job) -> None:
        """The last stage computed its part: commit, save, hand off."""
        request = job.request
        assert request is not None
        request.finish_compute(self.blocks)
        chunks = list(request.chunks_to_save)
        holder, ns = f"{job.job_id}/save", job.play.namespace
        if self.pool_gate is not None:
            self._save_by_stage(job.job_id, ns, chunks)
        elif chunks:
            self.master.call(self.cost.put_s(len(chunks) * self.num_stages), self._save, ns, chunks, holder)
        self.metrics.on_prefill_end(job)
        self.on_prefilled(job)
        self.kick()

    def _save_by_stage(self, request_id: str, ns: str, chunks: list) -> None:
        """The validation: each stage puts its own objects (start, then end), each at its place in the
        master's recorded order, as the cluster's stages put from their own processes; the save's blocks
        go when every stage's put has ended, at their place in stage 0's order (a save of nothing
        releases nothing, in its place)."""
        assert self.pool_gate is not None and self.block_gate is not None
        holder, gate = f"{request_id}/save", self.block_gate
        if not chunks:
            gate(("free", holder), partial(self._free_now, holder))
            return
        left = [self.num_stages]

        def stage_ended() -> None:
            left[0] -= 1
            if not left[0]:
                gate(("free", holder), partial(self._free_now, holder))

        for stage in range(self.num_stages):
            self.master.call(self.cost.put_s(len(chunks)), self.pool_gate, ("put_start", f"{request_id}/{stage}"),
                             partial(self._put_stage, request_id, ns, chunks, stage, stage_ended))

    def _put_stage(self, request_id: str, ns: str, chunks: list, stage: int, ended: Callable[[], None]) -> int:
        """One stage's put start; its put end goes to the gate. Returns the groups it evicted."""
        assert self.pool_gate is not None
        items = [PutRequestItem(object_key(ns, h, stage), group_id(ns, h), self.num_stages,
                                self.stage_object_bytes[stage]) for h in chunks]
        evicted_before = self.index.counters.evicted_groups
        outcomes = self.index.put_start(self.host, items)
        commits = [(item.key, 0) for item, o in zip(items, outcomes) if o.status is PutStatus.RESERVED]
        evicted = self.index.counters.evicted_groups - evicted_before
        self.metrics.on_save(len(items), len(commits), evicted)

        def commit() -> int:
            if commits:  # the cluster's client sends no put end when nothing was reserved
                self.index.put_end(commits)
            ended()
            return len(commits)

        self.pool_gate(("put_end", f"{request_id}/{stage}"), commit)
        return evicted

    def _free_now(self, holder: str) -> None:
        if self.blocks.has_holder(holder):
            self.blocks.free(holder)
        self.kick()

    def _save(self, ns: str, chunks: list, holder: str) -> None:
        """Write-through: every stage's object of every chunk to save, one batch, committed when served;
        the save's hold on its blocks ends then."""
        stages = self.num_stages
        items = [
            PutRequestItem(object_key(ns, h, s), group_id(ns, h), stages, self.stage_object_bytes[s])
            for h in chunks for s in range(stages)
        ]
        evicted_before = self.index.counters.evicted_groups
        outcomes = self.index.put_start(self.host, items)
        commits = []
        remote: dict[str, int] = {}
        for item, outcome in zip(items, outcomes):
            if outcome.status is PutStatus.RESERVED:
                commits.append((item.key, 0))
                segment = outcome.segment
                if segment is not None and segment.host != self.host:
                    remote[segment.host] = remote.get(segment.host, 0) + item.size
        if commits:
            self.index.put_end(commits)
        self.metrics.on_save(len(items), len(commits), self.index.counters.evicted_groups - evicted_before)
        for host, nbytes in remote.items():
            self.network.send(self.host, host, nbytes)
        self._free_now(holder)

    def handed_off(self, job: Job) -> None:
        """Decode has the KV: the hold ends and its blocks may serve the queue head."""
        if self.block_gate is None:
            self._free_now(job.job_id)
        else:
            self.block_gate(("free", job.job_id), partial(self._free_now, job.job_id))
