"""A stream whose client went away is closed at once, wherever the cancellation lands: its generator's
``finally`` (which cancels the generation behind it) runs before the response returns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvpool.services.router.http_api import ClosingStream


async def served(blocked_send: int | None) -> list[str]:
    """Serve a never-ending body until the client disconnects; the ``blocked_send``-th send never returns
    (a client whose socket stopped taking bytes) when given, else the body waits on its next part."""
    events: list[str] = []
    part_needed = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: x\n\n"
                if blocked_send is None:
                    await part_needed.wait()  # a token that never comes
        finally:
            events.append("body closed")

    sends = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal sends
        sends += 1
        if sends == blocked_send:
            await asyncio.Event().wait()

    async def receive() -> dict[str, Any]:
        while sends < (blocked_send or 2):  # the head and a first part
            await asyncio.sleep(0.001)
        events.append("disconnect")
        return {"type": "http.disconnect"}

    await asyncio.wait_for(ClosingStream(body())({"type": "http"}, receive, send), 5)
    events.append("returned")
    return events


@pytest.mark.parametrize("blocked_send", [None, 3])
def test_a_stream_cancelled_in_send_or_in_its_body_closes_the_body_before_returning(blocked_send: int | None) -> None:
    assert asyncio.run(served(blocked_send)) == ["disconnect", "body closed", "returned"]
