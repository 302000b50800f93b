"""What every kvpool service process shares: a gRPC server with the standard
health service and server reflection, Prometheus metrics on an admin HTTP
port, a ready file for whoever started it, and graceful shutdown on
SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
import uvloop
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

log = structlog.get_logger(__name__)

# KV batches are large; control messages are not, but location lists for a
# long prompt can reach a few MB.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
    # a restarted peer is found again within ~2 s instead of grpc's default
    # backoff of up to two minutes
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(slots=True)
class ServerHandle:
    """A started gRPC server and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)


async def create_server(
    host: str,
    port: int,
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str] = (),
    health_servicer: health.aio.HealthServicer | None = None,
) -> ServerHandle:
    """Create and start a server bound to ``host:port`` (port 0 picks one).

    ``service_names`` are the full names (``kvpool.rpc.PoolMaster``) of the
    services ``add_servicers`` adds. They are published through gRPC server
    reflection together with the health and reflection services, so grpcurl
    and similar tools work without the proto files. A name whose descriptor
    is not loaded is an error here, not a reflection miss later.
    ``health_servicer`` replaces the stock health service (e.g. one that
    answers for a whole pipeline).
    """
    names = list(dict.fromkeys(service_names))
    known = descriptor_pool.Default()
    for name in names:
        try:
            known.FindServiceByName(name)
        except KeyError:
            raise ValueError(f"no protobuf service named {name!r} is loaded; "
                             "service_names takes full names such as 'kvpool.rpc.PoolMaster'") from None
    server = grpc.aio.server(options=GRPC_OPTIONS)
    health_servicer = health_servicer or health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    add_servicers(server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    handle = ServerHandle(server, bound, health_servicer)
    await handle.set_serving(True)
    return handle


def start_metrics(host: str, port: int, registry: CollectorRegistry) -> int:
    """Serve Prometheus text on ``http://host:port/metrics``; returns the port."""
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    return int(httpd.server_port)


def write_ready_file(path: str | None, **fields: object) -> None:
    """Atomically publish bound ports etc. for the process that started us."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **fields}))
    tmp.replace(target)


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run a service's main coroutine on uvloop."""
    uvloop.run(main())
