"""The router's HTTP/1.1 connection limits: how many may be open, from whom, and how long a request's head may take.

A connection is held, with a file descriptor, for as long as its client keeps it: one that opens and
sends nothing, or trickles header lines, would hold it for ever, and enough such clients take every
descriptor the router has (slowloris), and then nobody is served. So (``ConnectionLimits``, enforced by
the router's HTTP server, ``http_server.HttpServer``):

- a request's head (its request line and headers) must arrive whole within ``read_timeout_s`` of the
  connection opening or of the previous response ending, else the connection is closed: answered 408
  when part of a head came, silently when nothing did (as an idle keep-alive connection is closed: a
  client may be about to reuse it, and must not read a 408 as its next answer). The body has its own
  bound, from the head on (``http_api.read_body``);
- at most ``max_connections`` are open at once;
- a connection is *unauthenticated* until one of its requests carries a valid API key (without keys
  configured, every connection stays so). At most ``max_per_client`` unauthenticated connections are
  open from one client address (0: no such bound), and, with keys configured (``make_room``), at most
  ``max_unauthenticated`` (three quarters of ``max_connections``) in all, so keyless sockets can never
  hold every place;
- past a bound: with ``make_room``, the oldest *idle* unauthenticated connection (no request in flight)
  of the new one's address (per-address bound), or of the address holding the most (other bounds), is
  closed to make room, so a flooder churns only its own sockets and a keyed client from any address,
  its own included, still gets in; when none is idle, or without ``make_room``, the new connection is
  answered 429 with Retry-After, as any overload is (``openai_errors.api_error_of``), and closed before
  it holds anything.

Each refusal, eviction and timeout is counted in ``kvpool_router_http_refused_total{reason}``.
"""

from __future__ import annotations

import json
import resource
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from kvpool.services.router.openai_errors import ApiError

log = structlog.get_logger(__name__)

HEAD_TIMEOUT = "head_timeout"
TOO_MANY_CONNECTIONS = "connections"
TOO_MANY_FROM_CLIENT = "client_connections"
TOO_MANY_UNAUTHENTICATED = "unauthenticated_connections"
EVICTED = "evicted"
REFUSAL_REASONS = (TOO_MANY_CONNECTIONS, TOO_MANY_FROM_CLIENT, TOO_MANY_UNAUTHENTICATED, EVICTED, HEAD_TIMEOUT)
# descriptors the router needs beside its HTTP connections: its gRPC server and channels, the metrics port, logs
RESERVED_FILES = 256


def raw_response(error: ApiError, reason: str) -> bytes:
    """A whole HTTP/1.1 response carrying ``error``, for a connection that is closed after it."""
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    head = [f"HTTP/1.1 {error.status} {reason}", "content-type: application/json", "connection: close",
            f"content-length: {len(body)}", *(f"{k.lower()}: {v}" for k, v in error.headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _ignore(_: object) -> None:
    pass


@dataclass(frozen=True, slots=True)
class Admitted:
    """A connection let in as ``connection_id``; ``evicted``: the connection to close now to make room."""

    connection_id: int
    evicted: int | None = None


@dataclass(slots=True)
class ConnectionLimits:
    """The bounds on the router's HTTP connections (module doc), and the connections open against them.

    Invariants: ``num_open`` is the number of connections admitted and neither released nor evicted, at
    most ``max_connections``; ``per_client[address]`` holds the ids of the unauthenticated ones from
    ``address`` in the order they opened (oldest first), at most ``max_per_client`` where that is set, and
    an address with none has no entry; all of them together are at most ``max_unauthenticated``. Only a
    connection with no request in flight is ever evicted; once evicted it is no longer counted, and its
    later ``release`` does nothing. ``refused(reason)`` counts each connection turned away, evicted or
    timed out; ``open_now(count)`` is told ``num_open`` at each change.
    """

    read_timeout_s: float = 30.0
    max_connections: int = 4096
    # 0: no per-address bound. 256: a benchmark or agent fleet on one host keeps its connections without keys
    max_per_client: int = 256
    make_room: bool = False  # API keys are configured: evict idle unauthenticated connections past a bound
    refused: Callable[[str], None] = _ignore
    open_now: Callable[[int], None] = _ignore
    num_open: int = 0
    num_unauthenticated: int = 0
    per_client: dict[str, dict[int, None]] = field(default_factory=dict)
    _address_of: dict[int, str] = field(default_factory=dict)  # every open connection's address
    _busy: set[int] = field(default_factory=set)  # connections with a request in flight
    _last_id: int = 0

    @property
    def max_unauthenticated(self) -> int:
        return max(1, self.max_connections * 3 // 4) if self.make_room else self.max_connections

    def admit(self, client: str | None) -> Admitted | bytes:
        """Count a new (unauthenticated, idle) connection from address ``client`` as open, making room as the
        module doc says; or, when it would pass a bound, count it refused and return the whole 429 response to
        send it before closing it."""
        address = client or ""
        evicted = None
        unauthenticated_here = len(self.per_client.get(address, ()))
        if self.max_per_client and unauthenticated_here >= self.max_per_client:
            evicted = self._oldest_idle(address) if self.make_room else None
            if evicted is None:
                keyless = " without an API key" if self.make_room else ""
                return self._refuse(f"{address} has {self.max_per_client} connections open{keyless}, the most one "
                                    "client may (--http-max-connections-per-client)", TOO_MANY_FROM_CLIENT)
        elif self.num_unauthenticated >= self.max_unauthenticated or self.num_open >= self.max_connections:
            evicted = self._oldest_idle_of_the_most() if self.make_room else None
            if evicted is None:
                if self.num_open >= self.max_connections:
                    return self._refuse(f"the router has {self.max_connections} connections open, its most "
                                        "(--http-max-connections)", TOO_MANY_CONNECTIONS)
                return self._refuse(f"the router has {self.num_unauthenticated} connections open without an API "
                                    "key, its most for those (3/4 of --http-max-connections)", TOO_MANY_UNAUTHENTICATED)
        if evicted is not None:
            self._forget(evicted)
            self.refused(EVICTED)
        self._last_id += 1
        connection_id = self._last_id
        self._address_of[connection_id] = address
        self.per_client.setdefault(address, {})[connection_id] = None
        self.num_unauthenticated += 1
        self.num_open += 1
        self.open_now(self.num_open)
        return Admitted(connection_id, evicted)

    def authenticated(self, connection_id: int) -> None:
        """A request on this connection carried a valid API key: it no longer counts as unauthenticated."""
        address = self._address_of.get(connection_id)
        if address is not None and self._drop_unauthenticated(connection_id, address):
            self.num_unauthenticated -= 1

    def busy(self, connection_id: int) -> None:
        """A request's head came: the connection is not evicted until ``idle``."""
        if connection_id in self._address_of:
            self._busy.add(connection_id)

    def idle(self, connection_id: int) -> None:
        """The request in flight has ended: the connection awaits its next head."""
        self._busy.discard(connection_id)

    def release(self, connection_id: int) -> None:
        """A connection ``admit`` let in has closed (nothing, when it was evicted)."""
        if connection_id in self._address_of:
            self._forget(connection_id)

    def head_timed_out(self) -> bytes:
        """Count a head that came too late; the 408 to send when part of it came."""
        self.refused(HEAD_TIMEOUT)
        return raw_response(ApiError(
            408, f"the request's head did not arrive within {self.read_timeout_s:g} s (--http-read-timeout-s)",
            None, "request_timeout"), "Request Timeout")

    def _forget(self, connection_id: int) -> None:
        address = self._address_of.pop(connection_id)
        self._busy.discard(connection_id)
        if self._drop_unauthenticated(connection_id, address):
            self.num_unauthenticated -= 1
        self.num_open -= 1
        self.open_now(self.num_open)

    def _drop_unauthenticated(self, connection_id: int, address: str) -> bool:
        ids = self.per_client.get(address)
        if ids is None or connection_id not in ids:
            return False
        del ids[connection_id]
        if not ids:
            del self.per_client[address]
        return True

    def _oldest_idle(self, address: str) -> int | None:
        return next((c for c in self.per_client.get(address, ()) if c not in self._busy), None)

    def _oldest_idle_of_the_most(self) -> int | None:
        """The oldest idle unauthenticated connection of the address holding the most such (then the next)."""
        for address in sorted(self.per_client, key=lambda a: len(self.per_client[a]), reverse=True):
            found = self._oldest_idle(address)
            if found is not None:
                return found
        return None

    def _refuse(self, message: str, reason: str) -> bytes:
        self.refused(reason)
        return raw_response(ApiError(429, message, None, "overloaded", "rate_limit_error", {"Retry-After": "1"}),
                            "Too Many Requests")


def open_files_limit(soft: int, hard: int, max_connections: int) -> int:
    """The soft open-file limit that fits ``max_connections`` and what the router needs beside them, as far
    as the hard limit lets it (never lower than ``soft``)."""
    wanted = max_connections + RESERVED_FILES
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    return wanted if hard == resource.RLIM_INFINITY else max(soft, min(wanted, hard))


def ensure_open_files(max_connections: int) -> int:
    """Raise this process's soft open-file limit (``open_files_limit``), so the connection bound, not the
    descriptors, is what turns clients away; warn when the hard limit is too low. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = open_files_limit(soft, hard, max_connections)
    if limit != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    wanted = max_connections + RESERVED_FILES
    if limit != resource.RLIM_INFINITY and limit < wanted:
        log.warning("open_file_limit_low", limit=limit, needed=wanted, http_max_connections=max_connections,
                    fix="raise the hard limit (LimitNOFILE=) or lower --http-max-connections")
    return limit
