"""The router's --sched: from the command line to the admission queue's order, and from replay's
``--compare sched=...`` to the router of each side."""

from __future__ import annotations

import asyncio

import pytest

from kvpool.core.prefill_queue import QueueOrder
from kvpool.tools.replay.compare import side_settings
from kvpool.tools.replay.topology import TopologySettings, side_topology
from services import cli
from services.router.metrics import RouterMetrics
from services.router.router import Router
from services.router.settings import RouterSettings

ADDRESSES = ["--pipelines", "127.0.0.1:1", "--shards", "127.0.0.1:2"]


def router_settings(*argv: str) -> RouterSettings:
    args = cli.build_parser("router").parse_args(["router", *ADDRESSES, *argv])
    return cli._settings(RouterSettings, "router", args)


def test_the_router_flag_sets_the_admission_queue_order_and_its_aging() -> None:
    fifo, session = router_settings(), router_settings("--sched", "session", "--sched-max-wait-s", "2.5")
    assert (fifo.sched, fifo.queue_order, fifo.sched_max_wait_s) == ("fifo", QueueOrder.FIFO, 4.0)
    assert (session.queue_order, session.sched_max_wait_s) == (QueueOrder.WORK, 2.5)
    with pytest.raises(SystemExit, match="sched_max_wait_s"):
        router_settings("--sched-max-wait-s", "0")
    with pytest.raises(SystemExit):
        router_settings("--sched", "lifo")

    async def queue_of(settings: RouterSettings) -> tuple[QueueOrder, float, float]:
        router = Router(settings.pipelines, settings.shards, RouterMetrics(), order=settings.queue_order,
                        max_wait_s=settings.sched_max_wait_s)
        try:
            queue = router.admission.queue
            order_gauge = router.metrics.registry.get_sample_value(
                "kvpool_router_queue_order", {"order": settings.queue_order.value})
            return queue.order, queue.max_wait_s, order_gauge
        finally:
            await router.close()

    assert asyncio.run(queue_of(session)) == (QueueOrder.WORK, 2.5, 1.0)
    assert asyncio.run(queue_of(fifo)) == (QueueOrder.FIFO, 4.0, 1.0)


def test_replay_sched_sides_set_the_router_and_stage_0_alike() -> None:
    base = TopologySettings(sched_max_wait_s=10.0)
    for side in ("fifo", "session"):
        topology = side_topology(side_settings(base, "sched", side))
        for args in (topology.router.args, topology.servers[0].pipelines[0].args):
            assert args[args.index("--sched") + 1] == side
            assert args[args.index("--sched-max-wait-s") + 1] == "10.0"
    router_args = side_topology(TopologySettings()).router.args  # no bound given: the router's own default
    assert "--sched-max-wait-s" not in router_args and router_args[router_args.index("--sched") + 1] == "fifo"


def test_the_router_flag_sets_how_many_late_health_checks_take_a_backend_out() -> None:
    assert router_settings().health_late_checks == 2
    settings = router_settings("--health-late-checks", "3")
    with pytest.raises(SystemExit, match="health_late_checks"):
        router_settings("--health-late-checks", "0")

    async def misses(settings: RouterSettings) -> int:
        router = Router(settings.pipelines, settings.shards, RouterMetrics(),
                        late_checks_out=settings.health_late_checks)
        try:
            return router.backends.verdicts.misses
        finally:
            await router.close()

    assert asyncio.run(misses(settings)) == 3
