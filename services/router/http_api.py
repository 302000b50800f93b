"""The OpenAI-compatible HTTP API: a Starlette app in front of the router's generate path.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
server-sent events in OpenAI's chunk format ending with ``data: [DONE]``, or
one JSON answer), ``GET /v1/models``, ``GET /health`` (200 only when every
service behind the router is healthy), ``GET /metrics`` (Prometheus text).

Errors are OpenAI's shape with ``param`` naming the field: 400 for a client's
mistake, 503 when no backend can take the request, 429 when the router's
queue is full. A client that disconnects cancels its request everywhere: the
generate path runs as a task that is cancelled on ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool.core.stop_strings import StopMatcher
from kvpool.tokenizer import Tokenizer
from services.router.openai_schema import (
    ApiError,
    GenerationRequest,
    ModelLimits,
    parse_chat,
    parse_completion,
    parse_json,
)

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Usage:
    """The final figures of one generation, as the router measured them."""

    prompt_tokens: int
    completion_tokens: int = 0
    device_tokens: int = 0
    pool_tokens: int = 0
    computed_tokens: int = 0
    handoff_transfers: int = 0
    handoff_bytes: int = 0
    ttft_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = "length"  # "stop" (a stop token) or "length" (max_tokens or the context)
    pipeline: str = ""
    shard: str = ""

    def openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.device_tokens + self.pool_tokens},
            "kvpool": {
                "device_tokens": self.device_tokens,
                "pool_tokens": self.pool_tokens,
                "computed_tokens": self.computed_tokens,
                "handoff_transfers": self.handoff_transfers,
                "handoff_bytes": self.handoff_bytes,
                "ttft_seconds": self.ttft_seconds,
                "decode_seconds": self.decode_seconds,
                "pipeline": self.pipeline,
                "shard": self.shard,
            },
        }


class GenerateBackend(Protocol):
    """What the HTTP API needs from the router."""

    def generate(self, request: GenerationRequest, usage: Usage) -> AsyncIterator[int]:
        """Token ids as they are made; fills ``usage`` as it learns (prefill figures, then the end)."""
        ...

    async def health(self) -> dict[str, bool]: ...


@dataclass(slots=True)
class HttpApi:
    backend: GenerateBackend
    tokenizer: Tokenizer
    limits: ModelLimits
    registry: CollectorRegistry
    roles: frozenset[str]
    created: int = field(default_factory=lambda: int(time.time()))

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, ApiError: _api_error})

    # ---- routes ---------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = parse_json(await request.body())
        return await self._serve(request, parse_completion(body, self.tokenizer, self.limits))

    async def chat_completions(self, request: Request) -> Response:
        body = parse_json(await request.body())
        return await self._serve(request, parse_chat(body, self.tokenizer, self.limits, self.roles))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.limits.name, "object": "model", "created": self.created, "owned_by": "kvpool",
             "max_model_len": self.limits.context},
        ]})

    async def health(self, request: Request) -> Response:
        backends = await self.backend.health()
        healthy = bool(backends) and all(backends.values())
        return JSONResponse({"status": "ok" if healthy else "unhealthy", "backends": backends},
                            status_code=200 if healthy else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- serving --------------------------------------------------------

    async def _serve(self, request: Request, generation: GenerationRequest) -> Response:
        completion_id = ("cmpl-" if generation.kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        if generation.stream:
            return StreamingResponse(self._stream(generation, completion_id), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, usage = await _until_disconnected(request, self._collect(generation))
        choice: dict[str, Any] = {"index": 0, "finish_reason": usage.finish_reason, "logprobs": None}
        if generation.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            obj = "chat.completion"
        else:
            choice["text"] = text
            obj = "text_completion"
        return JSONResponse({"id": completion_id, "object": obj, "created": int(time.time()),
                             "model": self.limits.name, "choices": [choice], "usage": usage.openai()})

    async def _collect(self, generation: GenerationRequest) -> tuple[str, Usage]:
        parts: list[str] = []
        usage: Usage | None = None
        async for delta, final in self._texts(generation):
            parts.append(delta)
            usage = final or usage
        assert usage is not None
        return "".join(parts), usage

    async def _texts(self, generation: GenerationRequest) -> AsyncIterator[tuple[str, Usage | None]]:
        """Text deltas as tokens arrive, stop strings applied; the last item carries the usage."""
        decoder = self.tokenizer.decoder()
        stops = StopMatcher.of(generation.stops)
        usage = Usage(prompt_tokens=len(generation.prompt_ids))
        tokens = self.backend.generate(generation, usage)
        tail = ""
        try:
            async for token_id in tokens:
                usage.completion_tokens += 1
                delta = stops.push(decoder.feed(token_id))
                if delta:
                    yield delta, None
                if stops.stopped:
                    break  # closing the stream below cancels the rest of the generation
            else:
                tail = stops.push(decoder.flush())
                tail += stops.flush()
        finally:
            await tokens.aclose()  # type: ignore[attr-defined]
        if stops.stopped:
            usage.finish_reason = "stop"
        yield tail, usage

    async def _stream(self, generation: GenerationRequest, completion_id: str) -> AsyncIterator[bytes]:
        created = int(time.time())
        chat = generation.kind == "chat"

        def chunk(delta: str | None, finish: str | None = None, usage: Usage | None = None) -> bytes:
            """One SSE event; ``delta`` None with a finish reason ends the choice, with usage it is the usage chunk."""
            payload: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk" if chat else
                                       "text_completion", "created": created, "model": self.limits.name}
            if usage is not None:
                payload["choices"] = []
                payload["usage"] = usage.openai()
            elif chat:
                content = {} if delta is None else {"content": delta}
                payload["choices"] = [{"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}]
            else:
                payload["choices"] = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
            return _sse(payload)

        try:
            if chat:
                yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": self.limits.name, "choices": [{"index": 0, "delta": {"role": "assistant",
                            "content": ""}, "logprobs": None, "finish_reason": None}]})
            async for delta, usage in self._texts(generation):
                if delta:
                    yield chunk(delta)
                if usage is not None:
                    yield chunk(None, usage.finish_reason)
                    if generation.include_usage:
                        yield chunk(None, usage=usage)
        except ApiError as exc:
            # headers are sent already: the error goes in the stream, as OpenAI does
            yield _sse(exc.body())
        yield b"data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; cancel it if the client goes away first (its request is then cancelled everywhere)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            log.info("client_disconnected")
            raise ApiError(499, "client closed the request", None, "client_closed")
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None,
                     "not_found" if exc.status_code == 404 else None, kind)
    return JSONResponse(error.body(), status_code=exc.status_code)

