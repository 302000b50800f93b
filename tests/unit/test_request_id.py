"""The request id crosses gRPC hops as metadata and is bound on the server side.

Two real in-process gRPC servers from ``kvpool.service.create_server`` on
loopback: ``front`` answers with the request id bound in its handler, then
asks ``back`` (over a ``kvpool.service.channel``) for the id bound there; a
server-streaming method checks the same for streams. No processes are started.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import structlog

from kvpool import service
from kvpool.request_id import (
    METADATA_KEY,
    bound_request_id,
    current_request_id,
    from_metadata,
    is_sane,
    new_request_id,
)

SERVICE = "test.Echo"


def _identity(data: bytes) -> bytes:
    return data


def echo_handlers(back: str | None) -> grpc.GenericRpcHandler:
    async def whoami(request: bytes, context: Any) -> bytes:
        seen = {"here": current_request_id(), "log": structlog.contextvars.get_contextvars().get("request_id", "")}
        if back is not None:
            async with service.channel(back) as channel:
                call = channel.unary_unary(f"/{SERVICE}/WhoAmI", request_serializer=_identity,
                                           response_deserializer=_identity)
                seen["back"] = json.loads(await call(b"", timeout=10))["here"]
        return json.dumps(seen).encode()

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for _ in range(2):
            yield current_request_id().encode()

    return grpc.method_handlers_generic_handler(SERVICE, {
        "WhoAmI": grpc.unary_unary_rpc_method_handler(whoami, request_deserializer=_identity,
                                                      response_serializer=_identity),
        "Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=_identity,
                                                       response_serializer=_identity),
    })


@pytest.fixture
async def front() -> AsyncIterator[str]:
    back = await service.create_server("127.0.0.1", 0, lambda s: s.add_generic_rpc_handlers([echo_handlers(None)]))
    back_address = f"127.0.0.1:{back.port}"
    front = await service.create_server(
        "127.0.0.1", 0, lambda s: s.add_generic_rpc_handlers([echo_handlers(back_address)]))
    try:
        yield f"127.0.0.1:{front.port}"
    finally:
        await front.server.stop(None)
        await back.server.stop(None)


async def whoami(address: str, metadata: tuple[tuple[str, str], ...] | None = None) -> dict[str, str]:
    async with service.channel(address) as channel:
        call = channel.unary_unary(f"/{SERVICE}/WhoAmI", request_serializer=_identity, response_deserializer=_identity)
        return dict(json.loads(await call(b"", timeout=10, metadata=metadata)))


async def test_a_bound_id_reaches_every_hop_and_every_log_line(front: str) -> None:
    with bound_request_id("cmpl-abc123"):
        seen = await whoami(front)
    assert seen == {"here": "cmpl-abc123", "log": "cmpl-abc123", "back": "cmpl-abc123"}
    assert current_request_id() == ""  # unbound after the block


async def test_without_an_id_nothing_is_bound_anywhere(front: str) -> None:
    assert await whoami(front) == {"here": "", "log": "", "back": ""}


async def test_an_insane_inbound_id_is_ignored(front: str) -> None:
    seen = await whoami(front, metadata=((METADATA_KEY, "a b/c"),))
    assert seen == {"here": "", "log": "", "back": ""}
    seen = await whoami(front, metadata=((METADATA_KEY, "x" * 129),))
    assert seen == {"here": "", "log": "", "back": ""}
    seen = await whoami(front, metadata=((METADATA_KEY, "client-7.a:b_c"),))
    assert seen == {"here": "client-7.a:b_c", "log": "client-7.a:b_c", "back": "client-7.a:b_c"}


async def test_streams_are_bound_too(front: str) -> None:
    async with service.channel(front) as channel:
        call = channel.unary_stream(f"/{SERVICE}/Stream", request_serializer=_identity,
                                    response_deserializer=_identity)
        with bound_request_id("req-s1"):
            got = [r async for r in call(b"", timeout=10)]
    assert got == [b"req-s1", b"req-s1"]


def test_ids_are_fresh_and_sane() -> None:
    ids = {new_request_id("cmpl") for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("cmpl-") and len(i) == 5 + 32 and is_sane(i) for i in ids)
    assert [is_sane(s) for s in ("", "a", "x" * 128, "x" * 129, "a/b", "é", "a\nb")] == [
        False, True, True, False, False, False, False]
    assert from_metadata([("other", "a"), (METADATA_KEY, "bad id"), (METADATA_KEY, "good")]) == "good"
    assert from_metadata(None) == ""
