"""The store's client of the pool master: mount, heartbeat and unmount its segment, in the core's records.

The one place the store meets ``pool_pb2``: records and changes cross as
:class:`ObjectRecord` and :class:`SegmentChange`, converted here both ways.
A failed call raises ``grpc.aio.AioRpcError`` as it comes; the daemon decides
what each status means.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvpool.core.pool.paths import SharedMemoryRef
from kvpool.core.pool.records import ObjectRecord, SegmentChange
from kvpool.handoff_messages import shared_memory_message
from kvpool.rpc import pool_pb2, pool_pb2_grpc

RPC_TIMEOUT_S = 5.0
UNMOUNT_TIMEOUT_S = 2.0


@dataclass(slots=True, frozen=True)
class SegmentMount:
    """What a store tells the master of its segment when it (re-)mounts it."""

    segment_id: str
    endpoint: str
    host: str
    base_address: int
    size: int
    numa_node: int
    shared: SharedMemoryRef | None = None  # where a client on ``host`` maps the segment


@dataclass(slots=True, frozen=True)
class Mounted:
    """The master's answer to a mount: where the segment's journal stands and what it made of the report."""

    sequence: int
    rejected_keys: frozenset[str]
    num_adopted: int
    master_incarnation: str
    heartbeat_interval_s: float
    epoch: int = 0  # the leader's (a master with standbys)


@dataclass(slots=True, frozen=True)
class Beat:
    """The master's answer to a heartbeat: changes in sequence order; ``more`` when others wait."""

    changes: tuple[SegmentChange, ...]
    more: bool
    epoch: int = 0


def record_message(record: ObjectRecord) -> pool_pb2.ObjectRecord:
    return pool_pb2.ObjectRecord(key=record.key, group_id=record.group_id, group_size=record.group_size,
                                 offset=record.offset, size=record.size, checksum=record.checksum,
                                 tenant=record.tenant)


def record_from_message(message: pool_pb2.ObjectRecord) -> ObjectRecord:
    # the tenant as the master sent it: the store hands it back untouched in its next report
    return ObjectRecord(message.key, message.group_id, message.group_size, message.offset, message.size,
                        message.checksum, message.tenant)


def changes_of(response: pool_pb2.HeartbeatResponse) -> tuple[SegmentChange, ...]:
    """A heartbeat's changes, grouped (asked for), packed (a master that does not group) or one message each (a
    master that does neither)."""
    if response.HasField("grouped_changes"):
        return changes_from_grouped(response.grouped_changes)
    if response.HasField("packed_changes"):
        return changes_from_packed(response.packed_changes)
    return tuple(change_from_message(c) for c in response.changes)


def change_from_message(message: pool_pb2.SegmentChange) -> SegmentChange:
    if message.removed_key:
        return SegmentChange(message.sequence, removed_key=message.removed_key)
    return SegmentChange(message.sequence, added=record_from_message(message.added))


_PACKED_FIELDS = ("key", "group_id", "group_size", "offset", "size", "checksum", "tenant")


def changes_from_packed(packed: pool_pb2.PackedChanges) -> tuple[SegmentChange, ...]:
    """``PackedChanges`` as the changes they stand for; fields of unequal lengths are refused, naming the
    first that differs from ``sequence``."""
    count = len(packed.sequence)
    for name in _PACKED_FIELDS:
        if len(getattr(packed, name)) != count:
            raise ValueError(f"packed_changes.{name}: {len(getattr(packed, name))} entries, but "
                             f"packed_changes.sequence has {count}")
    return tuple(
        SegmentChange(sequence, removed_key=key) if not group_size else
        SegmentChange(sequence, added=ObjectRecord(key, group_id, group_size, offset, size, checksum, tenant))
        for sequence, key, group_id, group_size, offset, size, checksum, tenant in zip(
            packed.sequence, packed.key, packed.group_id, packed.group_size, packed.offset, packed.size,
            packed.checksum, packed.tenant))


_ENTRY_FIELDS = ("count", "prefix", "group_id", "group_size", "tenant")
_ADDED_FIELDS = ("offset", "size", "checksum")


def changes_from_grouped(grouped: pool_pb2.GroupedChanges) -> tuple[SegmentChange, ...]:
    """``GroupedChanges`` as the changes they stand for; fields whose lengths disagree are refused, naming the
    field."""
    entries = len(grouped.first)
    for name in _ENTRY_FIELDS:
        if len(getattr(grouped, name)) != entries:
            raise ValueError(f"grouped_changes.{name}: {len(getattr(grouped, name))} entries, but "
                             f"grouped_changes.first has {entries}")
    counts, group_sizes = list(grouped.count), list(grouped.group_size)
    if len(grouped.part) != sum(counts):
        raise ValueError(f"grouped_changes.part: {len(grouped.part)} entries, but grouped_changes.count adds up "
                         f"to {sum(counts)}")
    added = sum(count for count, group_size in zip(counts, group_sizes) if group_size)
    for name in _ADDED_FIELDS:
        if len(getattr(grouped, name)) != added:
            raise ValueError(f"grouped_changes.{name}: {len(getattr(grouped, name))} entries, but the entries "
                             f"that add (group_size > 0) have {added} changes")
    parts, offsets, sizes, checksums = list(grouped.part), list(grouped.offset), list(grouped.size), \
        list(grouped.checksum)
    changes: list[SegmentChange] = []
    at = on = 0  # the next entry's first part, and its first added change's place in offset, size, checksum
    for first, count, prefix, group_id, group_size, tenant in zip(
            grouped.first, counts, grouped.prefix, grouped.group_id, group_sizes, grouped.tenant):
        keys = [prefix + part for part in parts[at:at + count]]
        sequences = range(first, first + count)
        at += count
        if not group_size:
            changes += [SegmentChange(sequence, removed_key=key) for sequence, key in zip(sequences, keys)]
            continue
        changes += [SegmentChange(sequence, added=ObjectRecord(key, group_id, group_size, offset, size, checksum,
                                                               tenant))
                    for sequence, key, offset, size, checksum in zip(
                        sequences, keys, offsets[on:on + count], sizes[on:on + count], checksums[on:on + count])]
        on += count
    return tuple(changes)


class MasterClient:
    """The segment's calls to the master over one channel (the daemon owns and closes the channel)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = pool_pb2_grpc.PoolMasterStub(channel)

    async def mount(self, segment: SegmentMount, records: Sequence[ObjectRecord]) -> Mounted:
        response = await self._stub.MountSegment(
            pool_pb2.MountSegmentRequest(
                segment_id=segment.segment_id, endpoint=segment.endpoint, host=segment.host,
                base_address=segment.base_address, size=segment.size, numa_node=segment.numa_node,
                records=[record_message(r) for r in records],
                shared_memory=shared_memory_message(segment.shared),
            ),
            timeout=RPC_TIMEOUT_S,
        )
        return Mounted(response.sequence, frozenset(response.rejected_keys), response.num_adopted,
                       response.master_incarnation, response.heartbeat_interval_s, response.epoch)

    async def heartbeat(self, segment_id: str, acked_sequence: int, wait_s: float = 0.0) -> Beat:
        """``wait_s``: the master may hold the answer this long for changes (a master with standbys)."""
        request = pool_pb2.HeartbeatRequest(segment_id=segment_id, acked_sequence=acked_sequence,
                                            wait_ms=round(wait_s * 1000), packed=True, grouped=True)
        response = await self._stub.Heartbeat(request, timeout=RPC_TIMEOUT_S + wait_s)
        return Beat(changes_of(response), response.more, response.epoch)

    async def unmount(self, segment_id: str) -> None:
        await self._stub.UnmountSegment(pool_pb2.UnmountSegmentRequest(segment_id=segment_id),
                                        timeout=UNMOUNT_TIMEOUT_S)
