"""A simulated prefill pipeline: stage 0's core pieces (``Stage0Admission``, ``PrefillDriver``) over the core's
``BlockManager`` and ``PoolIndex``, their effects timed by the cost model and the shared master and NICs.

Gated (the simulator's runs), stage 0 admits one request at a time, when it has computed its part of the
last one; ``ungated`` (the validation's cluster) every request tries its admission on arrival. A restore
rides the forward's chain (each stage reads its objects; objects on other servers cross both NICs), the
stages are a flow shop (``stages``), a save is one put of every stage's object of each chunk, off the
request's path, and the request's blocks stay held until its handoff to decode ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import ChunkHash, group_id, save_objects
from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.records import LookupResult, PutRequestItem, PutStatus
from kvpool.core.prefill.queue import PrefillQueue, WorkWeights
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
from kvpool.core.sessions.prefetch import SessionPrefetch
from kvpool.tools.sim.cost_model import CostModel
from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.job import Job, session_of
from kvpool.tools.sim.metrics import Metrics
from kvpool.tools.sim.network import MasterQueue, Network
from kvpool.tools.sim.stages import StageFlow


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
    prefetch: SessionPrefetch | None = None  # sched=session: the pipeline's policy (``session_sim.SessionAware``)
    # ``block_gate`` runs each of stage 0's block events (a turn's touch of its session on arrival, "touch";
    # a forward's commit, "commit"; a release of a request's blocks or its save's, "free") and ``pool_gate``
    # each pool operation (a lookup, a lease's release, a save's put start and end): at once, or under
    # validation when the cluster's recorded order reaches it
    block_gate: Callable[[tuple[str, str], Callable[[], object]], None] = field(default=lambda step, apply: apply())
    pool_gate: Callable[[tuple[str, str], Callable[[], int | None]], None] = field(default=lambda step, apply: apply())
    ungated: bool = False  # stage 0 without a gate (the validation's cluster): each request admitted on arrival
    # gated, the queue head's admission (the gate hands it stage 0): at once, or under validation at its recorded place
    admit_gate: Callable[[tuple[str, str], Callable[[], object]], None] | None = None
    _head: Job | None = None  # gated: the head handed stage 0 that waits for blocks (it tries again untouched)
    _waiting: dict[str, Job] = field(default_factory=dict)  # queued jobs by id
    _blocked: list[Job] = field(default_factory=list)  # ungated: requests waiting for blocks
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
        self.admission = Stage0Admission(self.blocks, self.prefetch)

    def enqueue(self, job: Job) -> None:
        """A turn arrives: its session's blocks are touched and it queues; ``ungated`` (the validation's cluster
        runs stage 0 without a gate) it tries its admission at once instead (each at its recorded place)."""
        self.block_gate(("touch", job.job_id), partial(self._arrived, job))
        if self.ungated:
            self.block_gate(("admit", job.job_id), partial(self._try, job, None))

    def _arrived(self, job: Job) -> None:
        if not self.ungated:  # it queues as it touches its session (one step of stage 0's)
            self._waiting[job.job_id] = job
            self.queue.push(job.job_id, self.estimate_work_s(job), self.loop.now)
        self.admission.arrived(session_of(job), self.loop.now)
        self.kick()  # its admission may be the next event

    def estimate_work_s(self, job: Job) -> float:
        """What the turn brings, as stage 0 sees it on arrival (the core's ``Stage0Admission.work_s``, as stage 0
        calls it; the simulator's weights are its cost model's, so no host factor)."""
        return self.admission.work_s(job.play.hashes, job.turn.input_tokens, session_of(job), self.work_weights)

    def kick(self) -> None:
        """Admit the queue's requests in its order while stage 0 is free and their blocks fit (the waiting
        histories touched in serving order under more than one waiter, as stage 0's gate does); ``ungated``,
        try again the requests that wait for blocks."""
        for job in self._blocked[:] if self.ungated else ():
            self._blocked.remove(job)
            self._try(job, None)
        while not self.busy and len(self.queue):
            job = self._waiting[self.queue.peek(self.loop.now) or ""]
            if job is not self._head and self.admit_gate is not None:
                self.admit_gate(("admit", job.job_id), partial(self._hand, job))
                return
            if not self._hand(job):
                return

    def _hand(self, job: Job) -> bool:
        """The gate hands stage 0 its head: the head's and the waiters' sessions are touched in serving order,
        once (as stage 0 does when its gate hands a slot); a head that waits for blocks tries again untouched."""
        retry, self._head = job is self._head, job
        return self._try(job, None if retry else [session_of(self._waiting[i])
                                                  for i in self.queue.serving_order(self.loop.now)])

    def _try(self, job: Job, serving: list | None) -> bool:
        """``job`` tries its admission (the core's ``Stage0Admission`` steps, as stage 0 takes them): admitted,
        or it waits for blocks (held stagings yield to it first)."""
        if job.driver is None:  # stage 0's driver of the request, as the cluster runs it
            job.driver = PrefillDriver(job.job_id, job.turn.input_tokens, self.cost.model.chunk_tokens,
                                       job.play.hashes, self.blocks, math.inf, session=session_of(job))
        effects = self.admission.admit(job.driver, self.loop.now, serving)
        while waits_for_blocks(effects):
            self._carry_out(job, effects)  # (kept only)
            if not self.admission.short_of_blocks():
                self._blocked += [job] if self.ungated else []
                return False
            effects = self.admission.admit(job.driver, self.loop.now, serving)
        if not self.ungated:
            self.queue.pop(self.loop.now)
            del self._waiting[job.job_id]
            self.busy, self._head = True, None
        job.request = job.driver.request
        self.admission.admitted(job.request)
        job.prefill_start = self.loop.now
        self.metrics.on_prefill_start(job)
        self._carry_out(job, effects)
        return True

    def _carry_out(self, job: Job, effects: list[Effect]) -> None:
        """The driver's effects of one event, in simulated time (kept per request under validation)."""
        if self.effects is not None:
            self.effects.setdefault(job.job_id, []).extend(effect_fields(e) for e in effects)
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
        result = job.lookup = self.lookup(job.play.namespace, effect.candidates, effect.held)
        self._carry_out(job, job.driver.looked_up(result.num_found, str(result.lease_id) if result.lease_id else ""))
        return result.num_found

    def lookup(self, namespace: str, candidates: Sequence[ChunkHash], held: int) -> LookupResult:
        """The master's lookup of ``candidates`` by their ids. Its history handle goes at once: the simulated
        driver names every id each time and never sends one, and a kept handle would keep its groups in memory
        after the index forgot them (up to twice the index's groups, ``kvpool.core.pool.histories``)."""
        result = self.index.lookup([group_id(namespace, h) for h in candidates], held_prefix=held)
        if result.history:
            self.index.histories.drop(result.history)
        return result

    def _restore(self, job: Job) -> None:
        """Every stage reads its objects of the planned chunks, then the forward (a dead store fails every
        stage's read of its groups alike: the forward's end says how far they got)."""
        request, result = job.request, job.lookup
        assert request is not None and result is not None and request.restore_plan is not None
        num_chunks = request.restore_plan.num_pool_chunks
        job.restore_start, job.restore_timed = self.loop.now, True

        def restored(readable: int) -> None:
            job.readable, job.restored_at = readable, self.loop.now
            self._observe_restore(num_chunks, self.loop.now - job.restore_start)
            self._forward(job)

        self.read(result.groups[:num_chunks], num_chunks, restored)

    def _observe_restore(self, num_chunks: int, seconds: float) -> None:
        self.metrics.on_restore(seconds, num_chunks)
        if self.prefetch is not None:  # as stage 0 does: the prefetch's lead follows the measured restores
            self.prefetch.observe_restore(num_chunks, seconds)

    def read(self, groups: list, num_chunks: int, done: Callable[[int], None]) -> None:
        """Every stage reads its objects of ``num_chunks`` planned chunks (``groups``) in the cost model's restore
        time, objects on other servers across both NICs too; then ``done(the leading groups every stage could
        read``: a read from a dead store fails)."""
        segments, readable, remote, dead = self.index.segments, len(groups), {}, self.dead_hosts
        local = {sid for sid, seg in segments.items() if seg.host == self.host}
        for i, group in enumerate(groups):
            if dead and any((seg := segments.get(s)) is None or seg.host in dead for s in group.segment_ids):
                readable = i
                break
            for segment_id, size in zip(group.segment_ids, group.sizes):
                if segment_id not in local and (seg := segments.get(segment_id)) is not None:
                    remote[seg.host] = remote.get(seg.host, 0) + size
        parts = [1 + len(remote)]

        def landed() -> None:
            parts[0] -= 1
            if not parts[0]:
                done(readable)

        self.loop.after(self.cost.restore_s(num_chunks, self.stage_bytes_per_token), landed)
        for host, nbytes in remote.items():
            self.network.send(host, self.host, nbytes, landed)

    def _forward(self, job: Job) -> None:
        """The stages as a flow shop over the request's pieces (after its restore, when it had one)."""
        request = job.request
        assert request is not None
        if not job.restore_timed:  # nothing restored: the forward follows the lookup (or the admission)
            job.restore_start = job.restored_at = self.loop.now
            self._observe_restore(0, 0.0)
        if self.flow is None:
            self.flow = StageFlow(self.num_stages)
        times = self.cost.stage_times(request.compute_start, request.num_computed_tokens)
        ends = self.flow.schedule(self.loop.now, times)
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
        effects = job.driver.forward_ended(self.loop.now, counts)
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
            self.block_gate(("free", holder), lambda: self._carry_out(job, driver.saves_ended(holder, self.loop.now)))

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
        items = [PutRequestItem(*o) for o in save_objects(ns, chunks, self.stage_object_bytes)]
        evicted_before = self.index.counters.evicted_groups
        commits, remote = [], {}
        for item, outcome in zip(items, self.index.put_start_grouped(self.host, items)):  # as the master serves it
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
                self.index.put_end_grouped(commits)  # as the master serves it
            freed()
            return len(commits)

        self.pool_gate(("put_end", f"{job.job_id}/0"), commit)
        return evicted

    def handed_off(self, job: Job) -> None:
        """Decode has the KV: the hold ends and its blocks may serve the queue head."""
        driver = job.driver
        assert driver is not None
        self.block_gate(("free", job.job_id), lambda: self._carry_out(job, driver.release()))
