"""``kvpool health``, the probe compose.yaml's health checks run: exact answers
from a real gRPC health service and a real HTTP server in this process."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvpool.tools.health import check, main
from kvpool.services import cli


@pytest.fixture
def grpc_health() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


def http_server(status: int) -> tuple[http.server.HTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/health"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serving_grpc_service_is_healthy(grpc_health, capsys) -> None:  # type: ignore[no-untyped-def]
    address, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert check(address, 3.0) == 0
    assert capsys.readouterr().err == ""


def test_not_serving_grpc_service_is_unhealthy_and_says_so(grpc_health, capsys) -> None:  # type: ignore[no-untyped-def]
    address, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert check(address, 3.0) == 1
    assert capsys.readouterr().err == f"kvpool health: {address}: NOT_SERVING\n"


def test_nothing_listening_is_unhealthy(capsys) -> None:  # type: ignore[no-untyped-def]
    address = f"127.0.0.1:{free_port()}"
    assert check(address, 3.0) == 1
    assert capsys.readouterr().err.startswith(f"kvpool health: {address}: UNAVAILABLE")


@pytest.mark.parametrize(("status", "expected"), [(200, 0), (503, 1)])
def test_http_health_is_the_status_code(status: int, expected: int, capsys) -> None:  # type: ignore[no-untyped-def]
    server, url = http_server(status)
    try:
        assert check(url, 3.0) == expected
    finally:
        server.shutdown()
        server.server_close()
    assert capsys.readouterr().err == ("" if expected == 0 else f"kvpool health: {url}: HTTP {status}\n")


def test_cli_and_module_run_the_same_check(grpc_health) -> None:  # type: ignore[no-untyped-def]
    address, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert cli.main(["health", address]) == 0
    assert main([address]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert cli.main(["health", address]) == 1
    assert main([address]) == 1
    assert main([]) == 2
