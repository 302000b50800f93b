"""A master candidate's view of its own leadership: when it may serve.

Leadership is an etcd lease of ``ttl_s``: the candidate that creates the
leader key under its lease leads, with the key's creation revision as its
epoch. etcd expires the lease ``ttl_s`` after it *received* the last grant
or keep-alive, and only then can another candidate win. The candidate counts
from when it *sent* that request, which came earlier, and stops serving
``margin_s`` sooner still (a reply in flight, a clock running a little fast):

    local deadline = sent + ttl_s - margin_s  <  received + ttl_s = etcd's expiry

so a leader stops answering before another can win, even if it is paused,
partitioned or starved of CPU in between: a paused process finds on waking
that its deadline has passed, whatever its keep-alive task had in mind.

States: ``STANDBY`` (campaigning or watching) → ``LEADER`` (``won``) →
``DEPOSED`` (``lost``: the lease is gone, or the deadline passed). A deposed
candidate never leads again under that epoch; it campaigns anew as a standby.

Invariants:
- ``serving(now)`` only in ``LEADER`` and only while ``now < deadline``;
- ``deadline`` never decreases while leading, and is at most the send time of
  an acknowledged request plus ``ttl_s - margin_s``;
- ``epoch`` only grows across ``won`` calls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpool.core.ha.epochs import NO_EPOCH, Epoch


class Role(enum.Enum):
    STANDBY = "standby"
    LEADER = "leader"
    DEPOSED = "deposed"


@dataclass(slots=True, frozen=True)
class LeaseTimes:
    """The lease's TTL and its keep-alive period, tuned for busy hosts.

    Failover takes about ``ttl_s - keepalive_s / 2`` (the lease outliving a
    dead leader) plus a campaign and the stores' re-mounts; a leader flaps
    only if ``ttl_s - margin_s`` passes without one keep-alive answered, that
    is ``(ttl_s - margin_s) / keepalive_s`` keep-alives lost or late in a row.
    """

    ttl_s: float = 2.0
    keepalive_s: float = 0.4
    margin_s: float = 0.3

    def __post_init__(self) -> None:
        if self.ttl_s < 1.0:
            raise ValueError(f"lease_ttl_s: {self.ttl_s} is under etcd's 1 s granularity")
        if self.ttl_s != int(self.ttl_s):
            raise ValueError(f"lease_ttl_s: {self.ttl_s} is not whole seconds (etcd grants whole seconds)")
        if not 0 < self.margin_s < self.ttl_s / 2:
            raise ValueError(f"lease_margin_s: {self.margin_s} is outside (0, lease_ttl_s / 2)")
        if not 0 < self.keepalive_s <= (self.ttl_s - self.margin_s) / 3:
            raise ValueError(
                f"lease_keepalive_s: {self.keepalive_s} must be positive and at most a third of "
                f"lease_ttl_s - lease_margin_s ({self.ttl_s - self.margin_s}), so two late keep-alives "
                "in a row do not depose a busy leader")


@dataclass(slots=True)
class Leadership:
    """One candidate's role and local deadline (see the module doc for the invariants)."""

    times: LeaseTimes
    role: Role = Role.STANDBY
    epoch: Epoch = NO_EPOCH
    deadline: float = 0.0
    num_terms: int = 0

    def won(self, epoch: int, sent_at: float) -> None:
        """The leader key was created under our lease at revision ``epoch``; the lease grant (or the last
        keep-alive before the campaign) was sent at ``sent_at``."""
        if epoch <= self.epoch:
            raise ValueError(f"epoch: {epoch} is not newer than this candidate's last ({self.epoch})")
        self.role, self.epoch = Role.LEADER, Epoch(epoch)
        self.deadline = sent_at + self.times.ttl_s - self.times.margin_s
        self.num_terms += 1

    def renewed(self, sent_at: float, ttl_s: float) -> None:
        """A keep-alive sent at ``sent_at`` was answered with ``ttl_s`` left (0 or less: the lease is gone)."""
        if self.role is not Role.LEADER:
            return
        if ttl_s <= 0:
            self.lost()
            return
        self.deadline = max(self.deadline, sent_at + min(ttl_s, self.times.ttl_s) - self.times.margin_s)

    def lost(self) -> None:
        """The lease or the key is gone (expired, revoked, deleted by an operator): step down."""
        if self.role is Role.LEADER:
            self.role = Role.DEPOSED

    def serving(self, now: float) -> bool:
        return self.role is Role.LEADER and now < self.deadline

    def check(self, now: float) -> bool:
        """``serving``, and a leader past its deadline is deposed for good (it must campaign again)."""
        if self.role is Role.LEADER and now >= self.deadline:
            self.role = Role.DEPOSED
        return self.serving(now)

    def stand_by(self) -> None:
        """A deposed candidate campaigns again."""
        if self.role is Role.DEPOSED:
            self.role = Role.STANDBY


@dataclass(slots=True, frozen=True)
class AdoptionGate:
    """When a new leader answers lookups: once every store registered in etcd has sent its block report, or
    ``grace_s`` after it won, whichever is first. Before, a lookup would miss groups whose store has not
    reported yet (a miss only costs recompute, but a whole pool of misses at once is what failover must not
    cost); a store that never reports is dead, and waiting for it longer would only delay the rest."""

    won_at: float
    grace_s: float = 1.0

    def open(self, now: float, registered: frozenset[str], mounted: frozenset[str]) -> bool:
        return now >= self.won_at + self.grace_s or registered <= mounted
