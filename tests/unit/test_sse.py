"""The one SSE client: events in order, [DONE] ends the stream, HTTP errors and error events raise."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvpool.tools.sse import StreamError, parse_event, served_model, stream_events


def read_all(status: int, body: bytes) -> list[dict[str, Any]]:
    """Every event ``stream_events`` yields for a server that answers ``status`` with ``body``."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return [e async for e in stream_events(client, "http://router/", "/v1/completions", {"stream": True})]

    events = asyncio.run(run())
    assert [str(r.url) for r in seen] == ["http://router/v1/completions"]
    return events


def test_events_in_order_until_done() -> None:
    body = (b'data: {"choices": [{"text": "a"}]}\n\n: keep-alive comment\n\n'
            b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\ndata: {"after": 1}\n\n')
    assert read_all(200, body) == [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}]


def test_an_http_error_raises_with_its_status_and_body() -> None:
    with pytest.raises(StreamError) as caught:
        read_all(400, b'{"error": {"param": "max_tokens"}}')
    assert caught.value.status == 400
    assert str(caught.value) == 'HTTP 400: {"error": {"param": "max_tokens"}}'


def test_an_error_event_raises() -> None:
    with pytest.raises(StreamError) as caught:
        read_all(200, b'data: {"choices": []}\n\ndata: {"error": {"message": "shard lost"}}\n\n')
    assert caught.value.status is None
    assert str(caught.value) == "error event: {'message': 'shard lost'}"


def test_parse_event_ignores_other_lines() -> None:
    assert parse_event("event: ping") is None
    assert parse_event("data: [DONE]") is None
    assert parse_event('data: {"id": "x"}') == {"id": "x"}


def test_served_model_reads_id_and_context() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 4096}]})

    async def run() -> tuple[str, int]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await served_model(client, "http://router")

    assert asyncio.run(run()) == ("tiny", 4096)
