"""Leader epochs and the fence every store and client keeps.

An epoch is the etcd revision at which a leader's key was created: etcd's
revisions only grow, so every later election has a larger epoch. Every reply
of a master in HA mode carries its epoch; whoever receives it keeps the
largest it has accepted (``EpochFence``) and refuses a reply of an older one,
so a deposed leader whose answers are still on the wire (or that wakes from a
pause) changes nothing.

``LeaderView`` is what a client follows: the announced leader of the largest
epoch. An announcement of an older epoch (a delayed watch event, a stale read)
never replaces a newer one; a vacancy (the leader's key deleted or expired)
of the current epoch leaves no leader to call until the next is announced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

Epoch = NewType("Epoch", int)

NO_EPOCH = Epoch(0)  # a single master without etcd: its replies carry no epoch and every fence admits them


@dataclass(slots=True)
class EpochFence:
    """The largest epoch accepted so far. Invariant: ``epoch`` never decreases; ``admit`` is true exactly for
    replies of ``epoch`` or newer (and for ``NO_EPOCH`` while nothing newer was seen)."""

    epoch: Epoch = NO_EPOCH
    num_refused: int = 0

    def admit(self, epoch: int) -> bool:
        if epoch < self.epoch:
            self.num_refused += 1
            return False
        self.epoch = Epoch(epoch)
        return True


@dataclass(slots=True, frozen=True)
class Leader:
    """A leader as its etcd key announces it: where it serves and since which epoch."""

    address: str
    epoch: Epoch

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("address: must not be empty")
        if self.epoch <= NO_EPOCH:
            raise ValueError(f"epoch: must be positive, got {self.epoch}")


@dataclass(slots=True)
class LeaderView:
    """The leader a client calls. Invariants: ``epoch`` never decreases; ``leader`` is None or of ``epoch``;
    an older announcement or vacancy changes nothing."""

    leader: Leader | None = None
    epoch: Epoch = NO_EPOCH
    num_switches: int = 0

    def announce(self, leader: Leader) -> bool:
        """A leader key was read or watched; true when the client must switch to it (a newer epoch)."""
        if leader.epoch < self.epoch or (leader.epoch == self.epoch and self.leader is not None):
            return False
        if leader.epoch == self.epoch and self.leader is None:  # its vacancy was seen first: it is gone
            return False
        if self.leader is not None:
            self.num_switches += 1
        self.leader, self.epoch = leader, leader.epoch
        return True

    def vacate(self, epoch: int) -> bool:
        """The key of the leader of ``epoch`` went away (deleted, or its lease expired); true when that was the
        leader followed."""
        if epoch < self.epoch or (epoch == self.epoch and self.leader is None):
            return False
        self.leader, self.epoch = None, Epoch(epoch)
        return True
