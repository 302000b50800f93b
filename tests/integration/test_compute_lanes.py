"""A stage's compute lanes (``services/prefill/stage_runner.py``): one thread per tenant, the real tiny model
in this process, one stage, no pool. Another tenant's short forward runs while a long piece computes; the
same tenant's waits for it, in the order it came; a short piece with nothing else computing skips the thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvpool.model import get_config
from kvpool.services.prefill.metrics import PrefillMetrics
from kvpool.services.prefill.settings import PrefillSettings
from kvpool.services.prefill.stage_runner import StageRunner

pytestmark = pytest.mark.cluster

CHUNK = 256
LONG = 8192  # two pieces of 4096: the first takes far longer than a 16-token forward
PIECE = 4096


def make_runner(**settings: object) -> StageRunner:
    s = PrefillSettings(stage=0, num_stages=1, master="", transfer_engine=False, port=0, admin_port=0,
                        chunk_size=CHUNK, device_cache_tokens=LONG + CHUNK, forward_piece_tokens=PIECE,
                        **settings)  # type: ignore[arg-type]
    return StageRunner(s, None, None, PrefillMetrics())


@pytest.fixture
def runner() -> Iterator[StageRunner]:
    made = make_runner()
    yield made
    made.close()


async def short_during_long(runner: StageRunner, long_tenant: str, short_tenant: str) -> tuple[float, float]:
    """When the long forward's first piece ended, and when the short forward ended (perf_counter)."""
    vocab = get_config("tiny").vocab_size
    generator = torch.Generator().manual_seed(41)
    long_ids = torch.randint(vocab, (LONG,), generator=generator)
    short_ids = torch.randint(vocab, (16,), generator=generator)
    first_piece: list[float] = []
    long_task = asyncio.ensure_future(runner.forward(
        long_ids, list(range(LONG // CHUNK)), 0, on_piece=lambda start, end: first_piece.append(time.perf_counter()),
        tenant=long_tenant))
    await asyncio.sleep(0)  # the long forward's first piece is handed to its lane
    await runner.forward(short_ids, [LONG // CHUNK], 0, tenant=short_tenant)
    short_ended = time.perf_counter()
    await long_task
    return first_piece[0], short_ended


async def test_another_tenants_short_forward_does_not_wait_for_a_long_piece(runner: StageRunner) -> None:
    first_piece_ended, short_ended = await short_during_long(runner, "bob", "alice")
    assert short_ended < first_piece_ended


async def test_the_same_tenants_forwards_run_one_at_a_time_in_order(runner: StageRunner) -> None:
    first_piece_ended, short_ended = await short_during_long(runner, "bob", "bob")
    assert short_ended > first_piece_ended


async def test_without_tenant_fair_every_tenant_waits_its_turn_on_one_thread() -> None:
    one = make_runner(tenant_fair=False)
    try:
        first_piece_ended, short_ended = await short_during_long(one, "bob", "alice")
    finally:
        one.close()
    assert short_ended > first_piece_ended


async def test_a_tenant_gets_the_same_outputs_on_its_lane(runner: StageRunner) -> None:
    ids = torch.randint(get_config("tiny").vocab_size, (300,), generator=torch.Generator().manual_seed(7))
    a = await runner.forward(ids, [0, 1], 0, tenant="alice")
    b = await runner.forward(ids, [2, 3], 0, tenant="bob")
    assert torch.equal(a, b)


async def test_a_short_piece_alone_computes_on_the_loops_thread_with_the_same_outputs() -> None:
    """``--inline-forward-tokens``: a short piece with nothing else computing skips the compute thread (its two
    wake-ups cost more than a one-token forward); a longer one, or any with the setting 0, takes its lane."""
    ids = torch.randint(get_config("tiny").vocab_size, (300,), generator=torch.Generator().manual_seed(9))
    outputs, threads = [], []
    for inline in (16, 0):
        one = make_runner(inline_forward_tokens=inline)
        forward = one.model.forward

        def recorded(*args, _forward=forward):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread() is threading.main_thread())
            return _forward(*args)

        one.model.forward = recorded  # type: ignore[method-assign]
        try:
            await one.forward(ids[:256], [0, 1], 0, tenant="alice")  # the cached prefix: one chunk, on the lane
            outputs.append(await one.forward(ids[256:257], [0, 1], 256, tenant="alice"))  # one new token
        finally:
            one.close()
    assert threads == [False, True, False, False]
    assert torch.equal(outputs[0], outputs[1])
