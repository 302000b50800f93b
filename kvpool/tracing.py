"""Traces in OpenTelemetry's model: one span per served call of a request, under one trace id per request.

Off unless one of two variables is set (a process reads them on its first traced call; the services of a
cluster inherit them, and every role's ``--otlp-endpoint`` sets the second):

- ``KVPOOL_RPC_TRACE``: a file; every span ends as one JSON line there (``span_line``), which
  ``kvpool bench path`` counts (``kvpool.tools.bench.path_counts``). Appends of one short line are atomic
  on Linux, so every process of a cluster shares one file.
- ``KVPOOL_OTLP_ENDPOINT``: an OTLP/gRPC collector (``host:port``, or ``https://host:port``): spans are
  batched and exported to it (Jaeger, Tempo, the OpenTelemetry Collector), named by service
  (``service.name``: ``kvpool-<role>``).

What a span is:
- **A served gRPC call** (``TraceServerInterceptor``), of any kind, that carries a request id
  (``x-request-id``) or a W3C trace context (``traceparent``), and every call of an entry method
  (``ENTRY_METHODS``: a client's ``Router/Generate``). Its name is the method; its parent is the caller's
  span, carried as ``traceparent`` (W3C trace context) by every channel's client interceptor
  (``carry_interceptors``) from the span current where the call is made, and the request id rides the same
  context's ``tracestate`` as its ``kvpool`` entry (``trace_context``), beside the ``x-request-id`` header
  that ``kvpool.request_id`` carries whether or not anything traces. A handler's span is current while it
  runs, and tasks it starts inherit it, so the calls it makes are its children, streams included.
- **A message on the master's ``Session`` stream** (``session_span``): named as the unary method it stands
  for, kind ``session``, its parent the ``traceparent`` the message carries (the stream itself belongs to no
  request and has no span).
- **An HTTP request** at the router (``request_span``): the root of the request's trace, kind ``http``.

Each span holds ``kvpool.request_id``; ``kvpool.call_kind`` (``unary_unary``, ``unary_stream``,
``stream_unary``, ``stream_stream``, ``session``, ``http``); ``kvpool.sent`` (when the caller sent the call, by
its clock: metadata ``x-call-sent``; a fan-out's calls all go before any answer); ``kvpool.detached`` (made
from a task nobody waits for, such as a lease's release after the forward: on no critical path);
``kvpool.messages_in``/``messages_out``; and one ``answer`` event per answer its caller waited for. An answer
is awaited when the server sends it after reading a message since its last answer: a unary call's reply, a
server stream's first message, a client stream's reply after the last write, and in a bidirectional stream
each reply to new messages. So a call moved onto a stream keeps its round trips.

Logs carry the trace id of the span current where they are written (``add_trace_id``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvpool.child_env import children_env
from kvpool.request_id import current_request_id, is_sane

REQUEST_ID_KEY = "x-request-id"
TRACEPARENT_KEY = "traceparent"
TRACESTATE_KEY = "tracestate"
STATE_KEY = "kvpool"  # our entry of the W3C tracestate: the request id
SENT_KEY = "x-call-sent"  # when the caller opened the call, Unix seconds: a fan-out's calls all go before any answer
DETACHED_KEY = "x-call-detached"  # "1": made from a task nobody waits for
TRACE_ENV = "KVPOOL_RPC_TRACE"
OTLP_ENV = "KVPOOL_OTLP_ENDPOINT"
# calls traced though they carry no request id or trace context: a request's first hop
ENTRY_METHODS = frozenset({"/kvpool.rpc.Router/Generate"})
_UNTRACED = ("/grpc.health.v1.Health/", "/grpc.reflection.")

DETACHED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvpool_detached", default=False)
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent and tracestate
_service = ["kvpool"]
_tracers: dict[tuple[str, str], trace.Tracer] = {}
_lock = threading.Lock()


def set_service_name(name: str) -> None:
    """What this process's spans name as their ``service.name`` (before its first traced call)."""
    _service[0] = name


def tracing() -> bool:
    """Whether this process traces (either variable is set)."""
    return bool(os.environ.get(TRACE_ENV) or os.environ.get(OTLP_ENV))


def tracer(path: str | None = None) -> trace.Tracer | None:
    """The tracer that exports where the variables say (``path``: this file instead of ``TRACE_ENV``'s); None
    when tracing is off. Made once per destination per process, on first use (never before a fork)."""
    path = os.environ.get(TRACE_ENV, "") if path is None else path
    endpoint = os.environ.get(OTLP_ENV, "")
    if not (path or endpoint):
        return None
    key = (path, endpoint)
    with _lock:
        if key not in _tracers:
            provider = TracerProvider(resource=Resource.create({"service.name": _service[0],
                                                                 "process.pid": os.getpid()}))
            if path:
                provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
            if endpoint:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

                secure = endpoint.startswith("https://")
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
                    endpoint=endpoint.removeprefix("https://").removeprefix("http://"), insecure=not secure)))
            made = provider.get_tracer("kvpool")
            made._kvpool_provider = provider  # type: ignore[attr-defined]  # flush() reaches it
            _tracers[key] = made
        return _tracers[key]


def flush(timeout_s: float = 2.0) -> None:
    """Export every span ended so far (a process about to exit, whose batch would be lost)."""
    with _lock:
        tracers = list(_tracers.values())
    for tracer_ in tracers:
        provider = getattr(tracer_, "_kvpool_provider", None)
        if provider is not None:
            provider.force_flush(int(timeout_s * 1000))


@contextlib.contextmanager
def tracing_children(path: Path) -> Iterator[None]:
    """Within: the processes started here write their spans into ``path`` (they inherit ``TRACE_ENV``);
    the variable is as it was afterwards."""
    with children_env(TRACE_ENV, str(path)):
        yield


def detached(coro: Awaitable[Any]) -> asyncio.Future[Any]:
    """Run ``coro`` (a coroutine: a call object made before would already be on its way) as a task nobody
    waits for; the calls it makes are traced as detached."""
    context = contextvars.copy_context()
    context.run(DETACHED.set, True)
    return context.run(asyncio.ensure_future, coro)  # the task runs in (a copy of) that context


def current_traceparent() -> str:
    """The W3C ``traceparent`` of the span current here ("" when none)."""
    return dict(trace_context("")).get(TRACEPARENT_KEY, "")


def trace_context(request_id: str) -> list[tuple[str, str]]:
    """The W3C trace context a call carries: the current span's ``traceparent``, and a ``tracestate`` whose
    ``kvpool`` entry is the request id (ids are ``[A-Za-z0-9._:-]``, valid there), after any other vendor's."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    headers = [(TRACEPARENT_KEY, carrier[TRACEPARENT_KEY])] if TRACEPARENT_KEY in carrier else []
    if request_id:
        others = [e for e in carrier.get(TRACESTATE_KEY, "").split(",") if e and not e.startswith(STATE_KEY + "=")]
        headers.append((TRACESTATE_KEY, ",".join([f"{STATE_KEY}={request_id}", *others[:31]])))
    elif TRACESTATE_KEY in carrier:
        headers.append((TRACESTATE_KEY, carrier[TRACESTATE_KEY]))
    return headers


def request_id_in(tracestate: str) -> str:
    """The request id a W3C ``tracestate`` carries ("" when none)."""
    for entry in tracestate.split(","):
        key, _, value = entry.strip().partition("=")
        if key == STATE_KEY:
            return value
    return ""


def name_request(request_id: str) -> None:
    """Name the request on the span current here (an entry call's span learns its id once assigned)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("kvpool.request_id", request_id)


def add_trace_id(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor: the trace id of the span current where the line is written."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", format_trace_id(context.trace_id))
    return event_dict


def metadata_value(metadata: Sequence[tuple[str, Any]] | None, key: str) -> str:
    for name, value in metadata or ():
        if name == key and isinstance(value, str):
            return value
    return ""



def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


# ---- the file exporter ----------------------------------------------------


def span_line(span: ReadableSpan) -> dict[str, Any]:
    """One span as the trace file's line: what ``kvpool bench path`` counts."""
    attributes = span.attributes or {}
    start = (span.start_time or 0) / 1e9
    answers = [event.timestamp / 1e9 for event in span.events if event.name == "answer"]
    end = answers[0] if answers else (span.end_time or span.start_time or 0) / 1e9
    line: dict[str, Any] = {
        "request_id": attributes.get("kvpool.request_id", ""), "method": span.name,
        "kind": attributes.get("kvpool.call_kind", ""), "trace_id": format_trace_id(span.context.trace_id),
        "span": format_span_id(span.context.span_id),
        "parent": format_span_id(span.parent.span_id) if span.parent is not None else "",
        "service": span.resource.attributes.get("service.name", ""),
        "sent": attributes.get("kvpool.sent") or start, "start": start, "end": end, "answers": answers,
        "messages_in": attributes.get("kvpool.messages_in", 0), "messages_out": attributes.get("kvpool.messages_out", 0),
    }
    if attributes.get("kvpool.detached"):
        line["detached"] = True
    return line


class JsonLinesExporter(SpanExporter):
    """Every ended span as one JSON line appended to a file (``span_line``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a") as out:
            for span in spans:
                out.write(json.dumps(span_line(span)) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


# ---- spans ----------------------------------------------------------------


class CallSpan:
    """A served call's span: an answer is awaited only when a message came in since the last one."""

    __slots__ = ("span", "messages_in", "messages_out", "unanswered")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.messages_in = self.messages_out = 0
        self.unanswered = False

    def received(self) -> None:
        self.messages_in += 1
        self.unanswered = True

    def replied(self) -> None:
        self.messages_out += 1
        if self.unanswered:
            self.span.add_event("answer")
            self.unanswered = False

    def end(self, error: BaseException | None = None) -> None:
        self.span.set_attribute("kvpool.messages_in", self.messages_in)
        self.span.set_attribute("kvpool.messages_out", self.messages_out)
        if error is not None and not isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
        self.span.end()


def _attributes(request_id: str, kind: str, sent: float, detached: bool) -> dict[str, Any]:
    attributes: dict[str, Any] = {"kvpool.call_kind": kind, "rpc.system": "grpc"}
    if request_id:
        attributes["kvpool.request_id"] = request_id
    if sent:
        attributes["kvpool.sent"] = sent
    if detached:
        attributes["kvpool.detached"] = True
    return attributes


def session_span(tracer_: trace.Tracer, method: str, request_id: str, traceparent: str, sent: float,
                 detached: bool, started_ns: int) -> CallSpan:
    """The span of one ``Session`` message, begun when it was read: the caller ends it with ``replied`` and
    ``end`` once it is answered."""
    parent = _PROPAGATOR.extract({TRACEPARENT_KEY: traceparent}) if traceparent else otel_context.Context()
    span = tracer_.start_span(method, context=parent, kind=SpanKind.SERVER, start_time=started_ns,
                              attributes=_attributes(request_id, "session", sent, detached))
    call = CallSpan(span)
    call.received()
    return call


@contextlib.contextmanager
def request_span(name: str, request_id: str) -> Iterator[None]:
    """The root span of an HTTP request's trace, current within (nothing when tracing is off)."""
    tracer_ = tracer()
    if tracer_ is None:
        yield
        return
    span = tracer_.start_span(name, context=otel_context.Context(), kind=SpanKind.SERVER,
                              attributes={"kvpool.call_kind": "http", "kvpool.request_id": request_id})
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # a generator closed elsewhere: its context is gone already
            otel_context.detach(token)
        span.end()


class TraceServerInterceptor(grpc.aio.ServerInterceptor):
    """A span for every served call of a request, of every call kind (see the module doc)."""

    def __init__(self, tracer_: trace.Tracer) -> None:
        self.tracer = tracer_

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(_UNTRACED):
            return handler
        metadata = details.invocation_metadata  # type: ignore[attr-defined]
        traceparent = metadata_value(metadata, TRACEPARENT_KEY)
        tracestate = metadata_value(metadata, TRACESTATE_KEY)
        request_id = metadata_value(metadata, REQUEST_ID_KEY) or request_id_in(tracestate)
        if request_id and not is_sane(request_id):  # a caller's id goes into trace files only when it is sane
            request_id = ""
        if not (request_id or traceparent or method in ENTRY_METHODS):
            return handler
        parent = (_PROPAGATOR.extract({TRACEPARENT_KEY: traceparent, TRACESTATE_KEY: tracestate}) if traceparent
                  else otel_context.Context())
        sent = _seconds(metadata_value(metadata, SENT_KEY))
        is_detached = metadata_value(metadata, DETACHED_KEY) == "1"
        kind = ("stream_" if handler.request_streaming else "unary_") + \
               ("stream" if handler.response_streaming else "unary")
        tracer_ = self.tracer

        def begin() -> CallSpan:
            span = tracer_.start_span(method, context=parent, kind=SpanKind.SERVER,
                                      attributes=_attributes(request_id, kind, sent, is_detached))
            # the calls this handler makes (and the tasks it starts) name its span as their parent; the
            # call's task ends with the handler, and its context with it
            otel_context.attach(trace.set_span_in_context(span))
            DETACHED.set(is_detached)  # and are detached when it is
            return CallSpan(span)

        async def counted(requests: AsyncIterator[Any], call: CallSpan) -> AsyncIterator[Any]:
            async for request in requests:
                call.received()
                yield request

        wrap: Callable[..., grpc.RpcMethodHandler]
        if kind == "unary_unary" or kind == "stream_unary":
            inner_single = handler.unary_unary or handler.stream_unary

            async def answered(request: Any, context: Any) -> Any:
                call = begin()
                if kind == "unary_unary":
                    call.received()
                else:
                    request = counted(request, call)
                error: BaseException | None = None
                try:
                    response = await inner_single(request, context)
                    call.replied()
                    return response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    call.end(error)
            wrap = (grpc.unary_unary_rpc_method_handler if kind == "unary_unary"
                    else grpc.stream_unary_rpc_method_handler)
            return wrap(answered, handler.request_deserializer, handler.response_serializer)

        inner_stream = handler.unary_stream or handler.stream_stream

        async def streamed(request: Any, context: Any) -> AsyncIterator[Any]:
            call = begin()
            if kind == "unary_stream":
                call.received()
            else:
                request = counted(request, call)
            error: BaseException | None = None
            try:
                async for response in inner_stream(request, context):
                    call.replied()
                    yield response
            except BaseException as exc:
                error = exc
                raise
            finally:
                call.end(error)
        wrap = (grpc.unary_stream_rpc_method_handler if kind == "unary_stream"
                else grpc.stream_stream_rpc_method_handler)
        return wrap(streamed, handler.request_deserializer, handler.response_serializer)


def _carried(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """The call's details with the time it was sent and the current span's trace context, the callee's
    parent."""
    metadata = [(k, v) for k, v in details.metadata or () if k not in (SENT_KEY, TRACEPARENT_KEY, TRACESTATE_KEY)]
    metadata.append((SENT_KEY, repr(time.time())))
    if DETACHED.get():
        metadata.append((DETACHED_KEY, "1"))
    metadata += trace_context(current_request_id())
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


def trace_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """A server's interceptors: spans, when tracing is on."""
    tracer_ = tracer()
    return [TraceServerInterceptor(tracer_)] if tracer_ is not None else []


def carry_interceptors() -> list[Any]:
    """A channel's interceptors: carry the current span's trace context on, when tracing is on (calls whose
    request is one message; a call that streams its requests passes ``carried_metadata`` as it starts:
    ``kvpool.request_id.client_interceptors`` says why)."""
    if not tracing():
        return []
    return [_CarryUnaryUnary(), _CarryUnaryStream()]


def carried_metadata() -> list[tuple[str, str]]:
    """What the carrying interceptors add to a call's metadata (when tracing is on; else nothing), for a call
    that streams its requests to pass as it starts."""
    if not tracing():
        return []
    return list(_carried(grpc.aio.ClientCallDetails("", None, grpc.aio.Metadata(), None, None)).metadata)
