"""Which control RPCs one request made, as every server saw them: a server interceptor keyed by
the request id (gRPC metadata ``x-request-id``).

Off unless ``KVPOOL_RPC_TRACE`` names a file: then every served call that
carries a request id appends one JSON line there (request id, method, its span
id and its caller's, start, end — for a stream, its first message — in Unix
seconds), and the calls a server makes while serving it carry its span on as
their parent (a client interceptor reads it from the serving task's context,
which tasks it starts inherit; the id itself travels by ``kvpool.request_id``). ``kvpool bench path``
sets it for the cluster it starts and counts the critical path from the lines
(``critical_path_depth``). Appends of one short line are atomic on Linux, so
every process of a cluster shares one file.
"""

from __future__ import annotations

import contextvars
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

REQUEST_ID_KEY = "x-request-id"
PARENT_SPAN_KEY = "x-parent-span"
TRACE_ENV = "KVPOOL_RPC_TRACE"
# calls that run beside the request, not on its way to the first token (the saves; the pool lease's
# ReleaseLease is not one of them: stage 0 awaits it before the forward)
OFF_PATH_METHODS = frozenset({"/kvpool.rpc.PrefillStage/SaveDone", "/kvpool.rpc.PoolMaster/PutStart",
                              "/kvpool.rpc.PoolMaster/PutEnd", "/kvpool.rpc.PoolMaster/PutRevoke"})


CURRENT_SPAN: contextvars.ContextVar[str] = contextvars.ContextVar("kvpool_span", default="")


def request_id_of(metadata: Sequence[tuple[str, Any]] | None, key: str = REQUEST_ID_KEY) -> str:
    for name, value in metadata or ():
        if name == key and isinstance(value, str):
            return value
    return ""


class RpcTraceInterceptor(grpc.aio.ServerInterceptor):
    """Appends one line per served call that carries a request id (see the module doc)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, request_id: str, method: str, span: str, parent: str, start: float, end: float) -> None:
        line = json.dumps({"request_id": request_id, "method": method, "span": span, "parent": parent,
                           "start": start, "end": end})
        with open(self.path, "a") as trace:
            trace.write(line + "\n")

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        request_id = request_id_of(details.invocation_metadata)  # type: ignore[attr-defined]
        if handler is None or not request_id:
            return handler
        method = details.method  # type: ignore[attr-defined]
        parent = request_id_of(details.invocation_metadata, PARENT_SPAN_KEY)  # type: ignore[attr-defined]
        span = uuid.uuid4().hex[:16]

        def enter() -> None:
            CURRENT_SPAN.set(span)
        single = handler.unary_unary or handler.stream_unary  # one answer (ForwardPieces: a stream of pieces)
        if single is not None:
            async def answered(request: Any, context: Any) -> Any:
                enter()
                start = time.time()
                try:
                    return await single(request, context)
                finally:
                    self._write(request_id, method, span, parent, start, time.time())
            make = (grpc.unary_unary_rpc_method_handler if handler.unary_unary is not None
                    else grpc.stream_unary_rpc_method_handler)
            return make(answered, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                enter()
                start, written = time.time(), False
                try:
                    async for response in inner_stream(request, context):
                        if not written:
                            written = True
                            self._write(request_id, method, span, parent, start, time.time())
                        yield response
                finally:
                    if not written:
                        self._write(request_id, method, span, parent, start, time.time())
            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler


def _carried(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """The call's details with the serving task's span added as the callee's parent."""
    span = CURRENT_SPAN.get()
    metadata = list(details.metadata or ())
    if not span or any(k == PARENT_SPAN_KEY for k, _ in metadata):
        return details
    metadata.append((PARENT_SPAN_KEY, span))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*metadata),
                                      details.credentials, details.wait_for_ready)


# one class per call kind: a channel files an interceptor under the first kind it is
class _CarryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(_carried(details), request)


class _CarryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(_carried(details), request)


def trace_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """A server's interceptors: the trace, when ``KVPOOL_RPC_TRACE`` is set."""
    path = os.environ.get(TRACE_ENV, "")
    return [RpcTraceInterceptor(path)] if path else []


def carry_interceptors() -> list[Any]:
    """A channel's interceptors: carry the serving call's span on, when ``KVPOOL_RPC_TRACE`` is set."""
    return [_CarryUnary(), _CarryStream()] if os.environ.get(TRACE_ENV) else []


def critical_path(calls: list[dict[str, Any]], first_token_at: float) -> list[str]:
    """The control RPCs a request made, one after another, before its first token: the methods
    (``Service/Method``) of the longest such chain, in the order they started.

    The trace is a tree (each call names its caller's span; a call made by a
    task its handler started names that handler, even when it runs after the
    handler returned). A call counts itself plus its children's longest chain —
    children that ran one after another add up, children that overlapped (a
    fan-out to every stage) count as the deepest of them — over the calls that
    started before the first token, leaving out those that run beside the
    request (``OFF_PATH_METHODS``). Every stage's Decode.Landed calls (a check
    before each write, an announce after it) run one after another within the
    stage, so they chain, though they overlap the later pieces' compute. The
    entry call (the client's, to the router), when traced under the same id,
    is not counted.
    """
    kept = [c for c in calls if c["start"] < first_token_at and c["method"] not in OFF_PATH_METHODS]
    spans = {c["span"] for c in kept}
    children: dict[str, list[dict[str, Any]]] = {}
    for c in kept:
        children.setdefault(c["parent"] if c["parent"] in spans else "", []).append(c)

    def chain(siblings: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ordered = sorted(siblings, key=lambda c: c["start"])
        best = [nested(c) for c in ordered]
        for j, c in enumerate(ordered):
            for i in range(j):
                if ordered[i]["end"] <= c["start"] and len(best[i]) + len(nested(c)) > len(best[j]):
                    best[j] = best[i] + nested(c)
        return max(best, key=len, default=[])

    def nested(call: dict[str, Any]) -> list[dict[str, Any]]:
        return [call, *chain(children.get(call["span"], []))]

    roots = children.get("", [])
    if len(roots) == 1 and roots[0]["method"] == "/kvpool.rpc.Router/Generate":
        path = chain(children.get(roots[0]["span"], []))  # the client's own call is the entry, not a hop
    else:
        path = chain(roots)
    return [c["method"].removeprefix("/kvpool.rpc.") for c in sorted(path, key=lambda c: c["start"])]


def critical_path_depth(calls: list[dict[str, Any]], first_token_at: float) -> int:
    """How many control RPCs ``critical_path`` holds."""
    return len(critical_path(calls, first_token_at))
