"""Traces cover every call kind: one span per served call with its kind, its awaited answers and its messages,
and every kind of call a handler makes names the handler's span as its parent, under one trace id; the file
exporter writes each as one line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from kvpool.tracing import (
    REQUEST_ID_KEY,
    TraceServerInterceptor,
    carried_metadata,
    carry_interceptors,
    detached,
    tracer,
)

SERVICE = "/trace.Test/"
METADATA = ((REQUEST_ID_KEY, "req-1"),)


def _identity(data: bytes) -> bytes:
    return data


async def _exercise(path: Path) -> None:
    server = grpc.aio.server(interceptors=[TraceServerInterceptor(tracer(str(path)))])
    port = server.add_insecure_port("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=carry_interceptors())

    def stub(kind: str, name: str) -> Any:
        return getattr(channel, kind)(SERVICE + name, request_serializer=_identity, response_deserializer=_identity)

    async def leaf(request: bytes, context: Any) -> bytes:
        return request

    async def nested(kind: str) -> None:  # every kind of call, made while serving: each names its caller
        await stub("unary_unary", "Leaf")(b"from-" + kind.encode(), metadata=METADATA)

    async def unary_unary(request: bytes, context: Any) -> bytes:
        await nested("uu")
        return request

    async def unary_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        await nested("us")
        for _ in range(3):
            yield request

    async def stream_unary(requests: AsyncIterator[bytes], context: Any) -> bytes:
        received = [r async for r in requests]
        await nested("su")
        return b"".join(received)

    async def stream_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        await nested("ss")
        async for request in requests:
            yield request

    handlers = {
        "Leaf": grpc.unary_unary_rpc_method_handler(leaf, _identity, _identity),
        "UU": grpc.unary_unary_rpc_method_handler(unary_unary, _identity, _identity),
        "US": grpc.unary_stream_rpc_method_handler(unary_stream, _identity, _identity),
        "SU": grpc.stream_unary_rpc_method_handler(stream_unary, _identity, _identity),
        "SS": grpc.stream_stream_rpc_method_handler(stream_stream, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("trace.Test", handlers),))
    await server.start()
    try:
        assert await stub("unary_unary", "UU")(b"a", metadata=METADATA) == b"a"
        assert [r async for r in stub("unary_stream", "US")(b"b", metadata=METADATA)] == [b"b"] * 3

        async def three() -> AsyncIterator[bytes]:
            for piece in (b"c", b"d", b"e"):
                yield piece
        # a call that streams its requests carries its metadata from the start, not through an interceptor
        assert await stub("stream_unary", "SU")(three(), metadata=(*METADATA, *carried_metadata())) == b"cde"
        call = stub("stream_stream", "SS")(metadata=(*METADATA, *carried_metadata()))
        for message in (b"f", b"g"):  # each write awaits its answer: two round trips
            await call.write(message)
            assert await call.read() == message
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        await stub("unary_unary", "Leaf")(b"untraced")  # no request id: no line
    finally:
        await channel.close()
        await server.stop(None)


def test_every_call_kind_is_traced_with_its_parent(tmp_path: Path, monkeypatch: Any) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVPOOL_RPC_TRACE", str(path))  # the channel's interceptors carry spans only then
    asyncio.run(_exercise(path))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    calls = {c["method"].removeprefix(SERVICE): c for c in lines if not c["method"].endswith("Leaf")}
    leaves = [c for c in lines if c["method"].endswith("Leaf")]
    assert sorted(calls) == ["SS", "SU", "US", "UU"]
    assert {c["request_id"] for c in lines} == {"req-1"}
    assert {name: c["kind"] for name, c in calls.items()} == {
        "UU": "unary_unary", "US": "unary_stream", "SU": "stream_unary", "SS": "stream_stream"}
    assert {name: (c["messages_in"], c["messages_out"], len(c["answers"])) for name, c in calls.items()} == {
        "UU": (1, 1, 1), "US": (1, 3, 1), "SU": (3, 1, 1), "SS": (2, 2, 2)}
    assert all(0 < c["sent"] <= c["start"] <= c["end"] == c["answers"][0] for c in lines)
    # each handler's nested call names that handler's span as its parent; the top calls have none
    assert sorted(leaf["parent"] for leaf in leaves) == sorted(c["span"] for c in calls.values())
    assert all(c["parent"] == "" for c in calls.values())


def test_calls_from_a_task_nobody_waits_for_are_detached_down_the_tree(tmp_path: Path, monkeypatch: Any) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVPOOL_RPC_TRACE", str(path))

    async def exercise() -> None:
        server = grpc.aio.server(interceptors=[TraceServerInterceptor(tracer(str(path)))])
        port = server.add_insecure_port("127.0.0.1:0")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=carry_interceptors())

        def stub(name: str) -> Any:
            return channel.unary_unary(SERVICE + name, request_serializer=_identity, response_deserializer=_identity)

        async def leaf(request: bytes, context: Any) -> bytes:
            return request

        async def middle(request: bytes, context: Any) -> bytes:  # served detached: its own call is too
            return await stub("Leaf")(request, metadata=METADATA)

        async def outer(request: bytes, context: Any) -> bytes:
            await stub("Leaf")(b"awaited", metadata=METADATA)
            async def release() -> bytes:  # a coroutine: its call is made inside the detached task
                return await stub("Middle")(b"released", metadata=METADATA)

            return await detached(release())  # awaited only so the test can read the trace

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("trace.Test", {
            name: grpc.unary_unary_rpc_method_handler(fn, _identity, _identity)
            for name, fn in (("Leaf", leaf), ("Middle", middle), ("Outer", outer))}),))
        await server.start()
        try:
            assert await stub("Outer")(b"go", metadata=METADATA) == b"released"
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(exercise())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_span = {c["span"]: c for c in lines}
    outer = next(c for c in lines if c["method"].endswith("Outer"))
    middle = next(c for c in lines if c["method"].endswith("Middle"))
    leaves = [c for c in lines if c["method"].endswith("Leaf")]
    assert not outer.get("detached") and middle["detached"] is True and middle["parent"] == outer["span"]
    assert {by_span[c["parent"]]["method"].removeprefix(SERVICE): bool(c.get("detached")) for c in leaves} == {
        "Outer": False, "Middle": True}


def test_a_call_tree_is_one_trace_and_separate_calls_are_separate_traces(tmp_path: Path, monkeypatch: Any) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVPOOL_RPC_TRACE", str(path))
    asyncio.run(_exercise(path))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_span = {c["span"]: c for c in lines}
    for leaf in (c for c in lines if c["parent"]):  # a nested call shares its caller's trace (W3C traceparent)
        assert leaf["trace_id"] == by_span[leaf["parent"]]["trace_id"]
    tops = [c for c in lines if not c["parent"]]
    assert len({c["trace_id"] for c in tops}) == len(tops) == 4  # each top call began a trace of its own


def test_a_log_line_names_the_trace_of_the_span_current_where_it_is_written(tmp_path: Path) -> None:
    from kvpool.tracing import add_trace_id

    assert "trace_id" not in add_trace_id(None, "info", {"event": "x"})  # no span: nothing added
    traced = tracer(str(tmp_path / "t.jsonl"))
    assert traced is not None
    with traced.start_as_current_span("work") as span:
        line = add_trace_id(None, "info", {"event": "x"})
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")


def test_the_request_id_rides_the_w3c_tracestate(tmp_path: Path, monkeypatch: Any) -> None:
    """With no x-request-id header at all, the callee still knows the request: the caller's tracestate names it
    (``kvpool=<id>``), after any other vendor's entries it had, which it keeps."""
    from kvpool.request_id import bound_request_id
    from kvpool.tracing import request_id_in, trace_context

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVPOOL_RPC_TRACE", str(path))
    seen: list[tuple[str, str]] = []

    async def exercise() -> None:
        server = grpc.aio.server(interceptors=[TraceServerInterceptor(tracer(str(path)))])
        port = server.add_insecure_port("127.0.0.1:0")

        async def leaf(request: bytes, context: Any) -> bytes:
            seen.extend((k, v) for k, v in context.invocation_metadata() if k in ("tracestate", "x-request-id"))
            return request

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "trace.Test", {"Leaf": grpc.unary_unary_rpc_method_handler(leaf, _identity, _identity)}),))
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=carry_interceptors())
        try:
            with bound_request_id("req-state.1"):
                await channel.unary_unary(SERVICE + "Leaf", request_serializer=_identity,
                                          response_deserializer=_identity)(b"x")
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(exercise())
    assert seen == [("tracestate", "kvpool=req-state.1")]
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["request_id"] == "req-state.1"
    assert request_id_in("other=1, kvpool=req-2") == "req-2" and request_id_in("other=1") == ""
    with bound_request_id("r"):
        assert trace_context("req-3") == [("tracestate", "kvpool=req-3")]  # no span: no traceparent


def test_a_callers_request_id_reaches_the_trace_only_when_it_is_sane(tmp_path: Path, monkeypatch: Any) -> None:
    """An id a caller sends (header or tracestate) is written into trace files only when ``is_sane`` says so:
    a long or odd one gives the span no id instead of carrying it."""
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVPOOL_RPC_TRACE", str(path))
    sent = [(REQUEST_ID_KEY, "req-ok.1"), (REQUEST_ID_KEY, "x" * 5000), (REQUEST_ID_KEY, "a b;c"),
            ("tracestate", "kvpool=" + "y" * 5000)]

    async def exercise() -> None:
        server = grpc.aio.server(interceptors=[TraceServerInterceptor(tracer(str(path)))])
        port = server.add_insecure_port("127.0.0.1:0")

        async def leaf(request: bytes, context: Any) -> bytes:
            return request

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "trace.Test", {"UU": grpc.unary_unary_rpc_method_handler(leaf, _identity, _identity)}),))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary(SERVICE + "UU", request_serializer=_identity,
                                           response_deserializer=_identity)
                for pair in sent:
                    assert await call(b"x", metadata=(pair,)) == b"x"
        finally:
            await server.stop(None)

    asyncio.run(exercise())
    ids = [json.loads(line)["request_id"] for line in path.read_text().splitlines()]
    assert ids == ["req-ok.1"]  # the odd ids leave the span unnamed, and an unnamed call to no entry method no line
