"""The one client of the router's streaming HTTP API: server-sent events and the served model.

The router streams OpenAI-style events: ``data: {json}`` lines, ``data:
[DONE]`` last. An HTTP error comes as a status before any stream byte, an
error found later as an event with an ``error`` field; both raise
:class:`StreamError`, so a caller never mistakes a failed request for a short
answer. So does a stream that ends without ``[DONE]`` (``silent``: nothing
said it failed). Used by ``kvpool up --demo``, ``kvpool chat``, the replay and the tests.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

DONE = "[DONE]"


class StreamError(RuntimeError):
    """An HTTP error status (``status`` set), an error event in the stream (``status`` None), or a
    stream cut short with neither (``silent``)."""

    def __init__(self, message: str, status: int | None = None, silent: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.silent = silent


def parse_event(line: str) -> dict[str, Any] | None:
    """The JSON of one ``data:`` line; None for any other line and for ``[DONE]``. Raises on an error event."""
    if not line.startswith("data: "):
        return None
    data = line.removeprefix("data: ").strip()
    if data == DONE:
        return None
    event: dict[str, Any] = json.loads(data)
    if "error" in event:
        raise StreamError(f"error event: {event['error']}")
    return event


async def stream_events(client: httpx.AsyncClient, url: str, path: str,
                        body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST ``body`` to ``url + path`` with streaming on; yield each event's JSON until ``[DONE]``."""
    async with client.stream("POST", f"{url.rstrip('/')}{path}", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise StreamError(f"HTTP {response.status_code}: {text[:300]}", status=response.status_code)
        async for line in response.aiter_lines():
            if line.strip() == f"data: {DONE}":
                return
            event = parse_event(line)
            if event is not None:
                yield event
    raise StreamError("the stream ended without [DONE]", silent=True)


async def served_model(client: httpx.AsyncClient, url: str) -> tuple[str, int]:
    """(model id, context length; 0 when not said) from the router's ``/v1/models``."""
    response = await client.get(f"{url.rstrip('/')}/v1/models", timeout=30.0)
    response.raise_for_status()
    model = response.json()["data"][0]
    return str(model["id"]), int(model.get("max_model_len", 0))
