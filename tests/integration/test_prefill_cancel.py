"""A caller that goes away before its prefill runs: stage 0's scheduler, in this process (one stage,
the tiny model, no pool), with its gate or its device cache held on purpose, so the request is
certainly waiting where the test says when it is cancelled.

It leaves nothing behind (no blocks, no slot, no waiter), it is counted by where it was
(``kvpool_prefill_cancelled_total{phase}``), and the scheduler serves the next request. The cancel of
a running prefill, on real stage processes, is ``test_prefill_pipeline``'s.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import pytest

from kvpool.model import get_config
from kvpool.transfer import TransferEngine
from kvpool.services.prefill.handoff import HandoffMetrics, StageHandoff
from kvpool.services.prefill.metrics import PrefillMetrics
from kvpool.services.prefill.pieces import ActivationLink
from kvpool.services.prefill.stage0.scheduler import PrefillScheduler
from kvpool.services.prefill.settings import PrefillSettings
from kvpool.services.prefill.stage_runner import StageRunner
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

CHUNK = 16
NUM_BLOCKS = 4
CONFIG = get_config("tiny")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


@pytest.fixture
async def make(engine: TransferEngine) -> AsyncIterator[Callable[..., PrefillScheduler]]:
    made: list[PrefillScheduler] = []

    def build(**settings: object) -> PrefillScheduler:
        s = PrefillSettings(stage=0, num_stages=1, master="", chunk_size=CHUNK, device_cache_tokens=NUM_BLOCKS * CHUNK,
                            port=0, admin_port=0, **settings)  # type: ignore[arg-type]
        metrics = PrefillMetrics()
        runner = StageRunner(s, engine, None, metrics)
        handoff_metrics = HandoffMetrics(metrics.registry)
        made.append(PrefillScheduler(runner, ActivationLink(runner, s.next_address), [], None, metrics,
                                     StageHandoff(runner, handoff_metrics), handoff_metrics))
        return made[-1]
    yield build
    for scheduler in made:  # as the server closes them: the engine outlives them
        await scheduler.prefetcher.close()
        await scheduler.link.close()
        await scheduler.handoff.close()
        scheduler.runner.close()


def sample(scheduler: PrefillScheduler, name: str, **labels: str) -> float:
    value = scheduler.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def cancelled(scheduler: PrefillScheduler) -> dict[str, float]:
    return {phase: sample(scheduler, "kvpool_prefill_cancelled_total", phase=phase)
            for phase in ("queued", "admission", "running")}


async def serves_on(scheduler: PrefillScheduler) -> None:
    tokens = prompt(9, 3 * CHUNK)
    response = await scheduler.prefill(tokens, "next", False)
    assert response.figures.num_computed_tokens == len(tokens)
    assert scheduler.blocks.num_free_blocks == NUM_BLOCKS  # nothing is held after Prefill returns


async def test_cancelled_while_waiting_for_device_blocks(make) -> None:  # type: ignore[no-untyped-def]
    scheduler = make()
    scheduler.blocks.allocate("holder", [f"held-{i}" for i in range(NUM_BLOCKS)], NUM_BLOCKS * CHUNK, 0)  # every block
    waiting = asyncio.ensure_future(scheduler.prefill(prompt(1, 2 * CHUNK), "s", False, request_id="waits"))
    await eventually(lambda: sample(scheduler, "kvpool_prefill_admission_waiting") == 1,
                     what="the request waiting for device blocks")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cancelled(scheduler) == {"queued": 0, "admission": 1, "running": 0}
    assert sample(scheduler, "kvpool_prefill_admission_waiting") == 0
    assert not scheduler.blocks.has_holder("waits")
    await scheduler.free("holder")
    await serves_on(scheduler)


async def test_cancelled_while_queued_at_the_gate(make) -> None:  # type: ignore[no-untyped-def]
    scheduler = make(sched="session", sched_slots=1)
    gate = scheduler.gate
    assert gate is not None
    async with gate.slot("holder", 0.0):  # the one slot, taken
        waiting = asyncio.ensure_future(scheduler.prefill(prompt(2, 2 * CHUNK), "s", False, request_id="queued"))
        await eventually(lambda: len(gate.queue) == 1, what="the request queued at the gate")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert len(gate.queue) == 0
    assert cancelled(scheduler) == {"queued": 1, "admission": 0, "running": 0}
    assert gate.running == 0 and not scheduler.blocks.has_holder("queued")
    await serves_on(scheduler)
