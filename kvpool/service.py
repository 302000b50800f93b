"""What every kvpool service process shares: a gRPC server with the standard
health service and server reflection, client channels, Prometheus metrics on
an admin HTTP port, a ready file for whoever started it, and graceful shutdown
on SIGTERM/SIGINT. Servers and channels made here carry the request id
(``kvpool.request_id``) across every call."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
import uvloop
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvpool import ports, request_id, tls
from kvpool.admin_http import start_admin
from kvpool.core.admission import retry as retry_policy
from kvpool.core.errors import InvalidArgument
from kvpool.status import abort
from kvpool.tracing import carried_metadata as tracing_metadata
from kvpool.tracing import carry_interceptors, trace_interceptors

log = structlog.get_logger(__name__)

# KV batches are large; control messages are not, but location lists for a
# long prompt can reach a few MB.
# grpc takes min_reconnect_backoff as the time one connection attempt may take (its
# "min connect timeout"), not only as a backoff floor. 100 ms fitted a loopback TCP
# connect, not a peer that must be scheduled to answer: a TLS handshake's round
# trips ("Handshake read failed (Endpoint closing)", a 4-stage compose cluster at
# load 28 on 2 cores) or a plaintext peer's HTTP/2 SETTINGS ("timed out before
# receiving SETTINGS frame", a decode shard's Reserve under bench load). A dead
# peer refuses the connect at once, so this costs waiting only on a frozen one.
CONNECT_TIMEOUT_MS = 2000

# KV batches are large; control messages are not, but location lists for a
# long prompt can reach a few MB.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
    # a restarted peer is found again within ~2 s instead of grpc's default
    # backoff of up to two minutes
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# a stopping service waits until no call has started for this long (its callers
# saw it not-ready at their next health check: the router checks every second)
DRAIN_QUIET_S = 1.5
_UNCOUNTED = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class InFlight(grpc.aio.ServerInterceptor):
    """Counts the calls a server is serving (health checks, reflection and ``watches`` aside), for draining."""

    def __init__(self, watches: Iterable[str] = ()) -> None:
        # full method names of subscriptions (a server stream that lives as long as its caller, as a decode
        # shard's WatchRoom): not work in flight, and counted they would hold every drain for its whole grace
        self.uncounted = (*_UNCOUNTED, *watches)
        self.count = 0
        self.last_started = 0.0  # event-loop time of the last counted call

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.uncounted):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary is not None:  # the stages' ForwardPieces
            return grpc.stream_unary_rpc_method_handler(
                self._unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        # a bidirectional stream (the master's Session) lives as long as its client: counting it would hold
        # every drain for its whole grace; its messages are answered at once, so none is cut midway
        return handler

    def _start(self) -> None:
        self.count += 1
        self.last_started = asyncio.get_running_loop().time()

    def _unary(self, method):  # type: ignore[no-untyped-def]
        async def counted(request, context):  # type: ignore[no-untyped-def]
            self._start()
            try:
                return await method(request, context)
            finally:
                self.count -= 1
        return counted

    def _stream(self, method):  # type: ignore[no-untyped-def]
        async def counted(request, context):  # type: ignore[no-untyped-def]
            self._start()
            try:
                async for response in method(request, context):
                    yield response
            finally:
                self.count -= 1
        return counted


@dataclass(frozen=True, slots=True)
class Unparsed:
    """Request bytes that did not parse as the method's message (bad wire format, invalid UTF-8 in a string)."""

    message: str
    reason: str


def _input_type(method: str) -> str:
    """The request message's full name of ``/package.Service/Method``; the path itself if it is not loaded."""
    service_name, _, method_name = method.lstrip("/").partition("/")
    try:
        service = descriptor_pool.Default().FindServiceByName(service_name)
        return service.FindMethodByName(method_name).input_type.full_name
    except (KeyError, AttributeError):
        return method


class ParseRequests(grpc.aio.ServerInterceptor):
    """Every method of every server: bytes that do not parse as its request message are answered
    INVALID_ARGUMENT naming the message (field ``request``), not the UNKNOWN gRPC gives a failed deserializer.

    The deserializer hands such bytes on as ``Unparsed``; the behavior refuses it before the servicer sees it,
    so servicers only ever get parsed messages. Innermost, so the other interceptors keep its deserializer."""

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        message, deserialize = _input_type(details.method), handler.request_deserializer

        def parse(raw: bytes) -> Any:
            try:
                return deserialize(raw)
            except DecodeError as exc:
                return Unparsed(message, str(exc))

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, Unparsed):
                await abort(context, InvalidArgument(f"request: not a {request.message} ({request.reason})",
                                                     field="request"), details.method)

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def checked_unary(request, context):  # type: ignore[no-untyped-def]
                await refuse(request, context)
                return await unary(request, context)
            return grpc.unary_unary_rpc_method_handler(checked_unary, parse, handler.response_serializer)
        async def parsed(request_iterator):  # type: ignore[no-untyped-def]
            async for request in request_iterator:
                if isinstance(request, Unparsed):
                    raise InvalidArgument(f"request: not a {request.message} ({request.reason})", field="request")
                yield request

        if handler.stream_stream is not None:  # the master's Session: a message that does not parse ends it
            both = handler.stream_stream

            async def checked_both(request_iterator, context):  # type: ignore[no-untyped-def]
                try:
                    async for response in both(parsed(request_iterator), context):
                        yield response
                except InvalidArgument as exc:
                    await abort(context, exc, details.method)
            return grpc.stream_stream_rpc_method_handler(checked_both, parse, handler.response_serializer)
        if handler.stream_unary is not None:  # the stages' ForwardPieces: each message checked as it is read
            pieces = handler.stream_unary

            async def checked_pieces(request_iterator, context):  # type: ignore[no-untyped-def]
                return await pieces(parsed(request_iterator), context)
            return grpc.stream_unary_rpc_method_handler(checked_pieces, parse, handler.response_serializer)
        stream = handler.unary_stream
        if inspect.isasyncgenfunction(stream):
            async def checked_stream(request, context):  # type: ignore[no-untyped-def]
                await refuse(request, context)
                async for response in stream(request, context):
                    yield response
        else:  # a coroutine that writes through context.write (the health service's Watch)
            async def checked_stream(request, context):  # type: ignore[no-untyped-def]
                await refuse(request, context)
                return await stream(request, context)
        return grpc.unary_stream_rpc_method_handler(checked_stream, parse, handler.response_serializer)


@dataclass(slots=True)
class ServerHandle:
    """A started gRPC server, its health servicer and its count of calls in flight."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    in_flight: InFlight

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)

    async def drain(self, grace_s: float, quiet_s: float = DRAIN_QUIET_S) -> int:
        """Stop being ready, then keep serving until nothing is in flight and no call started for
        ``quiet_s`` (callers have seen us not-ready), at most ``grace_s``. Returns the calls left."""
        await self.set_serving(False)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + grace_s
        while loop.time() < deadline:
            if self.in_flight.count == 0 and loop.time() - self.in_flight.last_started >= quiet_s:
                break
            await asyncio.sleep(0.05)  # polling two counters
        left = self.in_flight.count
        # calls still in flight past the grace period are cut: say so loudly
        (log.warning if left else log.info)("drained", waited_s=round(loop.time() - started, 3), calls_left=left)
        return left


async def create_server(
    host: str,
    port: int,
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str] = (),
    health_servicer: health.aio.HealthServicer | None = None,
    inbound_request_ids: bool = True,
    reuse_port: bool = False,
    max_receive_bytes: int = 64 << 20,
    max_concurrent_rpcs: int | None = None,
    watches: Iterable[str] = (),
) -> ServerHandle:
    """Create and start a server bound to ``host:port`` (port 0 picks one).

    ``service_names`` are the full names (``kvpool.rpc.PoolMaster``) of the
    services ``add_servicers`` adds. They are published through gRPC server
    reflection together with the health and reflection services, so grpcurl
    and similar tools work without the proto files. A name whose descriptor
    is not loaded is an error here, not a reflection miss later.
    ``health_servicer`` replaces the stock health service (e.g. one that
    answers for a whole pipeline).

    With ``inbound_request_ids`` a call's ``x-request-id`` metadata is bound
    around its handler (``kvpool.request_id``); the router, which assigns ids
    itself, turns it off. ``reuse_port``: another process may listen on the
    same port beside this one (SO_REUSEPORT: a router's successor during a
    handover); off, a second bind fails, as a port conflict should.
    ``max_receive_bytes``: a larger message is refused (RESOURCE_EXHAUSTED)
    before it is parsed; the default fits a long prompt's location lists, a
    public port takes less. ``max_concurrent_rpcs``: calls open at once at
    most, streams included; one more is answered RESOURCE_EXHAUSTED (None:
    no bound, for internal ports whose callers are the cluster's own).
    ``watches``: full method names (``/kvpool.rpc.Decode/WatchRoom``) of
    subscriptions, which a drain does not wait for (``InFlight``).
    """
    names = list(dict.fromkeys(service_names))
    known = descriptor_pool.Default()
    for name in names:
        try:
            known.FindServiceByName(name)
        except KeyError:
            raise ValueError(f"no protobuf service named {name!r} is loaded; "
                             "service_names takes full names such as 'kvpool.rpc.PoolMaster'") from None
    in_flight = InFlight(watches)
    # in_flight outermost: a call counts as in flight for the whole of its handler
    interceptors = [in_flight, request_id.RequestIdServerInterceptor()] if inbound_request_ids else [in_flight]
    interceptors += tls.interceptors()  # the caller's certificate must name a role allowed this method
    # ParseRequests innermost: the handler it returns (its deserializer) is the one the others wrap
    interceptors += [*trace_interceptors(), ParseRequests()]
    options = [o for o in GRPC_OPTIONS if o[0] not in ("grpc.so_reuseport", "grpc.max_receive_message_length")]
    options += [("grpc.so_reuseport", int(reuse_port)), ("grpc.max_receive_message_length", max_receive_bytes)]
    server = grpc.aio.server(options=options, interceptors=interceptors, maximum_concurrent_rpcs=max_concurrent_rpcs)
    health_servicer = health_servicer or health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    add_servicers(server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    # mutual TLS once the process is configured; port 0: a free one below the ephemeral range (kvpool.ports)
    bound = ports.listen(host, port, lambda p: tls.add_port(server, f"{host}:{p}"))
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    handle = ServerHandle(server, bound, health_servicer, in_flight)
    await handle.set_serving(True)
    return handle


def channel(address: str, options: Sequence[tuple[str, Any]] = GRPC_OPTIONS) -> grpc.aio.Channel:
    """A channel to another kvpool service: its calls carry the bound request id as metadata, and gRPC tries
    an idempotent call again when it did not reach an answer (``kvpool.core.admission.retry``)."""
    creds = tls.channel_credentials()  # mutual TLS once the process is configured (kvpool/tls.py)
    interceptors = [*request_id.client_interceptors(), *carry_interceptors()]
    options = [*options, ("grpc.enable_retries", 1), ("grpc.service_config", retry_policy.service_config())]
    if creds is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=interceptors)


def stream_metadata() -> list[tuple[str, str]]:
    """The metadata a call that streams its requests starts with (``Session``, ``ForwardPieces``): the bound
    request id and, when tracing, the send time and trace context, which the channel's interceptors add to the
    other calls (``kvpool.request_id.client_interceptors`` says why not to these)."""
    return [*request_id.call_metadata(), *tracing_metadata()]


def start_metrics(host: str, port: int, registry: CollectorRegistry) -> int:
    """Serve Prometheus text on ``host:port/metrics``, over mutual TLS once the process is configured
    (``kvpool.admin_http``); returns the port."""
    return int(start_admin(host, port, registry).server_address[1])


def write_ready_file(path: str | None, **fields: object) -> None:
    """Atomically publish bound ports etc. for the process that started us."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **fields}))
    tmp.replace(target)


class Stop(asyncio.Event):
    """Set by SIGTERM or SIGINT, which differ in how a draining server waits.

    SIGTERM (systemd, a rolling restart): turn not-ready and keep serving until
    callers have seen it (``DRAIN_QUIET_S`` without a new call). SIGINT
    (Ctrl-C, or ``kvpool up`` stopping the whole cluster after its router):
    nobody routes here any more, so finish what is in flight and exit.
    ``quick`` is never unset: a SIGTERM after a SIGINT changes nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.quick = False

    def interrupt(self) -> None:
        self.quick = True
        self.set()

    @property
    def quiet_s(self) -> float:
        """How long a drain waits for no new call once in-flight calls are done."""
        return 0.0 if self.quick else DRAIN_QUIET_S


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.interrupt if isinstance(stop, Stop) else stop.set)


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run a service's main coroutine on uvloop."""
    uvloop.run(main())
