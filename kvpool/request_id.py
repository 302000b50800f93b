"""A request's id: assigned by the router, carried on every call the request causes, bound into every log line.

Invariants:
- The router assigns a fresh id to every request (``new_request_id``); it is the
  OpenAI ``id`` and the ``X-Request-Id`` response header. A client's own
  ``X-Request-Id`` never replaces it (two clients may send the same one), it is
  logged beside it as ``client_request_id`` when sane.
- While an id is bound (``bound_request_id``), every structlog line carries it
  as ``request_id`` and every gRPC call made on a channel from
  ``kvpool.service.channel`` carries it as ``x-request-id`` metadata
  (``client_interceptors``; a call that streams its requests passes it as it
  starts, ``kvpool.service.stream_metadata``). Tasks started meanwhile copy
  the binding.
- Every server from ``kvpool.service.create_server`` binds a sane inbound
  ``x-request-id`` around the handler (``RequestIdServerInterceptor``), so the
  handler's log lines and its own calls onward carry it too: the id crosses
  every hop (router → prefill stage 0 → later stages → master; router → decode)
  without any code on the path naming it.
- Sane means 1..128 characters of ``[A-Za-z0-9._:-]``; anything else is ignored,
  so an id is always safe to log and to echo in a header.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc
import structlog

METADATA_KEY = "x-request-id"
MAX_CHARS = 128
_SANE = re.compile(r"[A-Za-z0-9._:-]{1,%d}" % MAX_CHARS)

_current: contextvars.ContextVar[str] = contextvars.ContextVar("kvpool_request_id", default="")

log = structlog.get_logger(__name__)


def new_request_id(prefix: str = "req") -> str:
    """A fresh id, unique for all practical purposes: ``{prefix}-{32 hex digits}``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def is_sane(value: str) -> bool:
    return _SANE.fullmatch(value) is not None


def current_request_id() -> str:
    """The id bound in this context, or ``""``."""
    return _current.get()


@contextlib.contextmanager
def bound_request_id(request_id: str, **extra: Any) -> Iterator[None]:
    """Bind ``request_id`` (and ``extra`` log fields) for the block: logs and outgoing calls carry it."""
    token = _current.set(request_id)
    log_tokens = structlog.contextvars.bind_contextvars(request_id=request_id, **extra)
    try:
        yield
    finally:
        # a generator closed by asyncio's finalizer runs this in another context, whose values die with it
        with contextlib.suppress(ValueError):
            structlog.contextvars.reset_contextvars(**log_tokens)
            _current.reset(token)


def from_metadata(metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The sane ``x-request-id`` among gRPC metadata, or ``""``."""
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and is_sane(value):
            return value
    return ""


# ---- client side ------------------------------------------------------------------


class _CarriesRequestId:
    """Adds the bound request id to a call's metadata (nothing when none is bound)."""

    @staticmethod
    def _details(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        request_id = _current.get()
        if not request_id:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata[METADATA_KEY] = request_id
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnary(_CarriesRequestId, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any], client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_CarriesRequestId, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any], client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call kind whose request is one message (a grpc.aio channel files each under one kind
    only). A call that streams its requests carries the id in the metadata it starts with (``call_metadata``):
    grpc.aio turns an intercepted call's writes into a request iterator that a task of its own pumps, and that
    task is left pending (and its generator's close fails) when the peer dies mid-stream."""
    return [_UnaryUnary(), _UnaryStream()]


def call_metadata() -> list[tuple[str, str]]:
    """The metadata that carries the bound request id (none when none is bound): what the interceptors add to a
    unary call, for a call that streams its requests to pass as it starts."""
    request_id = _current.get()
    return [(METADATA_KEY, request_id)] if request_id else []


# ---- server side ------------------------------------------------------------------


class RequestIdServerInterceptor(grpc.aio.ServerInterceptor):
    """Runs each handler of a call that carries a sane ``x-request-id`` with that id bound.

    Calls without one (health checks, heartbeats, admin calls) get their
    handler untouched. At debug level each bound call logs one ``rpc_served``
    line (method, outcome, seconds): the access log that shows a request
    reaching a process even where the handler itself logs nothing.
    """

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        request_id = from_metadata(handler_call_details.invocation_metadata)
        if handler is None or not request_id:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_bound_unary(handler.unary_unary, request_id, method))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_bound_unary(handler.stream_unary, request_id, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_bound_stream(handler.unary_stream, request_id, method))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=_bound_stream(handler.stream_stream, request_id, method))
        return handler


def _bound_unary(behavior: Callable[[Any, Any], Awaitable[Any]], request_id: str,
                 method: str) -> Callable[[Any, Any], Awaitable[Any]]:
    async def bound(request: Any, context: Any) -> Any:
        with bound_request_id(request_id), served(method):
            return await behavior(request, context)

    return bound


def _bound_stream(behavior: Callable[[Any, Any], Any], request_id: str,
                  method: str) -> Callable[[Any, Any], AsyncIterator[Any]]:
    async def bound(request: Any, context: Any) -> AsyncIterator[Any]:
        with bound_request_id(request_id), served(method):
            result = behavior(request, context)
            if hasattr(result, "__aiter__"):
                async for response in result:
                    yield response
            else:
                await result  # a handler that writes with context.write()

    return bound


@contextlib.contextmanager
def served(method: str) -> Iterator[None]:
    started = time.perf_counter()
    outcome = "ok"
    try:
        yield
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        log.debug("rpc_served", method=method, outcome=outcome, seconds=round(time.perf_counter() - started, 6))
