"""The election against a real etcd: one candidate leads with the key's revision as epoch, a standby wins only
once the leader's lease is gone, the leader watch follows, a store's registration lapses with its lease."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvpool.core.ha.leadership import LeaseTimes, Role
from kvpool.ha.election import Candidate, LeaderWatch, Registration, registered_stores
from kvpool.ha.etcd_client import EtcdClient
from kvpool.tools.cluster.etcd import EtcdProcess
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

TIMES = LeaseTimes(ttl_s=2.0, keepalive_s=0.4, margin_s=0.3)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    with EtcdProcess(tmp_path) as process:
        yield process


@pytest.fixture
async def client(etcd: EtcdProcess) -> AsyncIterator[EtcdClient]:
    c = EtcdClient(etcd.endpoint)
    yield c
    await c.close()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[Role, int]] = []

    async def __call__(self, role: Role, epoch: int) -> None:
        self.events.append((role, epoch))


async def test_one_leads_a_standby_wins_after_the_leader_stops_and_the_watch_follows(etcd: EtcdProcess) -> None:
    a_events, b_events = Recorder(), Recorder()
    a = Candidate(EtcdClient(etcd.endpoint), "a:1", TIMES, a_events, name="a")
    b = Candidate(EtcdClient(etcd.endpoint), "b:1", TIMES, b_events, name="b")
    watch = LeaderWatch(EtcdClient(etcd.endpoint))
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(a.run(stop_a))]
    try:
        await eventually(lambda: a.serving(), what="a leads")
        tasks.append(asyncio.create_task(b.run(stop_b)))
        watch.start()
        leader = await watch.wait_for_leader(5.0)
        assert leader is not None and leader.address == "a:1"
        epoch_a = a_events.events[0][1]
        assert leader.epoch == epoch_a and a_events.events == [(Role.LEADER, epoch_a)]
        # b stands by while a keeps its lease (several TTLs)
        await eventually(lambda: a.serving() and not b.serving(), what="b stands by")
        start = time.monotonic()
        while time.monotonic() - start < 2 * TIMES.ttl_s:  # two TTLs of keep-alives: never both, no flap
            assert not (a.serving() and b.serving())
            await asyncio.sleep(0.1)
        assert a_events.events == [(Role.LEADER, epoch_a)] and b_events.events == []
        stop_a.set()  # a resigns: b wins at once, with a newer epoch
        await eventually(lambda: b.serving(), timeout_s=5.0, what="b leads")
        assert not a.serving()
        epoch_b = b_events.events[0][1]
        assert epoch_b > epoch_a and a_events.events[-1] == (Role.DEPOSED, epoch_a)
        await eventually(lambda: watch.current is not None and watch.current.address == "b:1", what="watch follows")
        assert watch.current.epoch == epoch_b and watch.view.num_switches == 0  # through a vacancy
    finally:
        stop_a.set()
        stop_b.set()
        await asyncio.gather(*tasks)
        await watch.stop()
        await a.client.close()
        await b.client.close()


async def test_a_paused_etcd_deposes_the_leader_before_its_lease_could_expire(etcd: EtcdProcess) -> None:
    events = Recorder()
    a = Candidate(EtcdClient(etcd.endpoint), "a:1", TIMES, events)
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop))
    try:
        await eventually(lambda: a.serving(), what="a leads")
        etcd.pause()
        paused_at = time.monotonic()
        try:
            await eventually(lambda: not a.serving(), timeout_s=10.0, what="a stops serving")
            # by its own deadline: counted from a keep-alive sent before the pause, less the margin, so before
            # etcd (which received that keep-alive later) could expire the lease
            assert a.leadership is not None and a.leadership.deadline <= paused_at + TIMES.ttl_s - TIMES.margin_s
            # serving() reads the deadline itself; the candidate's task records its deposition when it wakes
            # (a moment later on a loaded host: once this asserted at once and failed)
            await eventually(lambda: (Role.DEPOSED, events.events[0][1]) in events.events, timeout_s=5.0,
                             what="a recorded its deposition")
        finally:
            etcd.resume()
        await eventually(lambda: a.serving(), timeout_s=10.0, what="a leads again once etcd is back")
        assert events.events[-1][1] > events.events[0][1]
    finally:
        stop.set()
        await task
        await a.client.close()


async def test_a_store_registration_lives_with_its_lease(client: EtcdClient, etcd: EtcdProcess) -> None:
    stop = asyncio.Event()
    registration = Registration(EtcdClient(etcd.endpoint), "seg-a", b"{}", ttl_s=2, keepalive_s=0.4)
    task = asyncio.create_task(registration.run(stop))
    try:
        await eventually(lambda: _registered(client, "seg-a"), what="registered")
        task.cancel()  # the store dies: nobody keeps the lease alive
        await asyncio.gather(task, return_exceptions=True)
        await eventually(lambda: _gone(client, "seg-a"), timeout_s=5.0, what="the lease lapsed")
    finally:
        stop.set()
        task.cancel()
        await registration.client.close()


async def _registered(client: EtcdClient, segment_id: str) -> bool:
    return segment_id in await registered_stores(client)


async def _gone(client: EtcdClient, segment_id: str) -> bool:
    return segment_id not in await registered_stores(client)
