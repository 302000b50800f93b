"""A channel connects to a peer slow to answer: grpc gives a connection attempt only
``min_reconnect_backoff_ms``, and a loaded host has taken longer than 100 ms to answer a TLS handshake
("Handshake read failed (Endpoint closing)") or a plaintext connection's HTTP/2 SETTINGS ("timed out
before receiving SETTINGS frame"). A proxy in this process holds the server's first reply for 300 ms,
every time, so the peer is slow on any host."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvpool import service, tls
from kvpool.tools.certs import ThrowawayCA

HELD_S = 0.3  # well past 100 ms, well within service.CONNECT_TIMEOUT_MS
# what GRPC_OPTIONS had: the test shows it fails
FAST_OPTIONS = [*[o for o in service.GRPC_OPTIONS if o[0] != "grpc.min_reconnect_backoff_ms"],
                ("grpc.min_reconnect_backoff_ms", 100)]


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hold_first_s: float) -> None:
    first = True
    try:
        while data := await reader.read(65536):
            if first:
                await asyncio.sleep(hold_first_s)
                first = False
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def slow_server(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, ThrowawayCA]]:
    """A health server (TLS, or plaintext when parametrized so) behind a proxy that holds its first bytes
    to each client for ``HELD_S``."""
    ca = ThrowawayCA(tmp_path)
    master = ca.issue("master")
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    if getattr(request, "param", "tls") == "plaintext":
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        creds = grpc.ssl_server_credentials([(master.key.read_bytes(), master.cert.read_bytes())],
                                            root_certificates=ca.ca_path.read_bytes(), require_client_auth=True)
        port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()

    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:  # the server is stopping: the test is over
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer, 0), pipe(server_reader, client_writer, HELD_S))

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}", ca
    finally:
        proxy.close()
        await server.stop(None)
        tls.configure(tls.SecuritySettings(ca="", cert="", key=""))


async def check(channel: grpc.aio.Channel) -> str:
    async with channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_a_secure_channel_waits_out_a_slow_handshake(slow_server: tuple[str, ThrowawayCA]) -> None:
    address, ca = slow_server
    client = ca.issue("client")
    tls.configure(tls.SecuritySettings(ca=str(ca.ca_path), cert=str(client.cert), key=str(client.key)))
    assert await check(service.channel(address)) == "SERVING"
    # the same channel with 100 ms per attempt fails: the test can fail
    creds = tls.channel_credentials()
    assert creds is not None
    fast = grpc.aio.secure_channel(address, creds, options=FAST_OPTIONS)
    assert (await check(fast)).startswith("UNAVAILABLE")


@pytest.mark.parametrize("slow_server", ["plaintext"], indirect=True)
async def test_a_plaintext_channel_waits_out_a_slow_settings_frame(slow_server: tuple[str, ThrowawayCA]) -> None:
    address, _ = slow_server
    assert await check(service.channel(address)) == "SERVING"
    failed = await check(grpc.aio.insecure_channel(address, options=FAST_OPTIONS))
    assert failed.startswith("UNAVAILABLE"), failed
