"""The way to the pool master: one fixed address, or the leader an etcd announces (``etcd://HOST:PORT``).

Stores, stages and pool clients hold one. With etcd it runs a ``LeaderWatch``
and opens a channel to whichever leader the core's ``LeaderView`` follows;
``changed`` is set when the leader changes, and the holder calls ``follow``
to move its channel there (a store re-mounts with its block report, a pool
client opens a new session). Every reply's epoch goes through ``fence``: an
answer from an older leader than one already heard is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog

from kvpool.core.ha.epochs import EpochFence
from kvpool.ha.election import LeaderWatch
from kvpool.ha.etcd_client import EtcdClient, check_endpoint

log = structlog.get_logger(__name__)

ETCD_SCHEME = "etcd://"


def etcd_of(master: str) -> str | None:
    """The etcd endpoint a master setting names (``etcd://HOST:PORT``), else None (a master's own address)."""
    if not master.startswith(ETCD_SCHEME):
        return None
    return check_endpoint(master[len(ETCD_SCHEME):], "master")


class MasterLink:
    """One channel to the master (the current leader, with etcd). ``open_channel(address)`` makes channels."""

    def __init__(self, master: str, open_channel: Callable[[str], grpc.aio.Channel]) -> None:
        self.master = master
        self.etcd = etcd_of(master)
        self._open_channel = open_channel
        self.fence = EpochFence()
        self.watch = LeaderWatch(EtcdClient(self.etcd)) if self.etcd is not None else None
        self.address = "" if self.etcd is not None else master
        self.epoch = 0
        self.channel: grpc.aio.Channel | None = None if self.etcd is not None else open_channel(master)

    @property
    def changed(self) -> asyncio.Event | None:
        return self.watch.changed if self.watch is not None else None

    def stale(self) -> bool:
        """With etcd: the leader announced is not the one our channel reaches."""
        if self.watch is None:
            return False
        leader = self.watch.current
        return leader is not None and (leader.address, leader.epoch) != (self.address, self.epoch)

    async def connect(self, timeout_s: float) -> bool:
        """With etcd: wait (at most ``timeout_s``) for a leader and open a channel to it; true when one is open."""
        if self.watch is None:
            return True
        self.watch.start()
        if self.channel is not None and not self.stale():
            return True
        leader = await self.watch.wait_for_leader(timeout_s)
        if leader is None:
            return False
        await self.follow()
        return True

    async def follow(self) -> bool:
        """Move the channel to the leader announced now; true when it moved."""
        assert self.watch is not None
        self.watch.changed.clear()
        leader = self.watch.current
        if leader is None or (leader.address, leader.epoch) == (self.address, self.epoch):
            return False
        old = self.channel
        self.channel = self._open_channel(leader.address)
        self.address, self.epoch = leader.address, int(leader.epoch)
        log.info("master_leader_followed", master=leader.address, epoch=leader.epoch)
        if old is not None:
            await old.close()
        return True

    def admit(self, epoch: int) -> bool:
        """A reply's epoch: false for one older than the fence (a deposed leader's)."""
        admitted = self.fence.admit(epoch)
        if not admitted:
            log.warning("master_reply_fenced", epoch=epoch, newest_epoch=self.fence.epoch)
        return admitted

    async def close(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        if self.channel is not None:
            await self.channel.close()


def epoch_of(metadata: Sequence[tuple[str, Any]] | None) -> int:
    """The leader's epoch a reply's metadata carries (0: a master without standbys)."""
    for key, value in metadata or ():
        if key == "kvpool-epoch":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
