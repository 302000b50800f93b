"""Which control RPCs one request made, as every server saw them: a server interceptor keyed by
the request id (gRPC metadata ``x-request-id``).

Off unless ``KVPOOL_RPC_TRACE`` names a file: then every served call that
carries a request id appends one JSON line there when it ends. A line holds
the request id, the method, the call's kind (``unary_unary``,
``unary_stream``, ``stream_unary`` or ``stream_stream``), its span id and its
caller's, ``sent`` (when the caller opened it, by the caller's clock; the
server's start where the caller does not say), ``start`` and ``end`` — ``end`` is the call's first answer, the one
its caller waits for (a server stream's first message, a client stream's one
reply) — and ``answers``: the times of every answer the caller waited for,
Unix seconds. An answer is awaited when the server sends it after reading a
message since its last answer: a unary call's reply, a server stream's first
message, a client stream's reply after the last write, and in a bidirectional
stream each reply to new messages. So a call moved onto a stream keeps its
round trips. ``messages_in``/``messages_out`` count the call's messages.

A call made from a task nobody waits for (``detached``: a lease's release after the
forward) says so (``"detached": true``): no caller waits on it, so it is on no
critical path, though it is one of the request's calls.

The calls a server makes while serving a call carry its span on as their
parent and their send time, for every call kind (a client interceptor reads the span from the
serving task's context, which tasks it starts inherit; the id itself travels
by ``kvpool.request_id``). ``kvpool bench path`` sets the variable for the
clusters it starts and counts the lines (``kvpool.tools.bench.path_counts``).
Appends of one short line are atomic on Linux, so every process of a cluster
shares one file.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvpool.child_env import children_env

REQUEST_ID_KEY = "x-request-id"
PARENT_SPAN_KEY = "x-parent-span"
SENT_KEY = "x-call-sent"  # when the caller opened the call, Unix seconds: a fan-out's calls all go before any answer
DETACHED_KEY = "x-call-detached"  # "1": made from a task nobody waits for
TRACE_ENV = "KVPOOL_RPC_TRACE"

CURRENT_SPAN: contextvars.ContextVar[str] = contextvars.ContextVar("kvpool_span", default="")
DETACHED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvpool_detached", default=False)


@contextlib.contextmanager
def tracing_children(path: Path) -> Iterator[None]:
    """Within: the processes started here trace their calls into ``path`` (they inherit ``TRACE_ENV``);
    the variable is as it was afterwards."""
    with children_env(TRACE_ENV, str(path)):
        yield


def detached(coro: Awaitable[Any]) -> asyncio.Future[Any]:
    """Run ``coro`` (a coroutine: a call object made before would already be on its way) as a task nobody
    waits for; the calls it makes are traced as detached."""
    context = contextvars.copy_context()
    context.run(DETACHED.set, True)
    return context.run(asyncio.ensure_future, coro)  # the task runs in (a copy of) that context


def request_id_of(metadata: Sequence[tuple[str, Any]] | None, key: str = REQUEST_ID_KEY) -> str:
    for name, value in metadata or ():
        if name == key and isinstance(value, str):
            return value
    return ""


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


@dataclass(slots=True)
class CallRecord:
    """One served call's line: an answer is awaited only when a message came in since the last one."""

    request_id: str
    method: str
    kind: str
    span: str
    parent: str
    sent_at: float
    detached: bool = False
    start: float = field(default_factory=time.time)
    answers: list[float] = field(default_factory=list)
    messages_in: int = 0
    messages_out: int = 0
    unanswered: bool = False  # a message came in since the last answer

    def received(self) -> None:
        self.messages_in += 1
        self.unanswered = True

    def replied(self) -> None:
        self.messages_out += 1
        if self.unanswered:
            self.answers.append(time.time())
            self.unanswered = False

    def line(self) -> str:
        end = self.answers[0] if self.answers else time.time()
        return json.dumps({"request_id": self.request_id, "method": self.method, "kind": self.kind,
                           "span": self.span, "parent": self.parent, "sent": self.sent_at, "start": self.start,
                           "end": end, "answers": self.answers, "messages_in": self.messages_in,
                           "messages_out": self.messages_out, **({"detached": True} if self.detached else {})})


class RpcTraceInterceptor(grpc.aio.ServerInterceptor):
    """Appends one line per served call that carries a request id, of every call kind (see the module doc)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, record: CallRecord) -> None:
        with open(self.path, "a") as trace:
            trace.write(record.line() + "\n")

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        metadata = details.invocation_metadata  # type: ignore[attr-defined]
        request_id = request_id_of(metadata)
        if handler is None or not request_id:
            return handler
        method = details.method  # type: ignore[attr-defined]
        parent = request_id_of(metadata, PARENT_SPAN_KEY)
        span = uuid.uuid4().hex[:16]
        sent_at = _seconds(request_id_of(metadata, SENT_KEY))
        is_detached = request_id_of(metadata, DETACHED_KEY) == "1"
        kind = ("stream_" if handler.request_streaming else "unary_") + \
               ("stream" if handler.response_streaming else "unary")

        def begin() -> CallRecord:
            CURRENT_SPAN.set(span)  # the calls this handler makes name it as their parent
            DETACHED.set(is_detached)  # and are detached when it is
            record = CallRecord(request_id, method, kind, span, parent, sent_at, is_detached)
            record.sent_at = record.sent_at or record.start  # a caller without the carry interceptors
            return record

        async def counted(requests: AsyncIterator[Any], record: CallRecord) -> AsyncIterator[Any]:
            async for request in requests:
                record.received()
                yield request

        wrap: Callable[..., grpc.RpcMethodHandler]
        if kind == "unary_unary" or kind == "stream_unary":
            inner_single = handler.unary_unary or handler.stream_unary

            async def answered(request: Any, context: Any) -> Any:
                record = begin()
                if kind == "unary_unary":
                    record.received()
                else:
                    request = counted(request, record)
                try:
                    response = await inner_single(request, context)
                    record.replied()
                    return response
                finally:
                    self._write(record)
            wrap = (grpc.unary_unary_rpc_method_handler if kind == "unary_unary"
                    else grpc.stream_unary_rpc_method_handler)
            return wrap(answered, handler.request_deserializer, handler.response_serializer)

        inner_stream = handler.unary_stream or handler.stream_stream

        async def streamed(request: Any, context: Any) -> AsyncIterator[Any]:
            record = begin()
            if kind == "unary_stream":
                record.received()
            else:
                request = counted(request, record)
            try:
                async for response in inner_stream(request, context):
                    record.replied()
                    yield response
            finally:
                self._write(record)
        wrap = (grpc.unary_stream_rpc_method_handler if kind == "unary_stream"
                else grpc.stream_stream_rpc_method_handler)
        return wrap(streamed, handler.request_deserializer, handler.response_serializer)


def _carried(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """The call's details with the time it was sent and the serving task's span, the callee's parent."""
    span = CURRENT_SPAN.get()
    metadata = [(k, v) for k, v in details.metadata or () if k != SENT_KEY]
    metadata.append((SENT_KEY, repr(time.time())))
    if DETACHED.get():
        metadata.append((DETACHED_KEY, "1"))
    if span and not any(k == PARENT_SPAN_KEY for k, _ in metadata):
        metadata.append((PARENT_SPAN_KEY, span))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*metadata),
                                      details.credentials, details.wait_for_ready)


# one class per call kind: a channel files an interceptor under the first kind it is
class _CarryUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(_carried(details), request)


class _CarryUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(_carried(details), request)


class _CarryStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                     request_iterator: Any) -> Any:
        return await continuation(_carried(details), request_iterator)


class _CarryStreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                      request_iterator: Any) -> Any:
        return await continuation(_carried(details), request_iterator)


def tracing() -> bool:
    """Whether this process traces (``KVPOOL_RPC_TRACE`` is set)."""
    return bool(os.environ.get(TRACE_ENV))


class MessageTrace:
    """One line per call made as a message on a long-lived stream (the pool master's ``Session``), as the
    unary call it stands for would have written: its method, ``kind`` ``session``, one message in and its
    answer out. The stream itself belongs to no request and writes no line."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, request_id: str, method: str, parent: str, sent: float, detached: bool, start: float) -> None:
        record = CallRecord(request_id, method, "session", uuid.uuid4().hex[:16], parent, sent or start, detached,
                            start)
        record.received()
        record.replied()
        with open(self.path, "a") as trace:
            trace.write(record.line() + "\n")


def message_trace() -> MessageTrace | None:
    """A server's per-message trace, when ``KVPOOL_RPC_TRACE`` is set."""
    path = os.environ.get(TRACE_ENV, "")
    return MessageTrace(path) if path else None


def trace_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """A server's interceptors: the trace, when ``KVPOOL_RPC_TRACE`` is set."""
    path = os.environ.get(TRACE_ENV, "")
    return [RpcTraceInterceptor(path)] if path else []


def carry_interceptors() -> list[Any]:
    """A channel's interceptors: carry the serving call's span on, when ``KVPOOL_RPC_TRACE`` is set."""
    if not os.environ.get(TRACE_ENV):
        return []
    return [_CarryUnaryUnary(), _CarryUnaryStream(), _CarryStreamUnary(), _CarryStreamStream()]
