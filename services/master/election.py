"""A master with standbys: its candidacy in etcd, and what the servicer asks of it on every call.

The candidate (``kvpool.ha.election``) campaigns for the leader key. On
winning, the master starts from an empty index (stores re-mount to the new
leader with their block reports) and serves with the key's revision as its
epoch; it answers every call with that epoch (``kvpool-epoch`` metadata;
heartbeat and mount answers in a field), and lookups wait for the adoption
gate (every registered store reported, or the grace passed). A standby, or a
leader past its local deadline, answers every call UNAVAILABLE, naming
etcd, where the leader is announced.

Stores register under ``/kvpool/stores/`` with their own leases; the leader
drops a segment whose registration went away (its store is dead for
placement), as a missed heartbeat TTL would, only sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import structlog

from kvpool.core.ha.leadership import AdoptionGate, Role
from kvpool.ha.election import STORES_PREFIX, RETRY_S, Candidate, registered_stores
from kvpool.ha.etcd_client import EtcdClient
from kvpool.services.master.durability import CommitWaiters

log = structlog.get_logger(__name__)

EPOCH_KEY = "kvpool-epoch"  # every reply's metadata: the leader's epoch


@dataclass(slots=True)
class HaState:
    """What the servicer needs of the election: may it serve, under which epoch, may lookups go through."""

    candidate: Candidate
    waiters: CommitWaiters
    adoption_grace_s: float = 1.0
    gate: AdoptionGate | None = None
    registered: frozenset[str] = frozenset()
    gate_open: bool = False
    metadata: tuple[tuple[str, str], ...] = ()
    terms: int = 0
    on_term: list[Callable[[], None]] = field(default_factory=list)

    @property
    def epoch(self) -> int:
        assert self.candidate.leadership is not None
        return int(self.candidate.leadership.epoch)

    def refusal(self) -> str | None:
        """None while this master leads; else why it does not answer."""
        if self.candidate.serving():
            return None
        assert self.candidate.leadership is not None
        role = self.candidate.leadership.role.value
        return (f"master: this master ({self.candidate.address}) is a {role}, not the leader; the leader is "
                f"announced in etcd at {self.candidate.client.endpoint}")

    def lookups_open(self, mounted: frozenset[str]) -> bool:
        if self.gate_open:
            return True
        if self.gate is not None and self.gate.open(time.monotonic(), self.registered, mounted):
            self.gate_open = True
            log.info("master_adopted_block_reports", epoch=self.epoch, mounted=len(mounted),
                     registered=len(self.registered))
        return self.gate_open

    async def changed(self, role: Role, epoch: int) -> None:
        """The candidate won or lost: a new term starts from an empty index."""
        if role is Role.LEADER:
            self.terms += 1
            self.metadata = ((EPOCH_KEY, str(epoch)),)
            for start in self.on_term:
                start()
            try:
                self.registered = await asyncio.wait_for(registered_stores(self.candidate.client), 1.0)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                self.registered = frozenset()
            self.gate = AdoptionGate(time.monotonic(), self.adoption_grace_s)
            self.gate_open = False
        else:
            self.gate, self.gate_open = None, False


async def watch_registrations(client: EtcdClient, dropped: Callable[[str], Awaitable[None] | None],
                              stop: asyncio.Event) -> None:
    """Call ``dropped(segment_id)`` whenever a store's registration goes away (its lease lapsed)."""
    while not stop.is_set():
        try:
            _, revision = await client.get_prefix(STORES_PREFIX)
            async for change in client.watch(STORES_PREFIX, revision + 1, prefix=True):
                if change.value is None:
                    result = dropped(change.key[len(STORES_PREFIX):].decode())
                    if result is not None:
                        await result
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("etcd_watch_broken", etcd=client.endpoint, details=detail, retry_in_s=RETRY_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), RETRY_S)
