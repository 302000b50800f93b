"""The router asks a pipeline's StageInfo again whenever its connection to stage 0 breaks.

A stage 0 restarted between two health rounds (a supervisor restarts one in well under the
router's interval) answers the next round as serving; without this the router would keep the
old process's device-cache size and admit against it. Real gRPC servers in this process stand
for "stage 0 before" and "stage 0 after" on one port: what is tested is the router's channel.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvpool.services.router.backend_clients import PIPELINE_HEALTH_SERVICE
from kvpool.services.router.metrics import RouterMetrics
from kvpool.services.router.router import Router
from tests.integration.conftest import eventually


async def serving_on(port: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    await health.set(PIPELINE_HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


def test_a_broken_connection_to_stage_0_makes_the_router_ask_stage_info_again() -> None:
    async def scenario() -> tuple[bool, int, bool]:
        before, port = await serving_on(0)
        address = f"127.0.0.1:{port}"
        router = Router([address], ["127.0.0.1:1"], RouterMetrics())
        client = router.backends.pipelines[address]
        try:
            await router.check_health()  # connects (this stand-in has no StageInfo: the round says down)
            await eventually(lambda: client.channel.get_state() is grpc.ChannelConnectivity.READY,
                             what="the router's channel to connect")
            client.stage_info_due = False  # as after a StageInfo answered
            await asyncio.sleep(0.2)  # a connected channel alone changes nothing
            quiet = client.stage_info_due

            await before.stop(grace=None)  # stage 0 dies ...
            after, _ = await serving_on(port)  # ... and a new one serves on its port
            try:
                await eventually(lambda: client.stage_info_due, what="the router to notice the broken connection")
                reconnects = client.num_reconnects
                await router.check_health()  # reconnects to the new process; StageInfo still due
                return quiet, reconnects, client.stage_info_due
            finally:
                await after.stop(grace=None)
        finally:
            await router.close()

    quiet, reconnects, still_due = asyncio.run(scenario())
    assert quiet is False
    assert reconnects == 1
    assert still_due is True
