"""Stage 0's health covers its whole pipeline.

A pipeline serves only while every stage does: the router asks stage 0 for the
service ``kvpool.rpc.Prefill`` (``PIPELINE_SERVICE``), and stage 0 answers it by
asking every later stage at that moment, in parallel, with a short deadline.
So a dead later stage takes the pipeline out of rotation at the router's next
health check, and a stage that comes back brings it back the same way. The
plain service name ("") stays this process's own health.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

PIPELINE_SERVICE = "kvpool.rpc.Prefill"
STAGE_CHECK_TIMEOUT_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PipelineHealthServicer(health.aio.HealthServicer):
    """The stock health service, plus a live answer for the whole pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self._later: Sequence[health_pb2_grpc.HealthStub] | None = None  # None: not connected yet

    def watch_stages(self, channels: Sequence[grpc.aio.Channel]) -> None:
        self._later = [health_pb2_grpc.HealthStub(c) for c in channels]

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        if request.service != PIPELINE_SERVICE:
            return await super().Check(request, context)
        own = await super().Check(health_pb2.HealthCheckRequest(service=""), context)
        if own.status != SERVING or self._later is None:
            return health_pb2.HealthCheckResponse(status=NOT_SERVING)
        answers = await asyncio.gather(*(self._stage_serving(stub) for stub in self._later))
        return health_pb2.HealthCheckResponse(status=SERVING if all(answers) else NOT_SERVING)

    @staticmethod
    async def _stage_serving(stub: health_pb2_grpc.HealthStub) -> bool:
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=STAGE_CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return response.status == SERVING
