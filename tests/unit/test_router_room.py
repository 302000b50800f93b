"""The router's side of a shard's room with shards of this version and of the last one: the Serve stream's
``reserved`` message (an older shard sends its prefill's answer first), and a shard without ``WatchRoom``
(a real gRPC server that does not implement it), which admission then asks again after its own releases and
each health round."""

from __future__ import annotations

import asyncio

import grpc

from kvpool.core.admission.admission import AdmissionRequest, ShardShape
from kvpool.rpc import decode_pb2, decode_pb2_grpc, prefill_pb2
from kvpool.services.router.backend_clients import ServeStream
from kvpool.services.router.metrics import RouterMetrics
from kvpool.services.router.router import Router

SHAPE = ShardShape(num_pages=100, page_size=16, arena_bytes=1_000_000, region_bytes_per_token=4000,
                   region_trailer_bytes=4096, max_context=4096)


class Replies:
    """A call's messages as grpc.aio's read() gives them."""

    def __init__(self, *messages: decode_pb2.ServeResponse) -> None:
        self._messages = list(messages)

    async def read(self) -> object:
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> None:
        pass


def prefilled(device_tokens: int) -> decode_pb2.ServeResponse:
    return decode_pb2.ServeResponse(prefilled=prefill_pb2.PrefillResponse(
        figures=prefill_pb2.PrefillFigures(num_device_tokens=device_tokens)))


def test_the_serve_stream_reads_reserved_first_and_an_older_shards_prefill_answer_in_its_place() -> None:
    async def read(*messages: decode_pb2.ServeResponse) -> tuple[int, list[int], str]:
        stream = ServeStream(Replies(*messages))
        await stream.reserved()
        figures = await stream.prefilled()
        tokens = [token async for token in stream]
        return figures.device_tokens, tokens, stream.finish_reason

    end = decode_pb2.ServeResponse(figures=decode_pb2.DecodeFigures(finish_reason="stop"))
    reserved = decode_pb2.ServeResponse(reserved=decode_pb2.Reserved(room_epoch=3))
    token = decode_pb2.ServeResponse(token_id=7)
    assert asyncio.run(read(reserved, prefilled(256), token, end)) == (256, [7], "stop")
    assert asyncio.run(read(prefilled(256), token, end)) == (256, [7], "stop")  # an older shard


def test_a_shard_without_watch_room_is_asked_again_after_each_health_round() -> None:
    async def scenario() -> tuple[bool, bool, bool, float]:
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(decode_pb2_grpc.DecodeServicer(), server)  # nothing served
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        shard = f"127.0.0.1:{port}"
        router = Router(["127.0.0.1:1"], [shard], RouterMetrics())
        try:
            admission = router.admission
            admission.set_shard_shape(shard, SHAPE)
            admission.set_pipeline_shape("127.0.0.1:1", 64, 16)
            request = AdmissionRequest("r", "", 100, 60)
            assert admission.admit(request, 0.0) is not None
            admission.refused(request, None, 0.0)  # the shard had no room
            full_before = admission.shards[shard].full
            client = router.backends.shards[shard]
            watch = asyncio.ensure_future(router.backends._watch_room(client))
            for _ in range(100):
                if client.told_no_watch:
                    break
                await asyncio.sleep(0.02)
            watch.cancel()
            gauge = router.metrics.registry.get_sample_value("kvpool_router_room_watch", {"shard": shard})
            return full_before, admission.shards[shard].full, client.told_no_watch, gauge
        finally:
            await router.close()
            await server.stop(None)

    full_before, full_after, told, gauge = asyncio.run(scenario())
    # its stream is UNIMPLEMENTED: what it would have said is not coming, so it is asked again
    assert (full_before, full_after, told, gauge) == (True, False, True, 0.0)


def test_the_room_watch_rpc_is_the_routers_alone() -> None:
    from kvpool.core.tenancy.access import POLICY

    assert POLICY["/kvpool.rpc.Decode/WatchRoom"] == frozenset({"router"})
