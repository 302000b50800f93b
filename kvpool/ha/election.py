"""A master candidate's campaign over etcd, and the watch that follows the leader.

``Candidate.run`` campaigns for the leader key under a fresh lease: the key's
creation revision is the new leader's epoch. While it leads, a keep-alive
goes every ``keepalive_s`` and each answer moves the local deadline
(``kvpool.core.ha.leadership``); a watchdog deposes the leader the moment the
deadline passes without one, whatever the rest of the process is doing. A
standby watches the key and campaigns again as soon as it goes away (the
leader's lease expired or it resigned).

``LeaderWatch`` is what clients and stores run: it reads the leader key, then
watches it, and keeps a ``LeaderView`` (the core decides when to switch).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import structlog

from kvpool.core.ha.epochs import Epoch, Leader, LeaderView
from kvpool.core.ha.leadership import Leadership, LeaseTimes, Role
from kvpool.ha.etcd_client import Change, EtcdClient, KeepAlive, KeyValue

log = structlog.get_logger(__name__)

LEADER_KEY = b"/kvpool/master/leader"
STORES_PREFIX = b"/kvpool/stores/"
RETRY_S = 0.25  # etcd unreachable: try again this soon (failover waits on it)


def leader_of(kv: KeyValue) -> Leader | None:
    """The leader a key announces (None: not a key a candidate wrote)."""
    try:
        address = json.loads(kv.value)["address"]
    except (ValueError, KeyError, TypeError):
        return None
    return Leader(address, Epoch(kv.create_revision)) if address else None


@dataclass(slots=True)
class Candidate:
    """One master process's part in the election. ``on_change(role, epoch)`` runs as it wins or loses."""

    client: EtcdClient
    address: str
    times: LeaseTimes
    on_change: Callable[[Role, int], Awaitable[None]]
    name: str = ""
    leadership: Leadership | None = None

    def __post_init__(self) -> None:
        self.leadership = Leadership(self.times)

    def serving(self) -> bool:
        assert self.leadership is not None
        return self.leadership.check(time.monotonic())

    async def run(self, stop: asyncio.Event) -> None:
        value = json.dumps({"address": self.address, "name": self.name}).encode()
        while not stop.is_set():
            try:
                holder = await self._campaign(value, stop)
                if holder is not None:  # another leads: wait for its key to go
                    log.info("master_standby", leader=holder.address, epoch=holder.epoch)
                    await self._await_vacancy(holder)
            except (grpc.aio.AioRpcError, RuntimeError) as exc:
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("etcd_unreachable", etcd=self.client.endpoint, details=detail, retry_in_s=RETRY_S)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), RETRY_S)

    async def _campaign(self, value: bytes, stop: asyncio.Event) -> Leader | None:
        """Try once; while we win, lead until deposed and return None; else return who holds the key."""
        assert self.leadership is not None
        self.leadership.stand_by()  # a deposed candidate campaigns again as a standby (and says so when refusing)
        sent = time.monotonic()
        lease_id, _ = await self.client.grant(int(self.times.ttl_s))
        created, kv = await self.client.create(LEADER_KEY, value, lease_id)
        if not created:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.client.revoke(lease_id)
            return leader_of(kv) if kv is not None else Leader("?", Epoch(1))
        assert kv is not None
        self.leadership.won(kv.create_revision, sent)
        log.info("master_elected", address=self.address, epoch=kv.create_revision, lease_ttl_s=self.times.ttl_s)
        await self.on_change(Role.LEADER, kv.create_revision)
        try:
            await self._lead(lease_id, stop)
        finally:
            epoch = self.leadership.epoch
            self.leadership.lost()
            log.warning("master_deposed", address=self.address, epoch=epoch)
            await self.on_change(Role.DEPOSED, epoch)
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                if stop.is_set():  # resign: a standby wins at once rather than after the TTL
                    await asyncio.wait_for(self.client.delete(LEADER_KEY, only_lease=lease_id), 1.0)
                await asyncio.wait_for(self.client.revoke(lease_id), 1.0)
        return None

    async def _lead(self, lease_id: int, stop: asyncio.Event) -> None:
        """Keep the lease alive until the local deadline passes, etcd says the lease is gone, or we stop."""
        assert self.leadership is not None
        keepalive = KeepAlive(self.client, lease_id)

        async def send() -> None:
            while True:
                await keepalive.send()
                await asyncio.sleep(self.times.keepalive_s)

        async def receive() -> None:
            async for sent, ttl in keepalive.answers():
                self.leadership.renewed(sent, ttl)
                if ttl <= 0:
                    log.warning("master_lease_lost", epoch=self.leadership.epoch)
                    return

        async def watchdog() -> None:
            while self.leadership.check(time.monotonic()):
                await asyncio.sleep(max(0.0, self.leadership.deadline - time.monotonic()) + 0.001)
            # what tells a starved process from a slow etcd: a watchdog that woke long past the deadline was not
            # run on time (the process or its loop stalled); one on time, with keep-alives sent and unanswered,
            # waited on etcd (or the network)
            now = time.monotonic()
            log.warning("master_lease_deadline_passed", epoch=self.leadership.epoch,
                        detail="no keep-alive answered in time: stop answering before another can win",
                        woke_after_deadline_s=round(now - self.leadership.deadline, 3),
                        last_sent_s_ago=round(now - keepalive.last_sent, 3),
                        last_answered_s_ago=round(now - keepalive.last_answered, 3) if keepalive.last_answered
                        else None, unanswered=keepalive.unanswered)

        tasks = [asyncio.create_task(coro) for coro in (send(), receive(), watchdog(), stop.wait())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            keepalive.cancel()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await task

    async def _await_vacancy(self, holder: Leader) -> None:
        kv, revision = await self.client.get(LEADER_KEY)
        if kv is None or kv.create_revision != holder.epoch:
            return
        async for change in self.client.watch(LEADER_KEY, revision + 1):
            if change.value is None or change.create_revision != holder.epoch:
                return


class LeaderWatch:
    """Follows the leader key; ``changed`` is set whenever the leader to call changes (``current``)."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self.view = LeaderView()
        self.changed = asyncio.Event()
        self.ready = asyncio.Event()  # a first answer came from etcd
        self._task: asyncio.Task[None] | None = None

    @property
    def current(self) -> Leader | None:
        return self.view.leader

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.client.close()

    async def wait_for_leader(self, timeout_s: float) -> Leader | None:
        """The leader, waiting at most ``timeout_s`` for one to be announced."""
        deadline = time.monotonic() + timeout_s
        while self.view.leader is None and time.monotonic() < deadline:
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - time.monotonic()))
        return self.view.leader

    def _apply(self, change: Change) -> None:
        if change.value is None:
            switched = self.view.vacate(change.create_revision or self.view.epoch)
            if switched:
                log.info("master_leader_gone", epoch=self.view.epoch)
        else:
            leader = leader_of(KeyValue(change.key, change.value, change.create_revision, change.revision, 0))
            switched = leader is not None and self.view.announce(leader)
            if switched:
                log.info("master_leader_found", leader=leader.address, epoch=leader.epoch)
        if switched:
            self.changed.set()

    async def _run(self) -> None:
        while True:
            try:
                kv, revision = await self.client.get(LEADER_KEY)
                if kv is not None:
                    self._apply(Change(kv.key, kv.value, kv.create_revision, kv.mod_revision))
                self.ready.set()
                async for change in self.client.watch(LEADER_KEY, revision + 1):
                    if change.value is None and not change.create_revision:
                        change = Change(change.key, None, self.view.epoch, change.revision)  # deletes carry no kv
                    self._apply(change)
            except (grpc.aio.AioRpcError, RuntimeError) as exc:
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("etcd_watch_broken", etcd=self.client.endpoint, details=detail, retry_in_s=RETRY_S)
                await asyncio.sleep(RETRY_S)


class Registration:
    """A store's key under ``/kvpool/stores/`` held by its own lease: a store whose lease lapses is dead for
    placement. Re-registers after etcd comes back."""

    def __init__(self, client: EtcdClient, segment_id: str, value: bytes, ttl_s: int, keepalive_s: float) -> None:
        self.client, self.key, self.value = client, STORES_PREFIX + segment_id.encode(), value
        self.ttl_s, self.keepalive_s = ttl_s, keepalive_s

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            lease_id = 0
            try:
                lease_id, _ = await self.client.grant(self.ttl_s)
                await self.client.put(self.key, self.value, lease_id)
                log.info("store_registered", key=self.key.decode(), lease_ttl_s=self.ttl_s)
                keepalive = KeepAlive(self.client, lease_id)
                try:
                    sender = asyncio.create_task(self._send(keepalive))
                    async for _, ttl in keepalive.answers():
                        if ttl <= 0:
                            log.warning("store_registration_lapsed", key=self.key.decode())
                            break
                        if stop.is_set():
                            break
                finally:
                    keepalive.cancel()
                    sender.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await sender
            except (grpc.aio.AioRpcError, RuntimeError) as exc:
                log.warning("etcd_unreachable", etcd=self.client.endpoint, retry_in_s=RETRY_S,
                            details=exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc))
            if stop.is_set():
                if lease_id:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self.client.revoke(lease_id)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), RETRY_S)

    async def _send(self, keepalive: KeepAlive) -> None:
        while True:
            await keepalive.send()
            await asyncio.sleep(self.keepalive_s)


async def registered_stores(client: EtcdClient) -> frozenset[str]:
    kvs, _ = await client.get_prefix(STORES_PREFIX)
    return frozenset(kv.key[len(STORES_PREFIX):].decode() for kv in kvs)
