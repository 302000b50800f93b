"""Every HTTP request's id, at the edge: assigned, bound for its logs and calls, sent back as ``X-Request-Id``.

The id of a completion is its OpenAI ``id`` (``cmpl-…``, ``chatcmpl-…``), so
the header and the body name the same request. A client's own
``X-Request-Id`` is kept beside it in the logs as ``client_request_id`` when
sane (``kvpool.request_id.is_sane``), never used as the id: ids must be unique
in the cluster, and a client's need not be.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpool.request_id import bound_request_id, is_sane, new_request_id
from kvpool.tracing import request_span

HEADER = "X-Request-Id"
_PREFIXES = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}
# the routes a request's span is named by (any other path: one name for all)
_ROUTES = frozenset({*_PREFIXES, "/v1/models", "/health", "/openapi.json"})


class RequestIdMiddleware:
    """Pure ASGI middleware (no buffering: streams pass through as they are written)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id(_PREFIXES.get(scope["path"].rstrip("/"), "req"))
        scope.setdefault("state", {})["request_id"] = request_id
        extra: dict[str, Any] = {}
        client_id = Headers(scope=scope).get(HEADER, "")
        if client_id and is_sane(client_id):
            extra["client_request_id"] = client_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        # the request's trace starts here (when tracing): every call it makes is a child of this span, named
        # by its route (a client's arbitrary path would make a span name per request)
        route = scope["path"].rstrip("/")
        span_name = f"{scope['method']} {route if route in _ROUTES else '(other path)'}"
        with bound_request_id(request_id, **extra), request_span(span_name, request_id):
            await self.app(scope, receive, send_with_id)


def request_id_of(request: Request) -> str:
    """The id ``RequestIdMiddleware`` gave this request."""
    return str(request.state.request_id)
