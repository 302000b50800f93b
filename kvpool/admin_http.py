"""Every service's admin port: Prometheus ``/metrics``, behind the cluster's certificates when it has them.

The metrics name each tenant and what it holds (``kvpool_pool_tenant_bytes{tenant=…}``, a stage's
device blocks per tenant), which one tenant must not read of another. So:

- **mutual TLS configured** (``kvpool.tls``): the port serves HTTPS only, a client certificate of the
  cluster's CA is required in the handshake, and its role must be one that reads admin ports
  (``kvpool.core.tenancy.access.ADMIN_READERS``: ``monitor``, a scraper's, or ``client``, an
  operator's); any other role gets 403. Such a scrape gets every series.
- **plaintext**: nobody is authenticated, so no series that names a tenant is served
  (``public_view``); the rest are.

A connection gets ``TIMEOUT_S`` for its TLS handshake and request together; at most
``MAX_CONNECTIONS`` are served at once, and one past that is closed at once, so a flood of idle
sockets cannot pin threads.
"""

from __future__ import annotations

import http.server
import os
import selectors
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from kvpool import ports, tls
from kvpool.core.errors import PermissionDenied
from kvpool.core.tenancy.access import Peer, authorize_admin

log = structlog.get_logger(__name__)

TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
TENANT_LABEL = "tenant"
PATHS = ("/metrics", "/")


class PublicView:
    """``registry`` without any sample that names a tenant (a family left empty is left out)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            samples = [s for s in family.samples if TENANT_LABEL not in s.labels]
            if not samples and family.samples:
                continue
            public = Metric(family.name, family.documentation, family.type, family.unit)
            public.samples = samples  # a copy: a collector may hand out the same family every time
            yield public


def public_view(registry: CollectorRegistry) -> PublicView:
    return PublicView(registry)


def peer_of_certificate(certificate: dict[str, Any] | None) -> Peer:
    """The role a verified client certificate names (its common name)."""
    if not certificate:
        raise PermissionDenied("admin port: the caller presented no certificate")
    for rdn in certificate.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return Peer.from_common_name(value)
    raise PermissionDenied("admin port: the certificate names no common name")


class _Handler(http.server.BaseHTTPRequestHandler):
    server: AdminServer
    timeout = None  # the socket's timeout is the server's (get_request): a request that dawdles is cut off
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, in this connection's thread, within the socket's timeout

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path.split("?", 1)[0] not in PATHS:
            self._answer(404, b"not found: the admin port serves /metrics\n", "text/plain; charset=utf-8")
            return
        view: Any = self.server.registry
        if isinstance(self.connection, ssl.SSLSocket):
            try:
                authorize_admin(peer_of_certificate(self.connection.getpeercert()))
            except PermissionDenied as exc:
                log.warning("admin_refused", peer=self.client_address[0], reason=str(exc))
                self._answer(403, f"{exc}\n".encode(), "text/plain; charset=utf-8")
                return
        else:
            view = public_view(self.server.registry)
        self._answer(200, generate_latest(view), CONTENT_TYPE_LATEST)

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        pass  # a scrape every few seconds is not news


class AdminServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, registry: CollectorRegistry, context: ssl.SSLContext | None,
                 timeout_s: float = TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.registry = registry
        self.context = context
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.connections = 0  # being served now
        # ``shutdown`` writes a byte here to wake ``serve_forever`` at once (the stdlib's loop polls for it twice a
        # second, so each shutdown waited up to 0.5 s)
        self._wake_read, self._wake_write = os.pipe()
        self._stopping = False
        self._stopped = threading.Event()
        super().__init__((host, port), _Handler, bind_and_activate=False)
        try:
            # port 0: a free one below the ephemeral range (kvpool.ports), so a restart can have it again
            ports.listen(host, port, lambda p: self._bind(host, p))
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

    def _bind(self, host: str, port: int) -> None:
        self.server_address = (host, port)
        self.server_bind()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept connections until ``shutdown``; ``poll_interval`` is unused (no polling: ``shutdown`` wakes it)."""
        self._stopped.clear()
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(self._wake_read, selectors.EVENT_READ)
                while not self._stopping:
                    ready = selector.select()
                    if self._stopping:
                        break
                    if any(key.fileobj is self for key, _ in ready):
                        self._handle_request_noblock()
                    self.service_actions()
        finally:
            if self._stopping:  # as the stdlib's: the shutdown is spent, a later serve_forever serves
                os.read(self._wake_read, 1)
                self._stopping = False
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop ``serve_forever`` and wait until it has (from another thread, as the stdlib's)."""
        self._stopping = True
        os.write(self._wake_write, b"\0")
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    def get_request(self) -> tuple[Any, Any]:
        sock, address = self.socket.accept()
        sock.settimeout(self.timeout_s)
        if self.context is not None:  # the handshake waits for the connection's own thread (_Handler.setup)
            sock = self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if not self._slots.acquire(blocking=False):
            return False  # past the bound: closed at once
        with self._lock:
            self.connections += 1
        return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            # the slot is free before the peer sees its connection close: a client that connects again at once
            # (the close told it the server is done with it) is served, not refused as past the bound
            with self._lock:
                self.connections -= 1
            self._slots.release()
            self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a failed handshake or a peer that went away: nothing to do but close


def start_admin(host: str, port: int, registry: CollectorRegistry, timeout_s: float = TIMEOUT_S,
                max_connections: int = MAX_CONNECTIONS) -> AdminServer:
    """Serve ``registry`` on ``host:port`` (module doc), TLS once ``kvpool.tls`` is configured."""
    server = AdminServer(host, port, registry, tls.server_ssl_context(), timeout_s, max_connections)
    threading.Thread(target=server.serve_forever, name="admin-http", daemon=True).start()
    return server
