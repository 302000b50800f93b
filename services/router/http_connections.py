"""The router's HTTP/1.1 connections: uvicorn's h11 protocol with the two limits it lacks.

uvicorn times a connection out only while it idles between two requests, and only until the next
request's first byte: a client that opens a connection and sends nothing, or trickles header lines,
holds it, and a file descriptor, for ever; enough such clients take every descriptor the router
has (slowloris), and then nobody is served. So:

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

import asyncio
import json
import resource
from collections.abc import Callable
from typing import Any

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpool.services.router.openai_errors import ApiError

log = structlog.get_logger(__name__)

HEAD_TIMEOUT = "head_timeout"
TOO_MANY_CONNECTIONS = "connections"
TOO_MANY_FROM_CLIENT = "client_connections"
# descriptors the router needs beside its HTTP connections: its gRPC server and channels, the metrics port, logs
RESERVED_FILES = 256
# after a 408 the client may still be sending: the connection is half-closed and read (and what comes dropped)
# this long before it closes, so the client reads its answer instead of losing it to a reset
LINGER_S = 2.0


def raw_response(error: ApiError, reason: str) -> bytes:
    """A whole HTTP/1.1 response carrying ``error``, for a connection that is closed after it."""
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    head = [f"HTTP/1.1 {error.status} {reason}", "content-type: application/json", "connection: close",
            f"content-length: {len(body)}", *(f"{k.lower()}: {v}" for k, v in error.headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, its connections bounded in number and in how long a head may take
    (module doc). ``guarded`` makes a subclass with the limits set."""

    read_timeout_s: float = 30.0
    max_connections: int = 4096
    max_per_client: int = 0  # 0: no per-address bound
    per_client: dict[str, int] = {}  # connections open by client address (``guarded`` gives each server its own)
    refused: Callable[[str], None] = staticmethod(lambda reason: None)
    open_now: Callable[[int], None] = staticmethod(lambda count: None)  # told the open count at each change

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # a byte of the awaited head came
        self._turned_away = False
        self._lingering = False
        self._client: str | None = None  # the address counted in ``per_client``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._turn_away(transport, f"the router has {self.max_connections} connections open, its most "
                            "(--http-max-connections)", TOO_MANY_CONNECTIONS)
            return
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if self.max_per_client and client is not None:
            if self.per_client.get(client, 0) >= self.max_per_client:
                self._turn_away(transport, f"{client} has {self.max_per_client} connections open, the most one "
                                "client may (--http-max-connections-per-client)", TOO_MANY_FROM_CLIENT)
                return
            self.per_client[client] = self.per_client.get(client, 0) + 1
            self._client = client
        super().connection_made(transport)
        self.open_now(len(self.connections))
        self._arm()

    def _turn_away(self, transport: asyncio.Transport, message: str, reason: str) -> None:
        self._turned_away = True
        self.transport = transport
        transport.write(raw_response(ApiError(429, message, None, "overloaded", "rate_limit_error",
                                              {"Retry-After": "1"}), "Too Many Requests"))
        transport.close()
        self.refused(reason)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._client is not None:
            left = self.per_client[self._client] - 1
            if left:
                self.per_client[self._client] = left
            else:
                del self.per_client[self._client]
            self._client = None
        if not self._turned_away:
            super().connection_lost(exc)
            self.open_now(len(self.connections))

    def data_received(self, data: bytes) -> None:
        if self._turned_away or self._lingering:
            return
        self._head_started = True
        super().data_received(data)
        if self._awaiting_response():
            self._disarm()  # the head is in: the app reads the body under its own bound

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request at once
        if not self.transport.is_closing() and not self._awaiting_response():
            self._arm()

    def _awaiting_response(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._head_started = False
        self._head_timer = self.loop.call_later(self.read_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._awaiting_response():
            return
        if not self._head_started:
            self.transport.close()
        else:
            self.transport.write(raw_response(ApiError(
                408, f"the request's head did not arrive within {self.read_timeout_s:g} s (--http-read-timeout-s)",
                None, "request_timeout"), "Request Timeout"))
            self._lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        self.refused(HEAD_TIMEOUT)


def guarded(read_timeout_s: float, max_connections: int, refused: Callable[[str], None],
            open_now: Callable[[int], None], max_per_client: int = 0) -> type[GuardedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits; ``refused(reason)`` counts
    each connection turned away or timed out, ``open_now(count)`` follows the connections open."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "read_timeout_s": read_timeout_s, "max_connections": max_connections, "max_per_client": max_per_client,
        "per_client": {}, "refused": staticmethod(refused), "open_now": staticmethod(open_now)})


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
