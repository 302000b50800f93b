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
from kvpool.core.pool.records import PutRequestItem, PutStatus
from kvpool.core.prefill.queue import PrefillQueue, WorkWeights, prefill_work_s
from kvpool.core.prefill.driver import (
    Admitted,
    Effect,
    Failed,
    Forward,
    Freed,
    Lookup,
    Prefilled,
    PrefillDriver,
    ReleaseLease,
    SavesThenFree,
    effect_fields,
)
from kvpool.core.prefill.stage0_admission import Stage0Admission, waits_for_blocks
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
    # ``block_gate`` runs each of stage 0's block events (a turn's touch of its session on arrival, "touch";
    # a forward's commit, "commit"; a release of a request's blocks or its save's, "free") and ``pool_gate``
    # each pool operation (a lookup, a lease's release, a save's put start and end): at once, or under
    # validation (``recorded``) when the cluster's recorded order reaches it
    block_gate: Callable[[tuple[str, str], Callable[[], object]], None] = field(default=lambda step, apply: apply())
    pool_gate: Callable[[tuple[str, str], Callable[[], int | None]], None] = field(default=lambda step, apply: apply())
    recorded: bool = False  # the validation: the gates follow the cluster's orders
    _waiting: dict[str, Job] = field(default_factory=dict)  # queued jobs by id
    busy: bool = False  # stage 0 holds a request (admitted, not yet through its own compute)
    admission: Stage0Admission = field(init=False)  # the core's admission steps over ``blocks``
    flow: StageFlow | None = None  # the stages' next free times (made on first use: num_stages)
    effects: dict[str, list[dict[str, object]]] | None = None  # the validation: each request's driver effects

    @property
    def num_stages(self) -> int:
        return len(self.stage_object_bytes)

    @property
    def stage_bytes_per_token(self) -> float:
        """The largest stage's bytes of one token (the stages restore at once: the largest sets the time)."""
        return max(self.stage_object_bytes) / self.cost.model.chunk_tokens

    def __post_init__(self) -> None:
        self.admission = Stage0Admission(self.blocks, self.sessions.policy(self) if self.sessions else None)

    def enqueue(self, job: Job) -> None:
        """A turn arrives: it queues, and (at its place in a recorded order) its session's blocks are touched."""
        self._waiting[job.job_id] = job
        self.queue.push(job.job_id, self.estimate_work_s(job), self.loop.now)
        self.block_gate(("touch", job.job_id), partial(self._arrived, job))

    def _arrived(self, job: Job) -> None:
        self.admission.arrived(session_of(job), self.loop.now)
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
        """Admit the queue's requests in its order while stage 0 is free and their blocks fit: the core's
        ``Stage0Admission`` steps, as stage 0 takes them (the waiting histories touched in serving order under
        more than one waiter; under validation the cluster runs ungated: it admits on arrival)."""
        while not self.busy and len(self.queue):
            job, now = self._waiting[self.queue.peek(self.loop.now) or ""], self.loop.now
            serving = (None if len(self.queue) < 2 or self.recorded
                       else [session_of(self._waiting[i]) for i in self.queue.serving_order(now)])
            if job.driver is None:  # stage 0's driver of the request, as the cluster runs it
                job.driver = PrefillDriver(job.job_id, job.turn.input_tokens, self.cost.model.chunk_tokens,
                                           job.play.hashes, self.blocks, math.inf, session=session_of(job))
            effects = self._recorded(job, self.admission.admit(job.driver, now, serving))
            if waits_for_blocks(effects):
                if self.admission.short_of_blocks():
                    continue  # held stagings yield to a real request
                return
            self.queue.pop(now)
            del self._waiting[job.job_id]
            # under validation the recorded order alone admits (stage 0 admits while earlier lookups run)
            self.busy = not self.recorded
            job.request = job.driver.request
            self.admission.admitted(job.request)
            job.prefill_start = now
            self.metrics.on_prefill_start(job)
            self._carry_out(job, effects)

    def _recorded(self, job: Job, effects: list[Effect]) -> list[Effect]:
        """The driver's effects of one event, kept per request under validation (``effects``)."""
        if self.effects is not None:
            self.effects.setdefault(job.job_id, []).extend(effect_fields(e) for e in effects)
        return effects

    def _drive(self, job: Job, effects: list[Effect]) -> None:
        self._carry_out(job, self._recorded(job, effects))

    def _carry_out(self, job: Job, effects: list[Effect]) -> None:
        """The driver's effects, in simulated time (the cost model's, and the shared master and NICs)."""
        for effect in effects:
            if isinstance(effect, Lookup):
                self.master.call(self.cost.lookup_s(len(effect.candidates)), self.pool_gate, ("lookup", job.job_id),
                                 partial(self._looked_up, job, effect))
            elif isinstance(effect, ReleaseLease):
                self.master.call(self.cost.release_s(), self.pool_gate, ("release", job.job_id),
                                 partial(self.index.release_lease, int(effect.lease_id)))
            elif isinstance(effect, Forward):
                job.chain_restore = effect.restore
                if effect.restore:  # every stage reads its part first (the restore rides the chain)
                    self._restore(job)
                else:
                    self._forward(job)
            elif isinstance(effect, SavesThenFree):
                self._save_then_free(job, effect.holder)
            elif isinstance(effect, Freed):
                self.kick()
            elif isinstance(effect, Prefilled):
                job.request = job.driver.request if job.driver is not None else job.request  # its last attempt's
                self.metrics.on_prefill_end(job)
                self.on_prefilled(job)
                self.kick()
            elif isinstance(effect, Failed):  # no fault the simulator plays fails a prefill
                raise AssertionError(f"{job.job_id}: the simulated prefill failed: {effect.error}")
            elif isinstance(effect, Admitted) and job.driver is not None:  # planned again: a new attempt
                job.request = job.driver.request
            # PlannedAgain: nothing to time

    def _looked_up(self, job: Job, effect: Lookup) -> int:
        """The master serves the lookup: the driver plans. The complete groups found (the validation's figure)."""
        assert job.driver is not None
        self.metrics.on_lookup(self.loop.now - job.prefill_start)
        result = job.lookup = self.index.lookup([group_id(job.play.namespace, h) for h in effect.candidates],
                                                held_prefix=effect.held)
        self._drive(job, job.driver.looked_up(result.num_found, str(result.lease_id) if result.lease_id else ""))
        return result.num_found

    def _restore(self, job: Job) -> None:
        """Every stage reads its objects of the planned chunks (objects on other servers also cross both
        servers' NICs)."""
        request, result = job.request, job.lookup
        assert request is not None and result is not None and request.restore_plan is not None
        num_chunks = request.restore_plan.num_pool_chunks
        job.read_s = self.cost.restore_s(num_chunks, self.stage_bytes_per_token)
        job.restore_start = self.loop.now
        job.restore_timed = True
        self.read(result.groups[:num_chunks], num_chunks, partial(self._restored, job))

    def read(self, groups: list, num_chunks: int, done: Callable[[int], None]) -> None:
        """Every stage reads its objects of ``num_chunks`` planned chunks (``groups``, located from the first
        chunk past the device's) for the cost model's restore time; objects on other servers cross both servers'
        NICs too. ``done(readable)`` once every part landed: the leading groups every stage could read."""
        readable = self.leading_readable(groups)
        remote = self.remote_bytes(groups[:readable])
        parts = [1 + len(remote)]

        def landed() -> None:
            parts[0] -= 1
            if not parts[0]:
                done(readable)

        self.loop.after(self.cost.restore_s(num_chunks, self.stage_bytes_per_token), landed)
        for host, nbytes in remote.items():
            self.network.send(host, self.host, nbytes, landed)

    def _restored(self, job: Job, readable: int) -> None:
        job.readable = readable
        request = job.request
        assert request is not None and job.driver is not None
        job.restored_at = self.loop.now
        num_chunks = request.restore_plan.num_pool_chunks if request.restore_plan else 0
        self.metrics.on_restore(self.loop.now - job.restore_start, num_chunks)
        if self.sessions is not None:  # as stage 0 does: the prefetch's lead follows the measured restores
            self.sessions.observe_restore(self, num_chunks, self.loop.now - job.restore_start)
        # every stage reads its own objects; a dead store fails every stage's read of its groups alike: the
        # forward's end says how far every stage got (short of the plan: planned again without the pool)
        self._forward(job)

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

    def _forward(self, job: Job) -> None:
        """The stages as a flow shop over the request's pieces (after its restore, when it had one)."""
        request = job.request
        assert request is not None
        if not job.restore_timed:  # nothing restored: the forward follows the lookup (or the admission)
            job.restore_start = job.restored_at = self.loop.now
            self.metrics.on_restore(0.0, 0)
            if self.sessions is not None:
                self.sessions.observe_restore(self, 0, 0.0)
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
        """The last stage computed its part: the driver commits the computed chunks (under validation at the
        commit's place in stage 0's recorded order: it decides which block caches a chunk); save, hand off."""
        self.block_gate(("commit", job.job_id), partial(self._forward_ended, job))

    def _forward_ended(self, job: Job) -> None:
        assert job.driver is not None
        counts = [job.readable] * self.num_stages if job.chain_restore else []
        saves = job.driver.save_held
        effects = self._recorded(job, job.driver.forward_ended(self.loop.now, counts))
        if not saves:  # a save of nothing releases nothing, in its place (a recorded order that names it waits)
            self.block_gate(("free", f"{job.job_id}/save"), lambda: None)
        self._carry_out(job, effects)

    def _save_then_free(self, job: Job, holder: str) -> None:
        """The save of the request's chunks, then its hold on their blocks ends (``saves_ended``): stage 0
        reserves every stage's object of every chunk in one put (none when there is nothing to save), the
        stages write their own, one commit; the blocks go back then, at their place in stage 0's order."""
        request, driver = job.request, job.driver
        assert request is not None and driver is not None
        chunks = list(request.chunks_to_save)

        def freed() -> None:
            self.block_gate(("free", holder), lambda: self._drive(job, driver.saves_ended(holder, self.loop.now)))

        if not chunks:
            freed()
            return
        self.master.call(self.cost.put_s(len(chunks) * self.num_stages), self.pool_gate,
                         ("put_start", f"{job.job_id}/0"), partial(self._put, job, chunks, freed))

    def _put(self, job: Job, chunks: list, freed: Callable[[], None]) -> int:
        """Write-through when the master serves the put: every stage's object of every chunk (stage by stage, as
        stage 0 reserves them), committed at the put end's place; bytes placed on another server's store load
        both NICs, and the commit does not wait for them. Returns the groups it evicted."""
        ns = job.play.namespace
        items = [PutRequestItem(object_key(ns, h, s), group_id(ns, h), self.num_stages, self.stage_object_bytes[s])
                 for s in range(self.num_stages) for h in chunks]
        evicted_before = self.index.counters.evicted_groups
        commits, remote = [], {}
        for item, outcome in zip(items, self.index.put_start(self.host, items)):
            if outcome.status is PutStatus.RESERVED:
                commits.append((item.key, 0))
                if outcome.segment is not None and outcome.segment.host != self.host:
                    remote[outcome.segment.host] = remote.get(outcome.segment.host, 0) + item.size
        evicted = self.index.counters.evicted_groups - evicted_before
        self.metrics.on_save(len(items), len(commits), evicted)
        for host, nbytes in remote.items():
            self.network.send(self.host, host, nbytes)

        def commit() -> int:
            if commits:  # stage 0 sends no put end when nothing was reserved
                self.index.put_end(commits)
            freed()
            return len(commits)

        self.pool_gate(("put_end", f"{job.job_id}/0"), commit)
        return evicted

    def handed_off(self, job: Job) -> None:
        """Decode has the KV: the hold ends and its blocks may serve the queue head."""
        driver = job.driver
        assert driver is not None
        self.block_gate(("free", job.job_id), lambda: self._drive(job, driver.release()))
