"""The OpenAI-compatible HTTP API: a Starlette app in front of the router's generate path.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
server-sent events in OpenAI's chunk format ending with ``data: [DONE]``, or
one JSON answer), ``GET /v1/models``, ``GET /health`` (200 only when every
service behind the router is healthy), ``GET /openapi.json`` (``openapi.py``). Prometheus text is on the admin port
only; keys, tenants and origins are checked in front (``auth.py``).
Every response carries the request's id in ``X-Request-Id``; a completion's
``id`` is that id (``kvpool.services.router.http_request_id``).

Errors are OpenAI's shape with ``param`` naming the field: 400 for a client's
mistake, 413 for a body past ``MAX_BODY_BYTES``, 429 with ``Retry-After`` when
there is no room now, 503 when no prefill pipeline or decode shard can take
the request. The response head waits for the first token, so every error known
before it is one of these statuses, never a stream event; a failure after it
ends the stream with OpenAI's error event and ``data: [DONE]``. A client that
disconnects cancels its request everywhere: the generate path runs as a task
that is cancelled on ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool.core.decode.stop_strings import StopMatcher
from kvpool.tokenizer import Tokenizer
from kvpool.services.router import openapi
from kvpool.services.router.auth import authenticated, tenant_of
from kvpool.services.router.generation_request import GenerationRequest, ModelLimits
from kvpool.services.router.http_request_id import RequestIdMiddleware, request_id_of
from kvpool.services.router.json_body import MAX_BODY_BYTES, parse_json
from kvpool.services.router.openai_errors import ApiError
from kvpool.services.router.openai_schema import parse_chat, parse_completion

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
    queued_seconds: float = 0.0  # in the router's admission queue (a part of ttft_seconds)
    decode_seconds: float = 0.0
    finish_reason: str = "length"  # "stop" (a stop token) or "length" (max_tokens or the context)
    pipeline: str = ""  # the internal address: the router's and its log's, never a client's
    shard: str = ""
    # what the client reads (``kvpool.core.api.public_errors.served_by``): "prefill pipeline 0", "decode shard 1"
    pipeline_label: str = ""
    shard_label: str = ""

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
                "pipeline": self.pipeline_label,
                "shard": self.shard_label,
            },
        }


class RouterView(Protocol):
    """What the HTTP API needs from the router."""

    def generate(self, request: GenerationRequest, usage: Usage) -> AsyncIterator[int]:
        """Token ids as they are made; fills ``usage`` as it learns (prefill figures, then the end)."""
        ...

    async def health(self) -> dict[str, bool]: ...

    def supervision(self) -> dict[str, Any] | None:
        """What the local supervisor reports (restarts per service), when one runs the cluster."""
        ...


@dataclass(slots=True)
class HttpApi:
    router: RouterView
    tokenizer: Tokenizer
    limits: ModelLimits
    registry: CollectorRegistry
    roles: frozenset[str]
    created: int = field(default_factory=lambda: int(time.time()))
    read_timeout_s: float = 30.0  # a request's body must arrive within this, from its head (--http-read-timeout-s)
    refused: Callable[[str], None] = field(default=lambda reason: None)  # counts a body that timed out

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        # built once, from the routes: a route without its entry in openapi.OPERATIONS fails here
        document = openapi.build([("/openapi.json", ["GET"]), *((r.path, r.methods or ()) for r in routes)])
        body = json.dumps(document, separators=(",", ":")).encode()

        async def openapi_json(request: Request) -> Response:
            return Response(body, media_type="application/json")

        routes.append(Route("/openapi.json", openapi_json, methods=["GET"]))
        return Starlette(routes=routes, exception_handlers={
            HTTPException: _http_error, ApiError: _api_error, Exception: _server_error},
            middleware=[Middleware(RequestIdMiddleware)])

    # ---- routes ---------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        try:
            return await read_body(request, self.read_timeout_s)
        except ApiError as exc:
            if exc.status == 408:
                self.refused("body_timeout")
            raise

    async def completions(self, request: Request) -> Response:
        body = parse_json(await self._read_body(request))
        # parsing tokenizes: in a worker thread, as a model directory's tokenizer takes seconds over a long prompt
        return await self._serve(request, await asyncio.to_thread(
            parse_completion, body, self.tokenizer, self.limits, request.headers))

    async def chat_completions(self, request: Request) -> Response:
        body = parse_json(await self._read_body(request))
        return await self._serve(request, await asyncio.to_thread(
            parse_chat, body, self.tokenizer, self.limits, self.roles, request.headers))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.limits.name, "object": "model", "created": self.created, "owned_by": "kvpool",
             "max_model_len": self.limits.context},
        ]})

    async def health(self, request: Request) -> Response:
        """Whether the cluster serves; its targets and supervisor only to a caller with a key (or on an open API):
        they name internal addresses."""
        targets = await self.router.health()
        healthy = bool(targets) and all(targets.values())
        body: dict[str, Any] = {"status": "ok" if healthy else "unhealthy"}
        if not authenticated(request.scope):
            return JSONResponse(body, status_code=200 if healthy else 503)
        body["targets"] = targets
        supervision = self.router.supervision()
        if supervision is not None:
            body["supervisor"] = supervision
        return JSONResponse(body, status_code=200 if healthy else 503)

    # ---- serving --------------------------------------------------------

    async def _serve(self, request: Request, generation: GenerationRequest) -> Response:
        """Wait for the first token before answering: every error until then is an HTTP status, not a stream event."""
        generation.tenant = tenant_of(request.scope)  # auth.ApiGate found it
        completion_id = generation.request_id = request_id_of(request)
        usage = Usage(prompt_tokens=len(generation.prompt_ids))
        tokens = self.router.generate(generation, usage)
        try:
            first = await _until_disconnected(request, _first(tokens))
            if generation.stream:
                texts = self._texts(generation, usage, tokens, first)
                return ClosingStream(self._stream(generation, completion_id, usage, texts),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            text = await _until_disconnected(request, self._collect(generation, usage, tokens, first))
        except BaseException:
            await tokens.aclose()  # type: ignore[attr-defined]
            raise
        choice: dict[str, Any] = {"index": 0, "finish_reason": usage.finish_reason, "logprobs": None}
        if generation.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            obj = "chat.completion"
        else:
            choice["text"] = text
            obj = "text_completion"
        return JSONResponse({"id": completion_id, "object": obj, "created": int(time.time()),
                             "model": self.limits.name, "choices": [choice], "usage": usage.openai()})

    async def _collect(self, generation: GenerationRequest, usage: Usage, tokens: AsyncIterator[int],
                       first: int | None) -> str:
        return "".join([delta async for delta, _ in self._texts(generation, usage, tokens, first)])

    async def _texts(self, generation: GenerationRequest, usage: Usage, tokens: AsyncIterator[int],
                     first: int | None) -> AsyncIterator[tuple[str, bool]]:
        """Text deltas as tokens arrive, stop strings applied; the last item is flagged (usage is final then)."""
        decoder = self.tokenizer.decoder()
        stops = StopMatcher.of(generation.stops)
        tail = ""
        try:
            async for token_id in _chain(first, tokens):
                usage.completion_tokens += 1
                delta = stops.push(decoder.feed(token_id))
                if delta:
                    yield delta, False
                if stops.stopped:
                    break  # closing the stream below cancels the rest of the generation
            else:
                tail = stops.push(decoder.flush())
                tail += stops.flush()
        finally:
            await tokens.aclose()  # type: ignore[attr-defined]
        if stops.stopped:
            usage.finish_reason = "stop"
        yield tail, True

    async def _stream(self, generation: GenerationRequest, completion_id: str, usage: Usage,
                      texts: AsyncIterator[tuple[str, bool]]) -> AsyncIterator[bytes]:
        """The SSE body, once the first token exists; a later failure is OpenAI's error event, then ``[DONE]``."""
        created = int(time.time())
        chat = generation.kind == "chat"

        def chunk(delta: str | None, finish: str | None = None, final: Usage | None = None) -> bytes:
            """One SSE event; ``delta`` None with a finish reason ends the choice, with usage it is the usage chunk."""
            payload: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk" if chat else
                                       "text_completion", "created": created, "model": self.limits.name}
            if final is not None:
                payload["choices"] = []
                payload["usage"] = final.openai()
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
            async for delta, last in texts:
                if delta:
                    yield chunk(delta)
                if last:
                    yield chunk(None, usage.finish_reason)
                    if generation.include_usage:
                        yield chunk(None, final=usage)
        except ApiError as exc:
            # the head is sent already: the error goes in the stream, as OpenAI does
            yield _sse(exc.body())
        except Exception as exc:  # a bug must still end the stream properly, never cut it
            log.exception("stream_failed", completion_id=completion_id)
            yield _sse(ApiError(500, f"the server failed mid-stream: {type(exc).__name__}", None, "server_error",
                                "server_error").body())
        finally:
            await texts.aclose()  # type: ignore[attr-defined]
        yield b"data: [DONE]\n\n"


class ClosingStream(StreamingResponse):
    """A streaming response that closes its body however it ends. Starlette cancels a stream whose client
    went away, and when that lands in ``send`` the body generator stays suspended at its ``yield``: the
    generation behind it (its decode call, its pages) would run on until the garbage collector finalised it."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]  # a no-op once it ended


async def _first(tokens: AsyncIterator[int]) -> int | None:
    """The first token, or None when the generation ended without one."""
    async for token in tokens:
        return token
    return None


async def _chain(first: int | None, tokens: AsyncIterator[int]) -> AsyncIterator[int]:
    if first is None:
        return
    yield first
    async for token in tokens:
        yield token


async def read_body(request: Request, timeout_s: float) -> bytes:
    """The request body, refused with 413 past ``MAX_BODY_BYTES`` before it is all read, and with 408 when it
    has not all arrived ``timeout_s`` after its head (a client trickling it would hold its connection)."""
    too_large = ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes", None, "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > MAX_BODY_BYTES:
                    raise too_large
                parts.append(part)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {timeout_s:g} s of the request's head "
                       "(--http-read-timeout-s)", None, "request_timeout", headers={"Connection": "close"}) from None
    return b"".join(parts)


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
            # stopped before the caller closes what it read (a generator cannot close mid-read: RuntimeError)
            await asyncio.wait({task})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug: still OpenAI's shape, so a client can parse it (and the log has the trace)."""
    log.error("request_failed", path=request.url.path, error=repr(exc))
    error = ApiError(500, f"the server failed: {type(exc).__name__}", None, "server_error", "server_error")
    return JSONResponse(error.body(), status_code=500)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None,
                     "not_found" if exc.status_code == 404 else None, kind)
    return JSONResponse(error.body(), status_code=exc.status_code)

