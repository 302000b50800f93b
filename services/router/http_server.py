"""The router's HTTP/1.1 server: one ASGI app over h11's protocol state machine, its connections bounded.

It is ours, a thin asyncio loop around h11 (sans-I/O), because the bounds of ``http_connections`` need
two hooks that no maintained ASGI server exposes in its public API: a say when a connection is accepted,
before it sends anything, and a timer that runs until a request's head is complete (an ASGI app, or a
middleware, only sees a request once its head is whole). HTTP only: no TLS, no upgrades, no lifespan.

Invariants, per connection (one task each, ``_Connection.run``):

- one request at a time (pipelined ones wait in h11's buffer); its head is read under the head deadline
  (``ConnectionLimits.read_timeout_s`` from the connection opening or the previous response ending; while
  nothing of it has come after a response, at most ``keep_alive_s``), its body only when the app calls
  ``receive`` (reading pauses while the app does not, so a client sending faster than the app reads is
  held back by TCP);
- once the body is read, a client closing its end is ``http.disconnect`` to ``receive``; what is sent
  after that is dropped; ``receive`` after the response is complete is ``http.disconnect`` at once;
- each body part is written and drained before ``send`` returns (a slow reader slows the app, and a
  streamed event reaches the client as it is sent); a HEAD response has no body;
- after a response the connection is reused unless either side said ``Connection: close``, the app failed
  or left its response unfinished, or the server is stopping; a body the app did not read is read and
  dropped first, under the next head's deadline;
- a 408, and a 400 or 431 for an invalid head, are sent, then the connection is half-closed and read
  (what comes dropped) for up to ``LINGER_S`` before it closes, so the client reads its answer instead
  of losing it to a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import socket
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import h11
import structlog

from kvpool.services.router.http_connections import ConnectionLimits, raw_response
from kvpool.services.router.openai_errors import ApiError

log = structlog.get_logger(__name__)

Message = dict[str, Any]
App = Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

READ_BYTES = 65536
# an idle connection between two requests is closed after this: longer than clients keep an idle pooled
# connection (httpx, and so the openai client: 5 s), so the client lets it go first. Equal timeouts race: the
# server closes as the client sends its next request on it, which then fails with no response
KEEP_ALIVE_S = 15.0
LISTEN_BACKLOG = 4096  # connections the kernel queues before the server accepts them (capped at somaxconn)
LINGER_S = 2.0
PIPELINED_BYTES = 65536  # what a client may send ahead of its response before reading it pauses
DISCONNECT: Message = {"type": "http.disconnect"}
AUTHENTICATED_EXTENSION = "kvpool.connection_authenticated"  # scope["extensions"]: call on a valid API key


class HttpServer:
    """Serves ``app`` on a listening socket with ``limits`` (module doc). ``start`` then ``stop``; the
    caller's signal handlers decide when."""

    def __init__(self, app: App, limits: ConnectionLimits, keep_alive_s: float = KEEP_ALIVE_S) -> None:
        self.app = app
        self.limits = limits
        self.keep_alive_s = keep_alive_s
        self._server: asyncio.Server | None = None
        self._connections: dict[int, _Connection] = {}  # by ConnectionLimits' id
        self._stopping = False

    async def start(self, sock: socket.socket) -> None:
        # asyncio listens again with its own backlog (100 unless told): a burst of connections past it waits
        # for SYN retries (1 s, then 3 s), so the queue is as deep as the kernel allows (somaxconn)
        self._server = await asyncio.start_server(self._accept, sock=sock, limit=READ_BYTES, backlog=LISTEN_BACKLOG)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting and close idle connections now; requests in flight get ``grace_s`` to finish (their
        connections close after them), then are cancelled."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections.values()):
            connection.shutdown()
        tasks = {connection.task for connection in self._connections.values() if connection.task is not None}
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # a plain function, so the connection's task is ours (start_server's own tasks cannot be cancelled
        # quietly on Python 3.11)
        peer = writer.get_extra_info("peername")
        client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None
        address = client[0] if client else None
        admission = b"" if self._stopping else self.limits.admit(address)
        if isinstance(admission, bytes):
            with contextlib.suppress(OSError):
                writer.write(admission)
            writer.close()
            return
        if admission.evicted is not None:  # idle: its task awaits a head, and ends at this cancel
            self._connections[admission.evicted].evict()
        local = writer.get_extra_info("sockname")
        server = (str(local[0]), int(local[1])) if isinstance(local, tuple) and len(local) >= 2 else None
        connection = _Connection(self, reader, writer, client, server, admission.connection_id)
        self._connections[connection.connection_id] = connection
        connection.task = asyncio.ensure_future(self._serve(connection))
        # released however the task ends, even cancelled before it ran
        connection.task.add_done_callback(lambda _: self._closed(connection))

    async def _serve(self, connection: _Connection) -> None:
        try:
            await connection.run()
        except Exception:
            log.exception("http_connection_failed")

    def _closed(self, connection: _Connection) -> None:
        self._connections.pop(connection.connection_id, None)
        self.limits.release(connection.connection_id)
        connection.writer.close()


class _Connection:
    """One client connection: its h11 state and its requests, one at a time (module doc)."""

    def __init__(self, server: HttpServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 client: tuple[str, int] | None, local: tuple[str, int] | None, connection_id: int) -> None:
        self.server = server
        self.connection_id = connection_id
        self.reader = reader
        self.writer = writer
        self.client = client
        self.local = local
        self.h11 = h11.Connection(h11.SERVER)
        self.task: asyncio.Future[None] | None = None
        self.idle = True  # awaiting a head: no request in flight
        self.closing = False  # the server is stopping: close after the request in flight

    def shutdown(self) -> None:
        self.closing = True
        if self.idle and self.task is not None:
            self.task.cancel()

    def evict(self) -> None:
        """Close this idle connection to make room for another (``ConnectionLimits.admit``)."""
        self.closing = True
        if self.task is not None:
            self.task.cancel()

    def authenticated(self) -> None:
        """A request on this connection carried a valid API key (the API gate says so)."""
        self.server.limits.authenticated(self.connection_id)

    async def run(self) -> None:
        after_response = False
        while not self.closing:
            request = await self._read_head(after_response)
            if request is None:
                return
            self.idle = False
            self.server.limits.busy(self.connection_id)
            cycle = _Cycle(self, request)
            try:
                await cycle.run(self.server.app)
            finally:
                await cycle.stop_watching()
            self.idle = True
            self.server.limits.idle(self.connection_id)
            if cycle.disconnected or self.h11.our_state is not h11.DONE:
                if not cycle.disconnected and self.h11.their_state is h11.SEND_BODY:
                    await self._answer_and_close(b"")  # answered before its body came: let it read the answer
                return
            if self.h11.their_state is h11.DONE:
                self.h11.start_next_cycle()
            after_response = True

    async def _read_head(self, after_response: bool) -> h11.Request | None:
        """The next request's head; None when the connection is to close (the client closed it, or its head
        was late or invalid: answered here)."""
        limits = self.server.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.read_timeout_s
        # after a response, the wait for its first byte is the (shorter) keep-alive one
        idle = after_response and self.server.keep_alive_s < limits.read_timeout_s
        try:
            async with asyncio.timeout_at(loop.time() + self.server.keep_alive_s if idle else deadline) as timer:
                while True:
                    event = self.h11.next_event()
                    if isinstance(event, h11.Request):
                        return event
                    if event is h11.PAUSED:  # the body the app left unread is all in: the next request
                        self.h11.start_next_cycle()
                    elif event is h11.NEED_DATA:
                        data = await self.reader.read(READ_BYTES)
                        if not data:
                            return None
                        self.h11.receive_data(data)
                        if idle:
                            idle = False
                            timer.reschedule(deadline)
                    elif isinstance(event, h11.ConnectionClosed):
                        return None
                    # else h11.Data or h11.EndOfMessage: the rest of a body the app did not read, dropped
        except TimeoutError:
            if not idle:
                answer = limits.head_timed_out()
                if self.h11.their_state is h11.IDLE and self.h11.trailing_data[0]:  # part of a head came
                    await self._answer_and_close(answer)
            return None
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            await self._answer_and_close(raw_response(ApiError(
                status, f"invalid HTTP request: {exc}", None, "invalid_request"), HTTPStatus(status).phrase))
            return None
        except OSError:
            return None

    async def _answer_and_close(self, answer: bytes) -> None:
        """Send ``answer``, half-close, and drop what the client still sends for up to ``LINGER_S``."""
        with contextlib.suppress(OSError, TimeoutError):
            self.writer.write(answer)
            if self.writer.can_write_eof():
                self.writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await self.reader.read(READ_BYTES):
                    pass


class _Cycle:
    """One request and its response: the ASGI scope, ``receive`` and ``send`` (module doc)."""

    def __init__(self, connection: _Connection, request: h11.Request) -> None:
        self.connection = connection
        self.h11 = connection.h11
        raw_path, _, query = request.target.partition(b"?")
        self.scope: Message = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("ascii"), "server": connection.local,
            "client": connection.client, "scheme": "http", "method": request.method.decode("ascii"),
            "root_path": "", "path": unquote(raw_path.decode("ascii")), "raw_path": raw_path, "query_string": query,
            "headers": list(request.headers), "state": {},
            # the API gate calls it on a valid key: the connection stops counting as unauthenticated
            "extensions": {AUTHENTICATED_EXTENSION: connection.authenticated},
        }
        self.head_only = request.method == b"HEAD"
        self.body_read = False
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.ended = asyncio.Event()  # set when the client is gone or the response is complete
        self.read_lock = asyncio.Lock()
        self.watcher: asyncio.Task[None] | None = None

    async def run(self, app: App) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except Exception:
            log.exception("http_app_failed", path=self.scope["path"])
            if not self.response_started:
                await self._internal_error()
            return  # a response left unfinished closes the connection (``_Connection.run``)
        if not self.response_started:
            log.error("http_app_no_response", path=self.scope["path"])
            await self._internal_error()
        elif not self.response_complete:
            log.error("http_app_response_unfinished", path=self.scope["path"])

    async def _internal_error(self) -> None:
        await self.send({"type": "http.response.start", "status": 500,
                         "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def receive(self) -> Message:
        if not self.body_read and not self.ended.is_set():
            async with self.read_lock:
                if not self.body_read and not self.ended.is_set():
                    return await self._read_body_part()
        await self.ended.wait()
        return DISCONNECT

    async def _read_body_part(self) -> Message:
        try:
            if self.h11.they_are_waiting_for_100_continue:
                await self._write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                          reason=b"Continue")))
            while True:
                event = self.h11.next_event()
                if isinstance(event, h11.Data):
                    return {"type": "http.request", "body": bytes(event.data), "more_body": True}
                if isinstance(event, h11.EndOfMessage):
                    self.body_read = True
                    self.watcher = asyncio.ensure_future(self._watch())
                    return {"type": "http.request", "body": b"", "more_body": False}
                if event is not h11.NEED_DATA:
                    break
                data = await self.connection.reader.read(READ_BYTES)
                if not data:
                    break
                self.h11.receive_data(data)
        except (h11.RemoteProtocolError, OSError):
            pass
        self._gone()
        return DISCONNECT

    async def _watch(self) -> None:
        """After the body: notice the client closing its end; keep what it pipelines, up to a bound."""
        buffered = 0
        try:
            while buffered < PIPELINED_BYTES:
                data = await self.connection.reader.read(READ_BYTES)
                if not data:
                    self._gone()
                    return
                self.h11.receive_data(data)
                buffered += len(data)
        except OSError:
            self._gone()

    async def stop_watching(self) -> None:
        """Cancel the watch and wait until it has ended: the next head's read must not start while the
        watch's read is still pending (a StreamReader takes one reader at a time)."""
        if self.watcher is not None:
            self.watcher.cancel()
            await asyncio.wait([self.watcher])  # our own cancellation still propagates

    def _gone(self) -> None:
        self.disconnected = True
        self.ended.set()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            self.response_started = True
            headers = [(b"date", email.utils.formatdate(usegmt=True).encode()), *message.get("headers", [])]
            if self.connection.closing:
                headers.append((b"connection", b"close"))
            status = message["status"]
            data = self.h11.send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))
        elif message["type"] == "http.response.body" and self.response_started and not self.response_complete:
            body = message.get("body", b"")
            data = self.h11.send(h11.Data(data=body)) if body and not self.head_only else b""
            if not message.get("more_body", False):
                data = (data or b"") + (self.h11.send(h11.EndOfMessage()) or b"")
                self.response_complete = True
                self.ended.set()
        else:
            raise RuntimeError(f"unexpected ASGI message {message['type']!r} at this point of the response")
        if data and not self.disconnected:
            try:
                await self._write(data)
            except OSError:
                self._gone()

    async def _write(self, data: bytes | None) -> None:
        if data:
            self.connection.writer.write(data)
            await self.connection.writer.drain()


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
