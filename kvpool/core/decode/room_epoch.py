"""A decode shard's count of the room it gave back, for the routers that found it full.

Pure. The shard owns its pages and receive arena; a router keeps no count of
them (``kvpool.core.admission.admission``). A request the shard has no room
for is refused at once, naming the give-backs so far (``refused`` → the
epoch); the next give-back after a refusal rings (``observe`` → True), and
the shard's ``WatchRoom`` streams send the new epoch. With no refusal
outstanding nothing rings, so a shard with room tells nobody anything.

Invariants: ``epoch`` only grows, by one per ``observe`` that sees less held
than the one before; ``observe`` rings exactly once after each run of
``refused`` calls, at the first give-back that follows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Held:
    """What the shard holds that a request needs: pages, region bytes, region slots."""

    pages: int
    region_bytes: int
    regions: int

    def gave_back(self, before: Held) -> bool:
        return self.pages < before.pages or self.region_bytes < before.region_bytes or self.regions < before.regions


class RoomEpoch:
    """The give-back count and whether a refusal waits for the next one (see the module doc)."""

    def __init__(self) -> None:
        self.epoch = 0
        self._wanted = False  # a request was refused since the last ring
        self._held = Held(0, 0, 0)

    def refused(self) -> int:
        """A request found no room: the next give-back rings. The epoch to name in the refusal."""
        self._wanted = True
        return self.epoch

    def observe(self, held: Held) -> bool:
        """What the shard holds now, after any change; True: ring (room came back after a refusal)."""
        ring = False
        if held.gave_back(self._held):
            self.epoch += 1
            ring, self._wanted = self._wanted, False
        self._held = held
        return ring
