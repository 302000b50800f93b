"""SIGTERM drains as for a rolling restart; SIGINT (the cluster stopping behind its router) does not wait
for callers to notice. Real signals to this process, handled by the event loop as a service handles them."""

from __future__ import annotations

import asyncio
import os
import signal

from kvpool import service


async def stopped_by(*signals: int) -> service.Stop:
    stop = service.Stop()
    service.install_stop_signals(stop)
    loop = asyncio.get_running_loop()
    try:
        for sig in signals:
            os.kill(os.getpid(), sig)
            await asyncio.wait_for(stop.wait(), 5)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return stop


async def test_sigterm_waits_for_callers_to_see_not_ready() -> None:
    stop = await stopped_by(signal.SIGTERM)
    assert stop.is_set() and not stop.quick and stop.quiet_s == service.DRAIN_QUIET_S > 0


async def test_sigint_finishes_what_is_in_flight_only_and_a_later_sigterm_keeps_it_so() -> None:
    stop = await stopped_by(signal.SIGINT, signal.SIGTERM)
    assert stop.is_set() and stop.quick and stop.quiet_s == 0.0


async def test_a_plain_event_is_set_by_either() -> None:
    stop = asyncio.Event()
    service.install_stop_signals(stop)
    loop = asyncio.get_running_loop()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(stop.wait(), 5)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
