"""Validation against the real system: the simulator's side and the comparison.

The same small configuration — trace sessions at a token scale, concurrency
1, no think time, a pool large enough that nothing is evicted — run through
the simulator and through a local cluster (``kvpool replay``) must give the
same device / pool / computed tokens for every turn, because both run the
same ``kvpool.core`` decisions in the same order. Times agree only as far
as the cost model describes the cluster: ``cost_model_cpu.toml`` is measured
on the host the validation runs on (``throughput_error`` and
``ttft_p50_error`` say how far off it is). ``replay_sessions`` plays several
sessions at once, with a pool that evicts, in the cluster's recorded orders of
stage 0's block events (``RecordedBlockEvents``) and of the master's pool
operations (``RecordedPoolOps``).

At a scale s a 64-token block becomes 64/s tokens and a prompt
``scaled_prompt_tokens`` tokens (``kvpool.workload.tokens``); a chunk is then
``chunk_size / (64/s)`` blocks, and a full chunk reaches the id-less tail
only when the tail fills a block, so chunk hashes over block ids split prompts
exactly as the cluster's token hashes do, except where the rounded-up tail
fills a whole block (``scaled_session`` gives it an id of its own content).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from kvpool.core.pool.settings import IndexSettings
from kvpool.tools.sim.cost_model import CostModel
from kvpool.tools.sim.engine import Simulation, layer_split
from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.metrics import percentile
from kvpool.tools.sim.topology import GIB, RunSettings, Topology
from kvpool.workload.tokens import scaled_block_tokens, scaled_prompt_tokens
from kvpool.workload.weka import Session


@dataclass(frozen=True, slots=True)
class TurnCounts:
    """One turn's prompt split, as either side reports it."""

    prompt_tokens: int
    device_tokens: int
    pool_tokens: int
    computed_tokens: int
    ttft_s: float = 0.0
    output_tokens: int = 0  # the real side's completion tokens (the simulator decodes the trace's, capped)


@dataclass(frozen=True, slots=True)
class ValidationSetup:
    """The small configuration both sides run (the cluster's flags, in the simulator's terms)."""

    scale: int = 16
    max_tokens: int = 64
    context: int = 32768
    chunk_size: int = 256
    num_stages: int = 4
    device_cache_tokens: int = 32768
    decode_kv_tokens: int = 1 << 20
    store_bytes: int = 1 << 40  # each of the two stores' segment (the pool is both)


def tail_block_id(last_id: int, input_tokens: int) -> int:
    """A block id for an id-less tail that fills a whole scaled block (content from ``(last id, input_tokens)``,
    as ``kvpool.workload.tokens`` makes it); above 2**31, where no trace id lives."""
    return (1 << 31) | xxhash.xxh32_intdigest(f"{last_id}:{input_tokens}".encode()) >> 1


def scaled_session(session: Session, scale: int, max_tokens: int) -> Session:
    """The session as a replay at ``scale`` sends it: blocks of 64/s tokens, prompts and outputs scaled/capped.

    At a scale the tail is rounded up (``ceil(rem * block_tokens / block_size)``), so it can fill a whole
    block: a full chunk then ends in tail tokens, and the tail gets a block id of its own content.
    """
    block_tokens = scaled_block_tokens(session.block_size, scale)
    turns = []
    for t in session.turns:
        full_blocks, rem = divmod(t.input_tokens, session.block_size)
        ids = t.hash_ids
        if len(ids) == full_blocks and -(-rem * block_tokens // session.block_size) == block_tokens:
            ids = (*ids, tail_block_id(ids[-1] if ids else -1, t.input_tokens))
        turns.append(replace(t, input_tokens=scaled_prompt_tokens(t.input_tokens, session.block_size, scale),
                             output_tokens=max(1, min(max_tokens, t.output_tokens)), hash_ids=ids))
    return replace(session, block_size=block_tokens, turns=tuple(turns))


def _setup_topology(setup: ValidationSetup, cost: CostModel) -> tuple[CostModel, Topology]:
    """The cost model at the setup's chunk, and one server sized as the setup's cluster: a stage holds
    exactly ``device_cache_tokens`` and decode ``decode_kv_tokens`` (GIB is a power of two: the divisions
    are exact)."""
    shape = replace(cost.model, chunk_tokens=setup.chunk_size)
    stage_token_bytes = max(layer_split(shape.num_layers, setup.num_stages)) * shape.kv_entry_bytes
    topology = Topology(
        num_servers=1, gpus_per_server=setup.num_stages + 1, num_stages=setup.num_stages, gpus_per_decode_shard=1,
        device_kv_gib_per_gpu=setup.device_cache_tokens * stage_token_bytes / GIB, decode_page_tokens=1,
        decode_kv_gib_per_gpu=setup.decode_kv_tokens * shape.kv_bytes_per_token / GIB,
        store_gib=setup.store_bytes / GIB, max_context=setup.context,
    )
    return replace(cost, model=shape), topology


def simulate_sessions(
    sessions: Sequence[Session], setup: ValidationSetup, cost: CostModel, max_turns: int | None = None,
    output_tokens: Sequence[int] | None = None,
) -> tuple[list[TurnCounts], float]:
    """Play the sessions one after another (concurrency 1, no think time) on one pipeline, at most
    ``max_turns`` turns; the counts per turn and the simulated seconds it took.

    ``output_tokens``, when given, replaces the outputs of the first turns played, in order (the real
    side's completion counts: the tiny model stops at its end-of-text token, rarely at the trace's output).

    The KV shape is the cost model's (its bytes time the restores and handoffs), at the setup's chunk;
    capacities are set in bytes so that a stage holds exactly ``device_cache_tokens`` and decode
    ``decode_kv_tokens`` (GIB is a power of two: the divisions are exact); the pool is made large.
    """
    cost, topology = _setup_topology(setup, cost)
    settings = RunSettings(num_sessions=1, duration_s=1e12, warmup_s=0.0, think=False, start_spread_s=0.0,
                           max_instances=len(sessions), max_turns=max_turns)
    scaled = [scaled_session(s, setup.scale, setup.max_tokens) for s in sessions]
    if output_tokens is not None:
        outputs = iter(output_tokens)
        scaled = [replace(s, turns=tuple(replace(t, output_tokens=max(1, next(outputs, t.output_tokens)))
                                         for t in s.turns)) for s in scaled]
    sim = Simulation(topology, settings, cost, scaled)
    sim.run()
    ttft = iter(sim.metrics.ttft_s)
    counts = [TurnCounts(d + p + c, d, p, c, next(ttft, 0.0)) for _, d, p, c in sim.metrics.turn_tokens]
    return counts, sim.loop.now


# ("touch", request id): its arrival touched its session's blocks; ("admit", request id); or ("free", holder:
# a request id or "<request id>/save")
BlockEvent = tuple[str, str]
# (op, holder): ("lookup" | "release", request id) or ("put_start" | "put_end", "<request id>/<stage>")
PoolOp = tuple[str, str]


class _RecordedOrder:
    """Steps in a recorded order, as a gate: a step the order names runs only once every step before it
    has run; a step the order does not name runs at once."""

    def __init__(self, steps: Sequence[tuple[str, str]], loop: EventLoop) -> None:
        self._steps = deque(steps)
        self._named = set(steps)
        self._deferred: dict[tuple[str, str], Callable[[], Any]] = {}
        self._loop = loop

    @property
    def num_left(self) -> int:
        """Recorded steps the run did not reach (0: it followed the whole order)."""
        return len(self._steps)

    def head(self) -> tuple[str, str] | None:
        return self._steps[0] if self._steps else None

    def run(self, step: tuple[str, str], apply: Callable[[], Any]) -> None:
        """Apply ``step`` when the order reaches it."""
        if step not in self._named:
            apply()
            return
        self._deferred[step] = apply
        self._loop.after(0.0, self.drain)

    def drain(self) -> None:
        while self._steps and self._steps[0] in self._deferred:
            step = self._steps.popleft()
            self._ran(step, self._deferred.pop(step)())

    def _ran(self, step: tuple[str, str], outcome: Any) -> None:
        """What a subclass checks once a named step has run."""


class RecordedBlockEvents(_RecordedOrder):
    """Stage 0's block events in the cluster's recorded order, as a gate for the simulated pipeline
    (``run`` is the pipeline's ``block_gate``).

    Invariant: an event the order names runs only once every event before it has run, admissions
    included; an event the order does not name (a save the cluster did not make, a touch a log without
    touches does not show) runs at once.
    """

    def admitted(self) -> None:
        self._steps.popleft()
        self._loop.after(0.0, self.drain)  # not inside the pipeline's kick: it is mid-admission


class RecordedPoolOps(_RecordedOrder):
    """The master's operations in the cluster's recorded order, as a gate for the simulated pool.

    Invariant: an operation the order names runs only once every operation before it has run; one the
    order does not name (an operation the cluster did not make) runs at once. ``figures`` holds the
    cluster's outcome of each named operation (a lookup's complete groups, a put start's evictions) and
    ``differing`` the operations whose simulated outcome was not that (``apply`` returns its outcome's
    figure, or None where there is none to compare).
    """

    def __init__(self, ops: Sequence[tuple[PoolOp, int]], loop: EventLoop) -> None:
        super().__init__([op for op, _ in ops], loop)
        self.figures = {op: figure for op, figure in ops}
        self.differing: list[PoolOp] = []

    def _ran(self, step: PoolOp, outcome: int | None) -> None:
        if outcome is not None and outcome != self.figures[step]:
            self.differing.append(step)


class RecordedOrderQueue:
    """A pipeline's queue that admits a request only when the recorded block events reach its admission.

    Invariant: ``peek`` is the request whose admission is the next recorded event once it has arrived,
    else None. ``len`` counts the waiting requests only while that one can go (the pipeline starts a
    request only when ``len`` is non-zero).
    """

    num_overdue_pops = num_budget_pops = num_backlog_pops = 0  # no aging, budget, gate: the recorded order is the order

    def __init__(self, events: RecordedBlockEvents) -> None:
        self._events = events
        self._waiting: set[str] = set()

    def _head(self) -> str | None:
        head = self._events.head()
        return head[1] if head is not None and head[0] == "admit" and head[1] in self._waiting else None

    def __len__(self) -> int:
        return len(self._waiting) if self._head() is not None else 0

    def push(self, request_id: str, work: float, now: float) -> None:
        self._waiting.add(request_id)

    def peek(self, now: float) -> str | None:
        return self._head()

    def pop(self, now: float) -> str | None:
        head = self._head()
        if head is not None:
            self._waiting.discard(head)
            self._events.admitted()
        return head


def replay_sessions(
    sessions: Sequence[Session], setup: ValidationSetup, cost: CostModel, events: Sequence[BlockEvent],
    output_tokens: Mapping[tuple[int, int], int] | None = None, pool_ops: Sequence[tuple[PoolOp, int]] = (),
) -> tuple[dict[tuple[int, int], TurnCounts], float, dict[str, Any]]:
    """Play the sessions at once (one slot each, no think time) on one pipeline, admitting turns and
    releasing their blocks in the cluster's recorded order of stage 0's block ``events`` (request ids
    ``s{session index}.t{turn index}``); every turn admitted there and no other. Each pool operation
    (a lookup, a lease's release, each stage's put start and end) is applied in the recorded order of the
    master's ``pool_ops``, with the cluster's outcome of each (``RecordedPoolOps``); leases do not expire
    (an expired one shows as a release that differs).

    The counts per (session, turn), the simulated seconds, and the pool's counters (``pool_tokens`` and
    ``evictions``: groups the simulated master evicted). ``output_tokens`` replaces the outputs of the
    turns it names (the real side's completion counts). The shape is as in ``simulate_sessions``.
    """
    cost, topology = _setup_topology(setup, cost)
    admits = [request_id for kind, request_id in events if kind == "admit"]
    # a bound on simulated time: an order the simulator could not follow stops there, not never
    settings = RunSettings(num_sessions=len(sessions), duration_s=3600.0, warmup_s=0.0, think=False,
                           start_spread_s=0.0, max_instances=len(sessions), max_turns=len(admits))
    outputs = output_tokens or {}
    scaled = []
    for k, session in enumerate(sessions):
        s = scaled_session(session, setup.scale, setup.max_tokens)
        scaled.append(replace(s, turns=tuple(replace(t, output_tokens=max(1, outputs.get((k, i), t.output_tokens)))
                                             for i, t in enumerate(s.turns))))
    sim = Simulation(topology, settings, cost, scaled, index_settings=IndexSettings(lease_s=1e9))
    # instance k plays sessions[k] (no restarts past len(sessions)): job ids are "s{k}.t{turn}"
    recorded = RecordedBlockEvents(events, sim.loop)
    master = RecordedPoolOps(pool_ops, sim.loop)
    for pipeline in sim.pipelines.values():  # one
        pipeline.queue = RecordedOrderQueue(recorded)  # type: ignore[assignment]
        pipeline.block_gate = recorded.run
        pipeline.pool_gate = master.run
        pipeline.recorded = True
        pipeline.effects = {}  # each request's driver effects, to compare with the cluster's
    sim.router.effects = {}  # and its router driver's
    sim.run()
    counts = {}
    for job_id, d, p, c in sim.metrics.turn_tokens:
        session_key, turn = job_id.split(".t")
        counts[(int(session_key[1:]), int(turn))] = TurnCounts(d + p + c, d, p, c)
    ttft = sorted(sim.metrics.ttft_s)
    pool = {"pool_tokens": sum(t.pool_tokens for t in counts.values()),
            "evictions": sum(i.counters.evicted_groups for i in sim.indexes),
            "ttft_p50_s": percentile(ttft, 50) if ttft else 0.0, "events_left": recorded.num_left,
            "pool_ops_left": master.num_left, "pool_ops_differing": master.differing,
            "effects": {job_id: e for p in sim.pipelines.values() for job_id, e in (p.effects or {}).items()},
            "router_effects": sim.router.effects,
            # where an order the simulator could not follow stopped (None: followed to its end)
            "stopped_at": (recorded.head(), master.head())}
    return counts, sim.loop.now, pool


def comparable_effects(effects: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One request's driver effects as both sides can agree on them: its waits for blocks left out (the
    sides wait as their clocks go), holders by kind (the request's or its save's: the ids differ), and the
    save's free last (the saves end beside the request, as each side's timing goes)."""
    out: list[dict[str, Any]] = []
    saves: list[dict[str, Any]] = []
    for effect in effects:
        if effect.get("effect") == "WaitForBlocks":
            continue
        e = dict(effect)
        if e.get("effect") == "SavesThenFree":
            e["holder"] = "save"
        if e.get("effect") == "Freed":
            e["holders"] = ["save" if str(h).endswith("/save") else "request" for h in e.get("holders", ())]
            if e["holders"] == ["save"]:
                saves.append(e)
                continue
        out.append(e)
    return out + saves


def differing_effects(sim: Mapping[str, Sequence[Mapping[str, Any]]],
                      real: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """The requests (named as the simulator names them) whose effects differ, one by one, in order."""
    return [name for name in sorted(real, key=_turn_order)
            if comparable_effects(real[name]) != comparable_effects(sim.get(name, ()))]


def _turn_order(name: str) -> tuple[int, int]:
    session, turn = name.split(".t")
    return int(session[1:]), int(turn)
