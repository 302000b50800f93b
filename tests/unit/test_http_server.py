"""The router's HTTP/1.1 server (``http_server.HttpServer``) byte for byte: keep-alive, pipelining, bodies,
streaming, HEAD, 100-continue, disconnects, app failures, the head deadline, the connection bounds, stop."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from kvpool.services.router.http_connections import ConnectionLimits
from kvpool.services.router.http_server import HttpServer

Message = dict[str, Any]


class App:
    """A small ASGI app; what it saw is kept for the tests to check."""

    def __init__(self) -> None:
        self.disconnected = asyncio.Event()
        self.go_on = asyncio.Event()
        self.clients: list[tuple[str, int]] = []

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        path = scope["path"]
        self.clients.append(scope["client"])
        if path == "/fail":
            raise RuntimeError("the app failed")
        if path == "/unread":  # answers without reading the body
            await self.whole(send, b"unread")
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if path == "/stream":  # "a" then, once told to go on, "b"
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"a", "more_body": True})
            await self.go_on.wait()
            await send({"type": "http.response.body", "body": b"b", "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/until-disconnect":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            if (await receive())["type"] == "http.disconnect":
                self.disconnected.set()
        elif path == "/client":
            await self.whole(send, scope["client"][0].encode())
        else:
            await self.whole(send, scope["method"].encode() + b" " + body)

    @staticmethod
    async def whole(send: Any, body: bytes) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def serving(app: App, keep_alive_s: float = 5.0, **limits: Any) -> AsyncIterator[tuple[int, HttpServer]]:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    server = HttpServer(app, ConnectionLimits(**limits), keep_alive_s=keep_alive_s)
    await server.start(sock)
    try:
        yield sock.getsockname()[1], server
    finally:
        await server.stop(grace_s=1.0)
        sock.close()


async def connect(port: int, client: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(client, 0))


async def exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it."""
    reader, writer = await connect(port)
    writer.write(data)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return undated(answer)


def undated(response: bytes) -> bytes:
    return re.sub(rb"date: [^\r]+ GMT\r\n", b"date: D\r\n", response)


def ok(body: bytes, close: bool = False) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ndate: D\r\ncontent-length: %d\r\n" % len(body)
            + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body)


async def test_requests_on_one_connection_are_answered_in_order_until_the_client_says_close() -> None:
    async with serving(App()) as (port, _):
        answer = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
                                      b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"
                                      b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                      b"Connection: close\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n")
    assert answer == ok(b"POST hi") + ok(b"GET ") + ok(b"POST abc", close=True)


async def test_keep_alive_requests_sent_one_after_the_others_answer_are_all_served() -> None:
    # each request goes only once the previous answer came, as a client pool does: the next head's read
    # starts while the last body's watch is being cancelled, and must wait for it to end
    async with serving(App()) as (port, _):
        reader, writer = await connect(port)
        for i in range(50):
            body = b"%02d" % i
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n" + body)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            answer = head + await asyncio.wait_for(reader.readexactly(len(b"POST 00")), 10)
            assert undated(answer) == ok(b"POST " + body)
        writer.close()


async def test_a_stream_reaches_the_client_part_by_part() -> None:
    app = App()
    async with serving(app) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = b"HTTP/1.1 200 OK\r\ndate: D\r\ncontent-type: text/plain\r\nTransfer-Encoding: chunked\r\n" \
               b"Connection: close\r\n\r\n"
        first = head + b"1\r\na\r\n"
        seen = b""
        while len(undated(seen)) < len(first):  # "a" came before the app was told to go on
            seen += await asyncio.wait_for(reader.read(1024), 10)
        assert undated(seen) == first
        app.go_on.set()
        assert await asyncio.wait_for(reader.read(), 10) == b"1\r\nb\r\n0\r\n\r\n"
        writer.close()


async def test_head_has_the_headers_and_no_body() -> None:
    async with serving(App()) as (port, _):
        answer = await exchange(port, b"HEAD /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer == b"HTTP/1.1 200 OK\r\ndate: D\r\ncontent-length: 5\r\nConnection: close\r\n\r\n"


async def test_a_client_expecting_100_continue_gets_it_when_the_app_reads_the_body() -> None:
    async with serving(App()) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n"
                     b"Connection: close\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hi")
        assert undated(await asyncio.wait_for(reader.read(), 10)) == ok(b"POST hi", close=True)
        writer.close()


async def test_a_body_the_app_left_unread_is_dropped_and_the_connection_reused() -> None:
    async with serving(App()) as (port, _):
        answer = await exchange(port, b"POST /unread HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                                      b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer == ok(b"unread") + ok(b"GET ", close=True)


async def test_a_client_closing_its_end_is_a_disconnect_to_the_app() -> None:
    app = App()
    async with serving(app) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"GET /until-disconnect HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"1\r\nx\r\n"), 10)
        writer.close()
        await asyncio.wait_for(app.disconnected.wait(), 10)


async def test_a_failing_app_is_a_500_and_the_connection_closes() -> None:
    async with serving(App()) as (port, _):
        answer = await exchange(port, b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer == (b"HTTP/1.1 500 Internal Server Error\r\ndate: D\r\n"
                      b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n15\r\nInternal Server Error\r\n0\r\n\r\n")


async def test_an_invalid_head_is_a_400_in_openais_shape() -> None:
    async with serving(App()) as (port, _):
        answer = await exchange(port, b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n")
    assert b'"code":"invalid_request"' in answer


async def test_the_app_sees_the_clients_address() -> None:
    async with serving(App()) as (port, _):
        reader, writer = await connect(port, "127.0.0.3")
        writer.write(b"GET /client HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert undated(await asyncio.wait_for(reader.read(), 10)) == ok(b"127.0.0.3", close=True)
        writer.close()


async def test_a_silent_connection_is_closed_at_the_head_deadline_and_counted() -> None:
    refused: list[str] = []
    async with serving(App(), read_timeout_s=0.3, refused=refused.append) as (port, _):
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await exchange(port, b"") == b""
        assert 0.25 <= loop.time() - started < 5
    assert refused == ["head_timeout"]


async def test_a_head_trickled_past_the_deadline_gets_a_408() -> None:
    refused: list[str] = []
    async with serving(App(), read_timeout_s=0.3, refused=refused.append) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"GET / HTTP/1.1\r\n")
        for _ in range(10):  # a header line every 0.1 s: each came in time, the head never does
            await asyncio.sleep(0.1)
            writer.write(b"X-Slow: 1\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    body = (b'{"error":{"message":"the request\'s head did not arrive within 0.3 s (--http-read-timeout-s)",'
            b'"type":"invalid_request_error","param":null,"code":"request_timeout"}}')
    assert answer == (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                      b"content-length: %d\r\n\r\n" % len(body) + body)
    assert refused == ["head_timeout"]


async def test_an_idle_keep_alive_connection_is_closed_quietly_and_not_counted() -> None:
    refused: list[str] = []
    async with serving(App(), keep_alive_s=0.2, read_timeout_s=30, refused=refused.append) as (port, _):
        answer = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer == ok(b"GET ")
    assert refused == []


async def test_one_connection_past_the_bound_gets_a_429_and_closed_ones_free_their_places() -> None:
    refused: list[str] = []
    open_now: list[int] = []
    async with serving(App(), max_connections=2, refused=refused.append, open_now=open_now.append) as (port, _):
        held = [await connect(port, "127.0.0.2"), await connect(port, "127.0.0.3")]
        answer = await exchange(port, b"")
        body = (b'{"error":{"message":"the router has 2 connections open, its most (--http-max-connections)",'
                b'"type":"rate_limit_error","param":null,"code":"overloaded"}}')
        assert answer == (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
                          b"content-length: %d\r\nretry-after: 1\r\n\r\n" % len(body) + body)
        for _, writer in held:
            writer.close()
        while open_now[-1]:
            await asyncio.sleep(0.01)
        assert await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") == \
            ok(b"GET ", close=True)
    assert refused == ["connections"]
    assert open_now == [1, 2, 1, 0, 1, 0]


async def test_one_connection_past_a_clients_bound_gets_a_429_and_other_clients_are_served() -> None:
    refused: list[str] = []
    async with serving(App(), max_per_client=1, refused=refused.append) as (port, server):
        _, writer = await connect(port)
        answer = await exchange(port, b"")
        assert answer.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")
        assert b"127.0.0.1 has 1 connections open, the most one client may" in answer
        reader, other = await connect(port, "127.0.0.2")
        other.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert undated(await asyncio.wait_for(reader.read(), 10)) == ok(b"GET ", close=True)
        writer.close()
        while server.limits.per_client:  # an address with none open has no entry
            await asyncio.sleep(0.01)
    assert refused == ["client_connections"]


async def test_stop_closes_idle_connections_and_lets_a_request_in_flight_finish() -> None:
    app = App()
    async with serving(app) as (port, server):
        idle_reader, idle = await connect(port)
        idle.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert undated(await asyncio.wait_for(idle_reader.readuntil(b"GET "), 10)) == ok(b"GET ")
        reader, writer = await connect(port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"1\r\na\r\n"), 10)
        stopping = asyncio.ensure_future(server.stop(grace_s=10))
        assert await asyncio.wait_for(idle_reader.read(), 10) == b""  # closed at once
        app.go_on.set()
        assert await asyncio.wait_for(reader.read(), 10) == b"1\r\nb\r\n0\r\n\r\n"  # finished, then closed
        await asyncio.wait_for(stopping, 10)
        idle.close()
        writer.close()


async def test_an_answer_before_the_body_came_is_read_whole_then_the_connection_closes() -> None:
    async with serving(App()) as (port, _):
        answer = await exchange(port, b"POST /unread HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
                                      b"Connection: close\r\n\r\nabc")  # 3 of its 10 bytes
    assert answer == ok(b"unread", close=True)
