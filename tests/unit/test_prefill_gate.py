"""Stage 0's gate: order (work-aware or FIFO), slots, and a cancelled waiter (asyncio only, no process)."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvpool.core.prefill.queue import QueueOrder
from kvpool.core.sessions.table import SessionId
from kvpool.services.prefill.stage0.gate import PrefillGate
from kvpool.services.prefill.settings import PrefillSettings


async def hold(gate: PrefillGate, name: str, work: float, order: list[str], release: asyncio.Event) -> None:
    async with gate.slot(name, work):
        order.append(name)
        await release.wait()


def test_least_work_runs_first_within_the_slots_and_a_cancelled_waiter_leaves() -> None:
    async def main() -> None:
        gate, order = PrefillGate(slots=1, max_wait_s=60.0), []
        go = {n: asyncio.Event() for n in "abcd"}
        tasks = {n: asyncio.ensure_future(hold(gate, n, w, order, go[n])) for n, w in
                 (("a", 9.0), ("b", 5.0), ("c", 1.0), ("d", 3.0))}
        await asyncio.sleep(0.01)
        assert (order, gate.running, len(gate.queue)) == (["a"], 1, 3)
        tasks["d"].cancel()  # its client went away while it waited
        await asyncio.sleep(0.01)
        assert len(gate.queue) == 2
        go["a"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "c"]
        go["c"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "c", "b"]
        go["b"].set()
        await asyncio.gather(tasks["a"], tasks["b"], tasks["c"])
        assert (gate.running, len(gate.queue)) == (0, 0)

    asyncio.run(main())


def test_a_slot_handed_to_a_cancelled_waiter_passes_on() -> None:
    async def main() -> None:
        gate, order = PrefillGate(slots=1, max_wait_s=60.0), []
        go = {n: asyncio.Event() for n in "abc"}
        a = asyncio.ensure_future(hold(gate, "a", 1.0, order, go["a"]))
        await asyncio.sleep(0.01)
        b = asyncio.ensure_future(hold(gate, "b", 1.0, order, go["b"]))
        c = asyncio.ensure_future(hold(gate, "c", 2.0, order, go["c"]))
        await asyncio.sleep(0.01)
        go["a"].set()  # a leaves: b is handed the slot ...
        await asyncio.sleep(0)
        b.cancel()  # ... and cancelled before it runs
        go["c"].set()
        await asyncio.gather(a, c)
        assert order == ["a", "c"] and (gate.running, len(gate.queue)) == (0, 0)

    asyncio.run(main())


async def served(gate: PrefillGate, release: str) -> list[str]:
    """a (9 s of work) takes the one slot, then b (5), c (1) and d (3) wait; each is let go in ``release``'s
    order once it runs. Returns the order they ran in."""
    order: list[str] = []
    go = {n: asyncio.Event() for n in "abcd"}
    tasks = [asyncio.ensure_future(hold(gate, n, w, order, go[n])) for n, w in
             (("a", 9.0), ("b", 5.0), ("c", 1.0), ("d", 3.0))]
    await asyncio.sleep(0.01)
    for name in release:
        go[name].set()
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    return order


def test_the_fifo_order_takes_the_same_slots_in_arrival_order() -> None:
    async def main() -> None:
        gate = PrefillGate(slots=1, max_wait_s=60.0, order=QueueOrder.FIFO)
        assert await served(gate, "abcd") == ["a", "b", "c", "d"] and (gate.running, len(gate.queue)) == (0, 0)

    asyncio.run(main())


def test_the_bypass_budget_holds_back_a_prefill_that_would_overdraw_an_older_one() -> None:
    from prometheus_client import generate_latest

    from kvpool.services.prefill.metrics import GatePopsCollector, PrefillMetrics

    async def main() -> None:
        gate, metrics = PrefillGate(slots=1, max_wait_s=60.0, max_bypass_s=2.0), PrefillMetrics()
        metrics.registry.register(GatePopsCollector(gate.queue))  # as stage 0 does
        order = await served(gate, "acbd")
        # c (1 s) overtakes b, whose 2 s of credit keep 1: d's 3 s would overdraw it, so b goes first
        assert order == ["a", "c", "b", "d"] and gate.queue.num_budget_pops == 1
        text = generate_latest(metrics.registry).decode()
        assert 'kvpool_prefill_gate_pops_total{decided_by="aging"} 0.0' in text
        assert 'kvpool_prefill_gate_pops_total{decided_by="budget"} 1.0' in text

    asyncio.run(main())


def test_stage_0_queue_settings_are_checked_and_reach_the_gate() -> None:
    settings = PrefillSettings(num_stages=1, sched="session", sched_max_wait_s=math.inf, sched_max_bypass_s=2.0)
    gate = PrefillGate(settings.sched_slots, settings.sched_max_wait_s, QueueOrder.WORK, settings.sched_max_bypass_s)
    assert (gate.queue.max_wait_s, gate.queue.max_bypass_s) == (math.inf, 2.0)
    assert PrefillSettings(num_stages=1).sched_max_bypass_s == math.inf  # no budget unless given
    with pytest.raises(ValueError, match="sched_max_bypass_s: must be >= 0"):
        PrefillSettings(num_stages=1, sched_max_bypass_s=-1.0)
    with pytest.raises(ValueError, match="sched_max_wait_s: must be positive"):
        PrefillSettings(num_stages=1, sched_max_wait_s=0.0)
    gated = PrefillSettings(num_stages=1, sched="session", sched_reorder_below_s=12.0)
    gate = PrefillGate(gated.sched_slots, gated.sched_max_wait_s, QueueOrder.WORK, gated.sched_max_bypass_s,
                       gated.sched_reorder_below_s)
    assert gate.queue.reorder_below_s == 12.0 and PrefillSettings(num_stages=1).sched_reorder_below_s == math.inf
    with pytest.raises(ValueError, match="sched_reorder_below_s: must be positive"):
        PrefillSettings(num_stages=1, sched_reorder_below_s=0.0)


def test_sched_slots_default_to_no_gate_with_fifo_and_one_a_stage_with_session() -> None:
    def slots(num_stages: int = 1, **given: object) -> int:
        later = [f"127.0.0.1:{7001 + i}" for i in range(num_stages - 1)]
        return PrefillSettings(num_stages=num_stages, stage_addresses=later, **given).sched_slots  # type: ignore[arg-type]

    assert (slots(), slots(sched="session")) == (0, 2)  # at least two
    assert (slots(4), slots(4, sched="session")) == (0, 4)  # four stages: each can work on its own prompt
    assert (slots(sched="fifo", sched_slots=3), slots(4, sched="session", sched_slots=2)) == (3, 2)
    assert slots(sched="session", sched_slots=0) == 0


def test_waiting_sessions_come_in_serving_order_and_leave_with_their_waiter() -> None:
    """What the scheduler touches before an admission (the next served the last evicted)."""

    async def held(gate: PrefillGate, name: str, work: float, release: asyncio.Event) -> None:
        async with gate.slot(name, work, SessionId("t", name)):
            await release.wait()

    async def main() -> None:
        gate = PrefillGate(slots=1, max_wait_s=60.0)
        go = {n: asyncio.Event() for n in "abcd"}
        tasks = {n: asyncio.ensure_future(held(gate, n, w, go[n])) for n, w in
                 (("a", 9.0), ("b", 5.0), ("c", 1.0), ("d", 3.0))}
        await asyncio.sleep(0.01)
        assert gate.waiting_sessions(0.0) == [SessionId("t", n) for n in "cdb"]  # a runs; least work first
        tasks["d"].cancel()
        await asyncio.sleep(0.01)
        assert gate.waiting_sessions(0.0) == [SessionId("t", n) for n in "cb"]
        go["a"].set()
        await asyncio.sleep(0.01)
        assert gate.waiting_sessions(0.0) == [SessionId("t", "b")]  # c was served
        go["b"].set(), go["c"].set()
        await asyncio.gather(tasks["a"], tasks["b"], tasks["c"])
        assert gate.waiting_sessions(0.0) == [] and gate._sessions == {}

    asyncio.run(main())
