"""``simulate --validate``'s simulator side: the validation sessions replayed in a cluster's recorded orders.

Both sides run the same ``kvpool.core`` pieces (the router's driver over ``Admission``, stage 0's admission
and driver, the master's index), so given the same order of stage 0's block events (``RecordedBlockEvents``)
and of the master's pool operations (``RecordedPoolOps``), every turn's device / pool / computed tokens and
every request's effects come out equal; times agree only as far as the cost model (``cost_model_cpu.toml``,
measured on this host) describes the cluster.

At a scale s a 64-token block becomes 64/s tokens and a prompt ``scaled_prompt_tokens`` tokens
(``kvpool.workload.tokens``), so chunk hashes over block ids split prompts as the cluster's token hashes
do, except where the rounded-up tail fills a whole block (``scaled_session`` gives it an id of its own).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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
    """One turn's prompt split, as either side reports it (equal: the same split, whatever the times)."""

    prompt_tokens: int
    device_tokens: int
    pool_tokens: int
    computed_tokens: int
    ttft_s: float = field(default=0.0, compare=False)
    # the real side's completion tokens (the simulator decodes the trace's, capped)
    output_tokens: int = field(default=0, compare=False)


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


def scaled_session(session: Session, scale: int, max_tokens: int, outputs: Mapping[int, int] | None = None) -> Session:
    """The session as a replay at ``scale`` sends it: blocks of 64/s tokens, prompts and outputs scaled/capped
    (a rounded-up tail that fills a whole block gets a block id of its own content); ``outputs``: the turns'
    (by index) output tokens instead, where it names them (the cluster's)."""
    block_tokens = scaled_block_tokens(session.block_size, scale)
    turns = []
    for i, t in enumerate(session.turns):
        full_blocks, rem = divmod(t.input_tokens, session.block_size)
        ids = t.hash_ids
        if len(ids) == full_blocks and -(-rem * block_tokens // session.block_size) == block_tokens:
            ids = (*ids, tail_block_id(ids[-1] if ids else -1, t.input_tokens))
        turns.append(replace(t, input_tokens=scaled_prompt_tokens(t.input_tokens, session.block_size, scale),
                             output_tokens=max(1, (outputs or {}).get(i, min(max_tokens, t.output_tokens))),
                             hash_ids=ids))
    return replace(session, block_size=block_tokens, turns=tuple(turns))


def setup_topology(setup: ValidationSetup, cost: CostModel) -> tuple[CostModel, Topology]:
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


# ("touch" | "admit" | "commit", request id) or ("free", a request id or "<request id>/save")
BlockEvent = tuple[str, str]
# ("lookup" | "release", request id) or ("put_start" | "put_end", "<request id>/<stage>")
PoolOp = tuple[str, str]


class RecordedOrder:
    """Steps in a recorded order, each with the cluster's outcome (a figure, or None), as a gate: a step the
    order names runs only once every step before it has run, and ``differing`` lists those whose outcome
    (``apply``'s return, None: nothing to compare) differs; a step it does not name runs at once."""

    def __init__(self, steps: Sequence[tuple[tuple[str, str], int | None]], loop: EventLoop) -> None:
        self._steps = deque(step for step, _ in steps)
        self.figures = dict(steps)
        self._deferred: dict[tuple[str, str], Callable[[], Any]] = {}
        self._loop = loop
        self.differing: list[tuple[str, str]] = []

    @property
    def num_left(self) -> int:
        """Recorded steps the run did not reach (0: it followed the whole order)."""
        return len(self._steps)

    def head(self) -> tuple[str, str] | None:
        return self._steps[0] if self._steps else None

    def run(self, step: tuple[str, str], apply: Callable[[], Any]) -> None:
        if step not in self.figures:
            apply()
            return
        self._deferred[step] = apply
        self._loop.after(0.0, self.drain)

    def drain(self) -> None:
        while self._steps and self._steps[0] in self._deferred:
            step = self._steps.popleft()
            outcome = self._deferred.pop(step)()
            if outcome is not None and self.figures[step] is not None and outcome != self.figures[step]:
                self.differing.append(step)


RecordedPoolOps = RecordedOrder  # the master's operations, with their outcomes


class RecordedBlockEvents(RecordedOrder):
    """Stage 0's block events as such a gate (the pipeline's ``block_gate``), but an admission the order does
    not name never runs: the cluster never admitted that turn."""

    def __init__(self, events: Sequence[BlockEvent], loop: EventLoop) -> None:
        super().__init__([(event, None) for event in events], loop)

    def run(self, step: tuple[str, str], apply: Callable[[], Any]) -> None:
        if step[0] != "admit" or step in self.figures:
            super().run(step, apply)


def replay_sessions(
    sessions: Sequence[Session], setup: ValidationSetup, cost: CostModel, events: Sequence[BlockEvent],
    output_tokens: Mapping[tuple[int, int], int] | None = None, pool_ops: Sequence[tuple[PoolOp, int]] = (),
    gated: bool = False,
) -> tuple[dict[tuple[int, int], TurnCounts], float, dict[str, Any]]:
    """Play the sessions at once (no think time) on one pipeline, stage 0's block ``events`` and the
    master's ``pool_ops`` each in the cluster's recorded order (request ids ``s{session}.t{turn}``); leases do
    not expire. Ungated, each turn tries its admission at its recorded place; ``gated``, the pipeline's own
    FIFO queue hands stage 0 its head, one request at a time, the head's and the waiters' sessions touched in
    serving order, at the place where the cluster's gate handed one (an arrival queues at its recorded place:
    the "touch"; a head the cluster did not hand there is never handed). ``output_tokens`` replaces the
    outputs of the turns it names (the cluster's). The counts per (session, turn), the simulated seconds, and
    the pool's figures and each request's effects."""
    cost, topology = setup_topology(setup, cost)
    admits = [request_id for kind, request_id in events if kind == "admit"]
    # a bound on simulated time: an order the simulator could not follow stops there, not never
    settings = RunSettings(num_sessions=len(sessions), duration_s=3600.0, warmup_s=0.0, think=False,
                           start_spread_s=0.0, max_instances=len(sessions), max_turns=len(admits))
    outputs = output_tokens or {}
    scaled = [scaled_session(session, setup.scale, setup.max_tokens, {i: n for (j, i), n in outputs.items() if j == k})
              for k, session in enumerate(sessions)]
    sim = Simulation(topology, settings, cost, scaled, index_settings=IndexSettings(lease_s=1e9))
    # instance k plays sessions[k] (no restarts past len(sessions)): job ids are "s{k}.t{turn}"
    recorded = RecordedBlockEvents(events, sim.loop)
    master = RecordedPoolOps(pool_ops, sim.loop)
    for pipeline in sim.pipelines.values():  # one, gated or not as the cluster's stage 0
        pipeline.block_gate = recorded.run
        pipeline.pool_gate = master.run
        pipeline.ungated = not gated
        pipeline.admit_gate = recorded.run if gated else None
        pipeline.effects = {}  # each request's driver effects, to compare with the cluster's
    sim.router.effects = {}  # and its router driver's
    sim.run()
    counts = {turn_key(job_id): TurnCounts(d + p + c, d, p, c) for job_id, d, p, c in sim.metrics.turn_tokens}
    ttft = sorted(sim.metrics.ttft_s)
    pool = {"pool_tokens": sum(t.pool_tokens for t in counts.values()),
            "evictions": sum(i.counters.evicted_groups for i in sim.indexes),
            "device_evictions": sum(p.blocks.num_evicted for p in sim.pipelines.values()),
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


def differing_effects(sim: Mapping[str, Sequence[Mapping[str, Any]]], real: Mapping[str, Sequence[Mapping[str, Any]]],
                      comparable: Callable[[Sequence[Mapping[str, Any]]], Any] = comparable_effects) -> list[str]:
    """The requests (named as the simulator names them) whose effects differ, one by one, in order (stage 0's
    as ``comparable_effects`` has them; the router's, ``list``: as they are)."""
    return [name for name in sorted(real, key=turn_key) if comparable(real[name]) != comparable(sim.get(name, ()))]


def turn_key(request_id: str) -> tuple[int, int]:
    """``s{k}.t{i}`` → (k, i)."""
    session, turn = request_id.split(".t")
    return int(session[1:]), int(turn)
