"""Every retry in one place (``kvpool.core.admission.retry``): gRPC tries an idempotent call again when it did not
reach an answer, and only such a call; stage 0 plans a request again once, the way its failure says."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from kvpool import service
from kvpool.core.errors import DeviceCacheLost, RestoreFellShort, Unavailable
from kvpool.core.admission.retry import GRPC_RETRY, IDEMPOTENT, MAX_REPLANS, Replan, replan, service_config
from kvpool.rpc import decode_pb2, pool_pb2, prefill_pb2


def test_every_idempotent_call_is_a_real_method_and_the_config_names_each() -> None:
    methods = {f.full_name: {m.name for m in f.methods} for module in (decode_pb2, pool_pb2, prefill_pb2)
               for f in module.DESCRIPTOR.services_by_name.values()}
    for service_name, names in IDEMPOTENT.items():
        assert set(names) <= methods[service_name], service_name
    config = json.loads(service_config())
    named = {(n["service"], n["method"]) for c in config["methodConfig"] for n in c["name"]}
    assert named == {(s, m) for s, ms in IDEMPOTENT.items() for m in ms}
    assert config["methodConfig"][0]["retryPolicy"] == GRPC_RETRY
    assert "PutStart" not in IDEMPOTENT["kvpool.rpc.PoolMaster"]  # a put is never sent twice by gRPC


def test_stage_zero_plans_again_once_the_way_the_failure_says() -> None:
    assert replan(DeviceCacheLost("stage 1 restarted"), 0) is Replan.WITHOUT_DEVICE_HITS
    assert replan(RestoreFellShort("stage 2 read 1 of 3"), 0) is Replan.WITHOUT_POOL
    assert replan(RestoreFellShort("again"), MAX_REPLANS) is None
    assert replan(Unavailable("stage 3 is down"), 0) is None  # the router's to move, not stage 0's


async def _attempts(method: str, fail_first: int) -> tuple[int, grpc.StatusCode | None]:
    """Calls of ``method`` a server saw for one call made through ``service.channel``, the first
    ``fail_first`` of them answered UNAVAILABLE; and the call's failure code, if it failed."""
    seen = 0

    async def handler(request: bytes, context: Any) -> bytes:
        nonlocal seen
        seen += 1
        if seen <= fail_first:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return b""

    service_name, name = method.rsplit("/", 1)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        service_name, {name: grpc.unary_unary_rpc_method_handler(handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with service.channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(f"/{method}")
            try:
                await call(b"", timeout=10)
                return seen, None
            except grpc.aio.AioRpcError as exc:
                return seen, exc.code()
    finally:
        await server.stop(None)


@pytest.mark.parametrize(("method", "fail_first", "expected"), [
    ("kvpool.rpc.PoolMaster/Lookup", 1, (2, None)),  # idempotent: tried again, and answered
    ("kvpool.rpc.Decode/Landed", 2, (3, None)),
    ("kvpool.rpc.PoolMaster/Lookup", 5, (GRPC_RETRY["maxAttempts"], grpc.StatusCode.UNAVAILABLE)),  # then it fails
    ("kvpool.rpc.PoolMaster/PutStart", 1, (1, grpc.StatusCode.UNAVAILABLE)),  # not idempotent: never again
    ("kvpool.rpc.Decode/Serve", 1, (1, grpc.StatusCode.UNAVAILABLE)),
])
def test_grpc_tries_only_an_idempotent_call_again(method: str, fail_first: int,
                                                  expected: tuple[int, grpc.StatusCode | None]) -> None:
    assert asyncio.run(_attempts(method, fail_first)) == expected
