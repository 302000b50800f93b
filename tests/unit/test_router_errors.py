"""The router's mapping of a backend's failure to the client's error: no internal address, ever.

``Router._backend_error`` is the one place both APIs' backend failures pass (the HTTP 503 body and
gRPC Generate's status both carry its message); channels are made but never dialled here.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc.aio import AioRpcError, Metadata

from kvpool.core.errors import ResourceExhausted, Unavailable
from kvpool.status import FIELD_KEY
from kvpool.services.router.metrics import RouterMetrics
from kvpool.services.router.openai_errors import api_error_of
from kvpool.services.router.router import Router

PIPELINES = ["127.0.0.1:45937", "127.0.0.1:45941"]
SHARDS = ["127.0.0.1:46001"]


def _mapped(code: grpc.StatusCode, details: str, kind: str, name: str,
            trailing: tuple[tuple[str, str], ...] = ()) -> Exception:
    async def run() -> Exception:
        router = Router(PIPELINES, SHARDS, RouterMetrics())
        try:
            return router._backend_error(AioRpcError(code, Metadata(), Metadata(*trailing), details),
                                         kind, name, "req-1")
        finally:
            await router.close()
    return asyncio.run(run())


def test_a_failed_pipeline_is_named_by_its_index() -> None:
    error = _mapped(grpc.StatusCode.UNAVAILABLE,
                    "stage 1: DEADLINE_EXCEEDED: writing to decode at 127.0.0.1:46002 failed",
                    "prefill pipeline", PIPELINES[1], ((FIELD_KEY, "target"),))
    assert isinstance(error, Unavailable)
    assert str(error) == ("prefill pipeline 1: UNAVAILABLE: stage 1: DEADLINE_EXCEEDED: "
                          "writing to decode at <address> failed")
    assert error.field == "target"  # the router still blames the decode side for its retry
    body = api_error_of(error).body()
    assert "127.0.0.1" not in str(body) and body["error"]["code"] == "unavailable"


def test_an_unreachable_shard_and_a_passed_on_refusal_carry_no_address() -> None:
    lost = _mapped(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                   "ipv4:127.0.0.1:46001: Failed to connect to remote host: Connection refused",
                   "decode shard", SHARDS[0])
    assert str(lost) == ("decode shard 0: UNAVAILABLE: failed to connect to all addresses; last error: "
                         "UNKNOWN: <address>: Failed to connect to remote host: Connection refused")
    refused = _mapped(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode 127.0.0.1:46001: no free pages",
                      "decode shard", SHARDS[0])
    assert isinstance(refused, ResourceExhausted) and str(refused) == "decode <address>: no free pages"
