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


def test_a_client_gone_before_the_first_token_ends_in_499_with_the_generation_closed() -> None:
    """The wait for the first token is cancelled when the client goes away; the generation it was reading is
    then closed by the caller, which must find it stopped, not still running its cancelled read."""
    from kvpool.services.router.http_api import ApiError, _first, _until_disconnected

    async def scenario() -> tuple[int, list[str]]:
        events: list[str] = []

        async def tokens() -> AsyncIterator[int]:
            try:
                await asyncio.Event().wait()  # the first token never comes
                yield 1
            finally:
                events.append("generation closed")

        class Request:
            async def receive(self) -> dict[str, Any]:
                await asyncio.sleep(0.01)
                return {"type": "http.disconnect"}

        generation = tokens()
        try:
            await _until_disconnected(Request(), _first(generation))  # type: ignore[arg-type]
        except ApiError as exc:
            await generation.aclose()  # what _serve does with any failure
            return exc.status, events
        raise AssertionError("no error for a client that went away")

    assert asyncio.run(scenario()) == (499, ["generation closed"])
