"""A call that streams its requests (``Session``, ``ForwardPieces``) over a kvpool channel: its peer may end it
before the writer is done (a stage killed mid-request, a master gone), and nothing is left behind then: no task
pending on its writes, no exception nobody retrieved (grpc.aio's pump of an intercepted call's writes is both,
so such calls carry their metadata from the start instead: ``kvpool.service.stream_metadata``). The request id
still rides along, and so, when tracing, do the send time and the trace context."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kvpool import service
from kvpool.request_id import METADATA_KEY, bound_request_id
from kvpool.tracing import SENT_KEY

SERVICE = "kvpool.test.Probe"


def _identity(data: bytes) -> bytes:
    return data


async def _ended_by_the_peer(calls: int) -> tuple[list[str], list[dict[str, str]]]:
    """``calls`` stream calls, each ended by its peer after its first message while the writer is still open;
    returns what the loop's exception handler was told, and each call's metadata as the peer saw it."""
    seen: list[dict[str, str]] = []

    async def pieces(requests: AsyncIterator[bytes], context: Any) -> bytes:
        seen.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        async for _ in requests:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gone mid-stream")
        return b""

    server = grpc.aio.server()
    handlers = {"Pieces": grpc.stream_unary_rpc_method_handler(pieces, _identity, _identity)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    told: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: told.append(context["message"]))
    channel = service.channel(f"127.0.0.1:{port}")
    try:
        start = channel.stream_unary(f"/{SERVICE}/Pieces", request_serializer=_identity,
                                     response_deserializer=_identity)
        for i in range(calls):
            with bound_request_id(f"req-{i}"):
                call = start(timeout=10, metadata=service.stream_metadata())
            await call.write(b"piece")
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call  # the peer ends it; the writer never said it was done
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            del call
        gc.collect()
        await asyncio.sleep(0.1)  # what a collected task reports goes through the loop
        gc.collect()
        await asyncio.sleep(0.1)
    finally:
        await channel.close()
        await server.stop(None)
    return told, seen


def test_a_stream_call_its_peer_ends_early_leaves_nothing_pending() -> None:
    told, seen = asyncio.run(_ended_by_the_peer(10))
    assert told == []
    assert [m.get(METADATA_KEY) for m in seen] == [f"req-{i}" for i in range(10)]
    assert all(SENT_KEY not in m for m in seen)  # (not tracing: nothing more rides)


def test_a_stream_call_carries_the_send_time_when_tracing(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_RPC_TRACE", str(tmp_path / "trace.jsonl"))
    told, seen = asyncio.run(_ended_by_the_peer(2))
    assert told == []
    assert [m.get(METADATA_KEY) for m in seen] == ["req-0", "req-1"]
    assert all(float(m[SENT_KEY]) > 0 for m in seen)
