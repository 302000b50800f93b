"""The admin port (``kvpool.admin_http``): tenants' series only behind a certificate of a reading role.

A real server on loopback, real TLS from a throwaway CA; ``kvpool.tls`` is configured for the test
and put back after.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpool import tls
from kvpool.admin_http import AdminServer, start_admin
from kvpool.tools.certs import Identity, ThrowawayCA


@pytest.fixture
def registry() -> CollectorRegistry:
    r = CollectorRegistry()
    Gauge("kvpool_pool_tenant_bytes", "bytes by tenant", ["tenant"], registry=r).labels("alice").set(7)
    Counter("kvpool_requests", "requests", registry=r).inc(3)
    Gauge("kvpool_mixed", "some by tenant, some not", ["tenant", "kind"], registry=r).labels("", "x").set(1)
    return r


@pytest.fixture
def plain(registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> Iterator[AdminServer]:
    for env in tls.ENV.values():
        monkeypatch.delenv(env, raising=False)
    tls.configure(tls.SecuritySettings())  # unconfigured: plaintext
    # the idle sockets' timeout must outlast the steps that fill both slots and are refused a third on a
    # loaded host (2 s did not once, with the whole suite on 2 cores: the slots had freed by the check)
    server = start_admin("127.0.0.1", 0, registry, timeout_s=5.0, max_connections=2)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def ca(tmp_path: Path) -> ThrowawayCA:
    return ThrowawayCA(tmp_path / "certs")


@pytest.fixture
def secure(registry: CollectorRegistry, ca: ThrowawayCA, monkeypatch: pytest.MonkeyPatch) -> Iterator[AdminServer]:
    for env in tls.ENV.values():
        monkeypatch.delenv(env, raising=False)
    me = ca.issue("master")
    tls.configure(tls.SecuritySettings(ca=str(me.ca), cert=str(me.cert), key=str(me.key)))
    server = start_admin("127.0.0.1", 0, registry, timeout_s=0.5)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        tls.configure(tls.SecuritySettings())


def port(server: AdminServer) -> int:
    return int(server.server_address[1])


def connections_become(server: AdminServer, count: int) -> int:
    """The server's count of connections it serves, once it is ``count`` (or 5 s passed)."""
    deadline = time.monotonic() + 5
    while server.connections != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.connections


def scrape(server: AdminServer, who: Identity | None, ca: ThrowawayCA, path: str = "/metrics") -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(ca.ca_path))
    if who is not None:
        context.load_cert_chain(str(who.cert), str(who.key))
    connection = http.client.HTTPSConnection("127.0.0.1", port(server), context=context, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def test_plaintext_serves_no_series_that_names_a_tenant(plain: AdminServer) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port(plain)}/metrics", timeout=5) as page:
        text = page.read().decode()
    assert "kvpool_requests_total 3.0" in text
    assert "tenant" not in text.replace("by tenant", "")  # HELP lines may say so; no label does
    assert "alice" not in text


def test_other_paths_are_404(plain: AdminServer) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{port(plain)}/debug", timeout=5)
    assert info.value.code == 404


def test_idle_sockets_past_the_bound_are_closed_and_a_freed_slot_serves(plain: AdminServer) -> None:
    idle = [socket.create_connection(("127.0.0.1", port(plain))) for _ in range(2)]
    try:
        assert connections_become(plain, 2) == 2  # the server has accepted both
        extra = socket.create_connection(("127.0.0.1", port(plain)))
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed, not served: both slots are taken
        assert plain.connections == 2
        extra.close()
        idle.pop().close()  # its slot frees when the server reads its end, long before the timeout
        assert connections_become(plain, 1) == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port(plain)}/metrics", timeout=5) as page:
            assert page.status == 200
    finally:
        for s in idle:
            s.close()


def test_an_idle_socket_is_cut_off_at_the_timeout(registry: CollectorRegistry) -> None:
    server = start_admin("127.0.0.1", 0, registry, timeout_s=0.3, max_connections=1)
    try:
        idle = socket.create_connection(("127.0.0.1", port(server)))
        idle.settimeout(10)
        start = time.monotonic()
        assert idle.recv(1) == b""  # closed by the server, not by this socket's own timeout
        assert 0.2 < time.monotonic() - start < 5
        idle.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port(server)}/metrics", timeout=5) as page:
            assert page.status == 200  # its one slot is free again
    finally:
        server.shutdown()
        server.server_close()


def test_shutdown_stops_the_serving_loop_and_it_can_serve_again(registry: CollectorRegistry) -> None:
    server = AdminServer("127.0.0.1", 0, registry, None)
    try:
        for _ in range(2):  # a second serve after a shutdown serves as the first did
            loop = threading.Thread(target=server.serve_forever, daemon=True)
            loop.start()
            with urllib.request.urlopen(f"http://127.0.0.1:{port(server)}/metrics", timeout=5) as page:
                assert page.status == 200
            server.shutdown()  # returns once the loop has stopped (it is woken, not polled)
            loop.join(5)
            assert not loop.is_alive()
    finally:
        server.server_close()


def test_with_tls_a_monitor_or_client_certificate_reads_every_series(secure: AdminServer, ca: ThrowawayCA) -> None:
    for role in ("monitor", "client"):
        status, text = scrape(secure, ca.issue(role), ca)
        assert status == 200
        assert 'kvpool_pool_tenant_bytes{tenant="alice"} 7.0' in text


def test_with_tls_other_roles_are_refused(secure: AdminServer, ca: ThrowawayCA) -> None:
    for role in ("decode", "router", "store/s0"):
        status, text = scrape(secure, ca.issue(role), ca)
        assert status == 403 and "needs the client or monitor role" in text and "alice" not in text


def test_with_tls_no_certificate_and_plaintext_get_nothing(secure: AdminServer, ca: ThrowawayCA) -> None:
    with pytest.raises((ssl.SSLError, ConnectionError)):
        scrape(secure, None, ca)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        with urllib.request.urlopen(f"http://127.0.0.1:{port(secure)}/metrics", timeout=5) as page:
            page.read()
    other = ThrowawayCA(ca.folder.parent / "other")  # a certificate of another CA: refused in the handshake
    with pytest.raises((ssl.SSLError, ConnectionError)):
        scrape(secure, other.issue("monitor"), ca)
    assert scrape(secure, ca.issue("monitor"), ca)[0] == 200  # and it still serves
