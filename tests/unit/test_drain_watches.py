"""A drain waits for calls in flight, not for subscriptions (``create_server(watches=...)``): a real gRPC
server in this process, a server stream that never ends on its own, once named a watch and once not."""

from __future__ import annotations

import asyncio

import grpc

from kvpool import service

METHOD = "/kvpool.test.Watch/Follow"


def add_watch(server: grpc.aio.Server) -> None:
    async def follow(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        yield b"now"
        await asyncio.Event().wait()  # as a subscription: until its caller goes

    handler = grpc.unary_stream_rpc_method_handler(follow)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kvpool.test.Watch", {"Follow": handler})])


async def calls_left_with_a_watch_open(watches: list[str]) -> tuple[int, int]:
    handle = await service.create_server("127.0.0.1", 0, add_watch, watches=watches)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            call = channel.unary_stream(METHOD)(b"")
            assert await call.read() == b"now"
            counted = handle.in_flight.count
            left = await handle.drain(grace_s=1.0, quiet_s=0.0)
            call.cancel()
        return counted, left
    finally:
        await handle.server.stop(None)


async def test_a_watch_is_not_a_call_in_flight() -> None:
    assert await calls_left_with_a_watch_open([METHOD]) == (0, 0)


async def test_any_other_open_stream_is_waited_for_until_the_grace_ends() -> None:
    assert await calls_left_with_a_watch_open([]) == (1, 1)
