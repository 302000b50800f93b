"""A stage waits on the next one as long as its own caller waits on it: the served call's deadline is
carried to the forwards its task makes (a fixed 600 s failed a 32K prefill on a busy host whose client
allowed an hour)."""

from __future__ import annotations

import asyncio

from kvpool.services.prefill import forward
from kvpool.services.prefill.forward import FORWARD_TIMEOUT_S, forward_timeout_s, keep_deadline


class CallContext:
    """The one thing of grpc's ServicerContext read here."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


async def forwarded_timeout(remaining: float | None) -> float:
    keep_deadline(CallContext(remaining))
    # the forward runs in a task made by the handler, as Forward and Prefill make theirs
    return await asyncio.ensure_future(asyncio.sleep(0, forward_timeout_s()))


def test_the_callers_deadline_bounds_the_forward() -> None:
    assert 3500 < asyncio.run(forwarded_timeout(3600.0)) <= 3600.0
    assert 0 < asyncio.run(forwarded_timeout(2.0)) <= 2.0


def test_a_caller_without_a_deadline_gets_the_default_and_a_spent_one_the_least() -> None:
    assert asyncio.run(forwarded_timeout(None)) == FORWARD_TIMEOUT_S
    assert asyncio.run(forwarded_timeout(-1.0)) == 0.001
    assert forward._deadline.get() is None  # each asyncio.run had its own context: nothing leaked
