"""The router's HTTP/1.1 connection limits: how many may be open, and how long a request's head may take.

A connection is held, with a file descriptor, for as long as its client keeps it: one that opens and
sends nothing, or trickles header lines, would hold it for ever, and enough such clients take every
descriptor the router has (slowloris), and then nobody is served. So (``ConnectionLimits``, enforced by
the router's HTTP server, ``http_server.HttpServer``):

- a request's head (its request line and headers) must arrive whole within ``read_timeout_s`` of the
  connection opening or of the previous response ending, else the connection is closed: answered 408
  when part of a head came, silently when nothing did (as an idle keep-alive connection is closed: a
  client may be about to reuse it, and must not read a 408 as its next answer). The body has its own
  bound, from the head on (``http_api.read_body``);
- at most ``max_connections`` are open at once, and, where ``max_per_client`` is set, at most that many
  from one client address: one more is answered 429 with Retry-After, as any overload is
  (``openai_errors.api_error_of``), and closed before it holds anything. The per-address bound keeps one
  client from taking every place; it is off by default, because behind a proxy every client shares the
  proxy's address.

Both answers are OpenAI-shaped errors and counted in ``kvpool_router_http_refused_total{reason}``.
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


@dataclass(slots=True)
class ConnectionLimits:
    """The bounds on the router's HTTP connections (module doc), and the connections open against them.

    Invariant: ``num_open`` is the number of connections admitted and not yet released, at most
    ``max_connections``; where ``max_per_client`` is set, ``per_client[address]`` is the number of those
    from ``address``, at most ``max_per_client``, and an address with none open has no entry.
    ``refused(reason)`` counts each connection turned away or timed out; ``open_now(count)`` is told
    ``num_open`` at each change.
    """

    read_timeout_s: float = 30.0
    max_connections: int = 4096
    max_per_client: int = 0  # 0: no per-address bound
    refused: Callable[[str], None] = _ignore
    open_now: Callable[[int], None] = _ignore
    num_open: int = 0
    per_client: dict[str, int] = field(default_factory=dict)

    def admit(self, client: str | None) -> bytes | None:
        """Count a new connection from address ``client`` as open and return None, or, when it would pass
        a bound, count it refused and return the whole 429 response to send it before closing it."""
        if self.num_open >= self.max_connections:
            return self._refuse(f"the router has {self.max_connections} connections open, its most "
                                "(--http-max-connections)", TOO_MANY_CONNECTIONS)
        if self.max_per_client and client is not None:
            if self.per_client.get(client, 0) >= self.max_per_client:
                return self._refuse(f"{client} has {self.max_per_client} connections open, the most one "
                                    "client may (--http-max-connections-per-client)", TOO_MANY_FROM_CLIENT)
            self.per_client[client] = self.per_client.get(client, 0) + 1
        self.num_open += 1
        self.open_now(self.num_open)
        return None

    def release(self, client: str | None) -> None:
        """A connection ``admit`` let in has closed."""
        if self.max_per_client and client is not None:
            left = self.per_client[client] - 1
            if left:
                self.per_client[client] = left
            else:
                del self.per_client[client]
        self.num_open -= 1
        self.open_now(self.num_open)

    def head_timed_out(self) -> bytes:
        """Count a head that came too late; the 408 to send when part of it came."""
        self.refused(HEAD_TIMEOUT)
        return raw_response(ApiError(
            408, f"the request's head did not arrive within {self.read_timeout_s:g} s (--http-read-timeout-s)",
            None, "request_timeout"), "Request Timeout")

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
