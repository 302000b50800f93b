"""The router's --sched: from the command line to the admission queue's order, and from replay's
``--compare sched=...`` to the router of each side."""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from kvpool.core.admission.admission import ShardShape, Ticket
from kvpool.core.admission.request_driver import RouterRequest
from kvpool.core.admission.queue import admission_work_s
from kvpool.core.prefill.queue import QueueOrder
from kvpool.tools.replay import compare_cmd
from kvpool.tools.replay.compare import side_settings
from kvpool.tools.replay.topology import TopologySettings, side_topology
from kvpool.services import cli, cli_parser
from kvpool.services.router.generation_request import GenerationRequest
from kvpool.services.router.metrics import RouterMetrics
from kvpool.services.router.router import Router
from kvpool.services.router.server import router_of
from kvpool.services.router.settings import RouterSettings
from kvpool.services.router.tickets import admission_request
from tests.core.admission_cluster import ShardOwner

T = TypeVar("T")

ADDRESSES = ["--pipelines", "127.0.0.1:1", "--shards", "127.0.0.1:2"]


def built(settings: RouterSettings, read: Callable[[Router], T]) -> T:
    """What ``read`` finds in the router ``kvpool router`` builds from ``settings`` (the server's own
    ``router_of``: the flag's way to the core, not a copy of it), the router closed after."""
    async def go() -> T:
        router = router_of(settings, RouterMetrics())
        try:
            return read(router)
        finally:
            await router.close()

    return asyncio.run(go())


def router_settings(*argv: str) -> RouterSettings:
    args = cli_parser.build_parser("router").parse_args(["router", *ADDRESSES, *argv])
    return cli._settings(RouterSettings, "router", args)


def test_the_router_flag_sets_the_admission_queue_order_and_its_aging() -> None:
    fifo, session = router_settings(), router_settings("--sched", "session", "--sched-max-wait-s", "2.5")
    assert (fifo.sched, fifo.queue_order, fifo.sched_max_wait_s) == ("fifo", QueueOrder.FIFO, 4.0)
    assert (session.queue_order, session.sched_max_wait_s) == (QueueOrder.WORK, 2.5)
    with pytest.raises(SystemExit, match="sched_max_wait_s"):
        router_settings("--sched-max-wait-s", "0")
    with pytest.raises(SystemExit):
        router_settings("--sched", "lifo")

    def queue_of(router: Router) -> tuple[QueueOrder, float, float | None]:
        queue = router.admission.queue
        order_gauge = router.metrics.registry.get_sample_value("kvpool_router_queue_order", {"order": queue.order.value})
        return queue.order, queue.max_wait_s, order_gauge

    assert built(session, queue_of) == (QueueOrder.WORK, 2.5, 1.0)
    assert built(fifo, queue_of) == (QueueOrder.FIFO, 4.0, 1.0)


def test_the_router_flag_sets_the_admission_queues_bypass_budget(tmp_path: Path) -> None:
    assert (router_settings().sched_max_bypass_s, router_settings().sched_max_wait_s) == (math.inf, 4.0)
    given = router_settings("--sched", "session", "--sched-max-bypass-s", "0.5", "--sched-max-wait-s", "inf")
    assert (given.sched_max_bypass_s, given.sched_max_wait_s) == (0.5, math.inf)
    assert router_settings("--sched-max-bypass-s", "0").sched_max_bypass_s == 0.0  # arrival order, in effect
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit, match="sched_max_bypass_s: must be >= 0"):
            router_settings("--sched-max-bypass-s", bad)
    config = tmp_path / "cluster.toml"
    config.write_text("[router]\nsched = \"session\"\nsched_max_bypass_s = 2.5\nsched_max_wait_s = inf\n")
    from_toml = router_settings("--config", str(config))
    assert (from_toml.queue_order, from_toml.sched_max_bypass_s, from_toml.sched_max_wait_s) == (
        QueueOrder.WORK, 2.5, math.inf)

    assert built(given, lambda router: router.admission.queue.max_bypass_s) == 0.5
    assert built(router_settings(), lambda router: router.admission.queue.max_bypass_s) == math.inf
    assert built(given, lambda router: router.admission.queue.max_wait_s) == math.inf


def test_the_router_flag_sets_the_admission_queues_backlog_gate() -> None:
    assert router_settings().sched_reorder_below_s == math.inf  # no gate unless given
    given = router_settings("--sched", "session", "--sched-reorder-below-s", "12")
    assert given.sched_reorder_below_s == 12.0
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit, match="sched_reorder_below_s: must be positive"):
            router_settings("--sched-reorder-below-s", bad)

    assert built(given, lambda router: router.admission.queue.reorder_below_s) == 12.0


# one shard whose arena holds two 100-token regions (405,504 bytes each), or a 100- and a 120-token one, or a
# 150-token one (604,096) beside nothing bigger than 120 tokens (484,096)
SHAPE = ShardShape(num_pages=100, page_size=16, arena_bytes=1_000_000, region_bytes_per_token=4000,
                   region_trailer_bytes=4096, max_context=4096)
TURN_WORK = admission_work_s(120, 100)  # session s's second turn: 20 tokens beyond its first's 100


def budget_pops(max_bypass_s: float) -> tuple[list[str], float, float]:
    """r0 (session s) and r1 fill the shard; a 150-token newcomer comes, then s's 120-token turn; r1 ends
    (room for the turn only), then r0 (room for the newcomer). The shard answers every ticket as its Serve
    does, by the core it runs (``ShardOwner``), and says when room came back: the requests it took, and
    ``kvpool_router_queue_budget_total`` and ``kvpool_router_queue_overdue_total``."""

    def prompt(n: int, base: int = 0, session: str = "") -> GenerationRequest:
        return GenerationRequest("completion", "tiny", list(range(base, base + n)), 60, session_key=session)

    async def scenario() -> tuple[list[str], float, float]:
        shard = "127.0.0.1:2"
        router = Router(["127.0.0.1:1"], [shard], RouterMetrics(), order=QueueOrder.WORK,
                        max_wait_s=math.inf, max_bypass_s=max_bypass_s)
        owner = ShardOwner(SHAPE)
        loop = asyncio.get_running_loop()
        requests: dict[str, GenerationRequest] = {}
        drivers: dict[str, RouterRequest] = {}
        waiting: dict[str, asyncio.Task[Ticket]] = {}
        served: list[str] = []
        answered: set[asyncio.Task[Ticket]] = set()

        async def answer() -> None:
            """The shard's answer to every ticket handed out, until none is left."""
            for _ in range(20):
                await asyncio.sleep(0)
                for request_id, task in list(waiting.items()):
                    if task.done() and task not in answered:
                        answered.add(task)
                        driver = drivers[request_id]
                        epoch = owner.serve(admission_request(request_id, requests[request_id]))
                        if epoch is None:
                            served.append(request_id)
                            router._carry(driver.reserved(loop.time()))
                        else:
                            waiting[request_id] = asyncio.create_task(router._next_ticket(
                                driver, lambda d=driver, e=epoch: d.refused(e, loop.time())))

        def ends(request_id: str) -> None:
            router._carry(drivers[request_id].end(loop.time()))
            if owner.end(request_id):  # its stream says room came back
                router.tickets.apply(router.admission.room_again(shard, owner.room.epoch,
                                                                 asyncio.get_running_loop().time()))

        try:
            router.admission.set_shard_shape(shard, SHAPE)
            router.admission.set_pipeline_shape("127.0.0.1:1", 64, 16)
            router.admission.set_watched(shard, True, 0)
            for request_id, request in (("r0", prompt(100, session="s")), ("r1", prompt(100, base=1000)),
                                        ("new", prompt(150, base=9000)), ("turn", prompt(120, session="s"))):
                requests[request_id] = request
                driver = drivers[request_id] = RouterRequest(router.admission, admission_request(request_id, request))
                waiting[request_id] = asyncio.create_task(router._next_ticket(
                    driver, lambda d=driver: d.admit(loop.time())))
                await answer()
            assert served == ["r0", "r1"] and router.admission.queued_ids() == ["new", "turn"]
            served.clear()
            for done in ("r1", "r0"):
                ends(done)
                await answer()
            for task in waiting.values():
                task.cancel()
            registry = router.metrics.registry
            return (served, registry.get_sample_value("kvpool_router_queue_budget_total"),
                    registry.get_sample_value("kvpool_router_queue_overdue_total"))
        finally:
            await router.close()

    return asyncio.run(scenario())


def test_the_router_counts_the_tickets_its_bypass_budget_decided() -> None:
    # no budget: the turn passes the newcomer once r1 ends; the newcomer then waits for more room
    assert budget_pops(math.inf) == (["turn"], 0.0, 0.0)
    # the turn would overdraw the newcomer's credit: the newcomer goes first once r0 ends, the budget's pop
    assert budget_pops(TURN_WORK / 2) == (["new"], 1.0, 0.0)


def test_replay_sched_sides_set_the_router_and_stage_0_alike() -> None:
    base = TopologySettings(sched_max_wait_s=10.0)
    for side in ("fifo", "session"):
        topology = side_topology(side_settings(base, "sched", side))
        for args in (topology.router.args, topology.servers[0].pipelines[0].args):
            assert args[args.index("--sched") + 1] == side
            assert args[args.index("--sched-max-wait-s") + 1] == "10.0"
    router_args = side_topology(TopologySettings()).router.args  # no bound given: the router's own default
    assert "--sched-max-wait-s" not in router_args and router_args[router_args.index("--sched") + 1] == "fifo"
    assert "--sched-max-bypass-s" not in router_args


def replay_args(*argv: str) -> argparse.Namespace:
    return cli_parser.build_parser().parse_args(["replay", *argv])


def test_replay_sched_gates_both_sides_with_a_slot_a_stage_unless_told() -> None:
    def slots(*argv: str) -> list[str]:
        args = replay_args("--compare", "sched=fifo,session", *argv)
        what, sides = compare_cmd._check(args)
        base = compare_cmd.base_settings(args, what, "64MiB", 8192)
        found = []
        for side in sides:
            stage0 = side_topology(side_settings(base, what, side)).servers[0].pipelines[0].args
            found.append(stage0[stage0.index("--sched-slots") + 1])
        return found

    assert slots("--stages", "2") == ["2", "2"]  # at least two
    assert slots("--stages", "4") == ["4", "4"]  # one a stage, as stage 0's own default
    assert slots("--stages", "4", "--sched-slots", "3") == ["3", "3"]
    with pytest.raises(SystemExit, match="--sched-slots: must be >= 0"):
        compare_cmd._check(replay_args("--compare", "sched=fifo,session", "--sched-slots", "-1"))


def test_replay_sched_passes_the_bypass_budget_to_stage_0_and_the_router_of_both_sides() -> None:
    args = replay_args("--compare", "sched=fifo,session", "--sched-max-bypass-s", "0.25", "--sched-max-wait-s", "10")
    what, sides = compare_cmd._check(args)
    base = compare_cmd.base_settings(args, what, "64MiB", 8192)
    assert (base.sched_max_bypass_s, base.sched_max_wait_s) == (0.25, 10.0)
    for side in sides:
        topology = side_topology(side_settings(base, what, side))
        for args_of in (topology.router.args, *(p.args for s in topology.servers for p in s.pipelines)):
            assert args_of[args_of.index("--sched") + 1] == side
            assert args_of[args_of.index("--sched-max-bypass-s") + 1] == "0.25"
            assert args_of[args_of.index("--sched-max-wait-s") + 1] == "10.0"
    unbounded = replay_args("--compare", "sched=fifo,session", "--sched-max-bypass-s", "inf")
    base = compare_cmd.base_settings(unbounded, "sched", "64MiB", 8192)
    router_args = side_topology(side_settings(base, "sched", "session")).router.args
    assert router_args[router_args.index("--sched-max-bypass-s") + 1] == "inf"  # as the router reads it
    # not given, or not a sched= comparison: neither process gets it (their default: no budget)
    for argv in (("--compare", "sched=fifo,session"), ("--compare", "pool=shared,split", "--sched-max-bypass-s", "2")):
        args = replay_args(*argv)
        what, sides = compare_cmd._check(args)
        topology = side_topology(side_settings(compare_cmd.base_settings(args, what, "64MiB", 8192), what, sides[0]))
        for args_of in (topology.router.args, topology.servers[0].pipelines[0].args):
            assert "--sched-max-bypass-s" not in args_of
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit, match="--sched-max-bypass-s: must be >= 0"):
            compare_cmd._check(replay_args("--compare", "sched=fifo,session", "--sched-max-bypass-s", bad))
    with pytest.raises(ValueError, match="sched_max_bypass_s must be >= 0"):
        TopologySettings(sched_max_bypass_s=-1.0)


def test_the_router_flag_sets_how_many_late_health_checks_take_a_backend_out() -> None:
    assert router_settings().health_late_checks == 2
    settings = router_settings("--health-late-checks", "3")
    with pytest.raises(SystemExit, match="health_late_checks"):
        router_settings("--health-late-checks", "0")

    assert built(settings, lambda router: router.backends.verdicts.misses) == 3


def test_the_compare_headline_line_gives_the_comparisons_own_figures() -> None:
    from kvpool.tools.replay.compare_cmd import headline

    sched = {"compare": "sched", "servers": 1, "levels": [12], "sides": {}, "ttft_p50_session_over_fifo": 0.7127,
             "throughput_session_over_fifo": 1.0031, "errors": 0, "regime": {"in_regime": False}}
    # the sched comparison had no headline before: the line read "{}"
    assert headline(sched) == "ttft_p50_session_over_fifo=0.713  throughput_session_over_fifo=1  errors=0"
    assert headline({"compare": "pool", "servers": 2, "shared_over_split": 1.94, "reuse_shared": 0.9}) == (
        "shared_over_split=1.94  reuse_shared=0.9")
    assert headline({"compare": "pool", "servers": 2, "sides": {}}) == "no figures (a side did not run)"


def test_the_router_and_stage_0_declare_their_queue_settings_once() -> None:
    """The four settings of the queue both run are the core's (kvpool.core.prefill.queue_settings): the same
    defaults, the same checks, the same order."""
    import dataclasses

    from kvpool.services.prefill.settings import PrefillSettings
    from kvpool.services.router.settings import RouterSettings

    names = ("sched", "sched_max_wait_s", "sched_max_bypass_s", "sched_reorder_below_s")
    router = {f.name: f.default for f in dataclasses.fields(RouterSettings) if f.name in names}
    stage = {f.name: f.default for f in dataclasses.fields(PrefillSettings) if f.name in names}
    assert router == stage and set(router) == set(names)
    for bad, field in ((dict(sched_max_wait_s=0.0), "sched_max_wait_s"), (dict(sched_max_bypass_s=-1.0),
                       "sched_max_bypass_s"), (dict(sched_reorder_below_s=0.0), "sched_reorder_below_s")):
        for make in (lambda **kw: RouterSettings(pipelines=["127.0.0.1:1"], shards=["127.0.0.1:2"], **kw),
                     lambda **kw: PrefillSettings(num_stages=1, **kw)):
            with pytest.raises(ValueError, match=f"^{field}: "):
                make(**bad)
    assert RouterSettings(pipelines=["127.0.0.1:1"], shards=["127.0.0.1:2"], sched="session").queue_order \
        is QueueOrder.WORK
