"""Where a request's KV goes (``HandoffTarget``: the receive region decode reserved), which path its
bytes take there (``handoff_path``), and what writing it cost (``StageHandoffFigures`` per stage,
``HandoffFigures`` for the request).

The path follows the declared hosts, as the pool's does (``kvpool.core.pool.paths``): a stage on
decode's declared host, with decode's receive arena offered as shared memory, copies into the mapped
arena; any other stage writes with the transfer engine. Whether a socket happens to connect never
decides (emulated hosts in network namespaces share one kernel).

Pure: no protobuf, no I/O. The messages convert in one place
(``kvpool.handoff_messages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.errors import FailedPrecondition, InvalidArgument
from kvpool.core.handoff.layout import HandoffLayout
from kvpool.core.pool.paths import BytePath, SegmentAccess, SharedMemoryRef, byte_path


@dataclass(frozen=True, slots=True)
class HandoffTarget:
    """One request's receive region on a decode shard, as decode reserved it."""

    region_id: str
    endpoint: str  # decode's transfer engine
    address: int
    size: int
    deadline_unix_ms: int  # the reservation's end; 0: none
    layout: HandoffLayout
    notify_address: str = ""  # decode's Landed service; "": decode scatters everything at Generate
    host: str = ""  # the host decode declares; "": unknown (the engine only)
    shared: SharedMemoryRef | None = None  # decode's receive arena as shared memory; None: not offered
    shared_base_address: int = 0  # the arena's first byte in decode's address space (``address`` lies in it)
    control_offset: int = 0  # the region's control record in the shared arena (``kvpool.core.handoff.control``)

    @property
    def access(self) -> SegmentAccess:
        """Decode's receive arena as the pool's path decision sees a segment."""
        return SegmentAccess(self.region_id, self.host, self.shared_base_address, self.shared)

    @property
    def shared_offset(self) -> int:
        """Where the region starts in the shared arena."""
        return self.access.offset(self.address)


@dataclass(frozen=True, slots=True)
class StageHandoffFigures:
    """What one stage's writes of one request cost."""

    stage: int
    transfers: int = 0
    bytes: int = 0
    gather_seconds: float = 0.0
    write_seconds: float = 0.0
    scatter_seconds: float = 0.0
    ranges: int = 0
    forward_end_unix_ms: float = 0.0
    last_write_end_unix_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class HandoffFigures:
    """A whole request's handoff: every stage's figures and their sums; ``seconds`` from the
    forward's end to the last byte."""

    region_id: str
    stages: tuple[StageHandoffFigures, ...]
    transfers: int
    bytes: int
    seconds: float


def handoff_path(target: HandoffTarget, stage_host: str, engine_only: bool = False) -> BytePath:
    """The path of a stage's writes into ``target`` from a stage on ``stage_host`` (module doc)."""
    return byte_path(target.access, stage_host, engine_only)


def check_target(
    target: HandoffTarget, layout: HandoffLayout, layer_split: Sequence[tuple[int, int]],
    entry_bytes: int, now_unix_ms: int,
) -> None:
    """Raise unless the target fits this pipeline and its reservation is still live."""
    if not target.endpoint and target.shared is None:
        raise InvalidArgument("target.endpoint: must name decode's transfer engine (or the target its shared memory)")
    if target.address == 0:
        raise InvalidArgument("target.address: must not be 0")
    split = tuple((int(s), int(e)) for s, e in layer_split)
    if layout.layer_split != split:
        raise InvalidArgument(f"target.layout.layer_split: {list(layout.layer_split)} is not the pipeline's {list(split)}")
    if layout.entry_bytes != entry_bytes:
        raise InvalidArgument(f"target.layout.entry_bytes: {layout.entry_bytes}, the pipeline's entries are {entry_bytes}")
    if target.size < layout.nbytes:
        raise InvalidArgument(f"target.size: {target.size} bytes, the layout needs {layout.nbytes}")
    if target.shared is not None:
        target.shared.check("target.shared_memory")
        if target.shared_base_address == 0 or target.address < target.shared_base_address:
            raise InvalidArgument(f"target.shared_base_address: {target.shared_base_address} is not the start of "
                                  f"an arena holding target.address {target.address}")
    if target.deadline_unix_ms and target.deadline_unix_ms <= now_unix_ms:
        raise FailedPrecondition(
            f"target.deadline_unix_ms: the reservation expired {now_unix_ms - target.deadline_unix_ms} ms ago"
        )
