"""Async pool client: batch put from registered memory, batch read into it.

Bytes move by one of two paths, which the core picks per segment from the host the segment declares
(``kvpool.core.pool.paths.byte_path``): a segment on this client's host that offers shared memory is
mapped and copied (``kvpool.pool.memory_moves``); any other goes through the transfer engine,
straight between the caller's registered buffers and store DRAM: one batch transfer per store
segment per call, the segments in parallel (``kvpool.pool.endpoint_batches``). Either way each object
of a read is verified as it lands, and ``bytes_by_path`` counts what each path moved. The master only
sees control messages. Pool conditions (full, unreachable, evicted, corrupted, a store's memory gone)
never raise: a put reports NOT_STORED, a read reports a miss.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from kvpool import service
from kvpool.core.pool.compact import full_keys
from kvpool.core.pool.master_breaker import MasterBreaker
from kvpool.core.pool.put_groups import as_commit_groups, as_groups
from kvpool.core.pool.paths import BytePath, SegmentAccess, byte_path
from kvpool.handoff_messages import shared_memory_from_message, shared_memory_message
from kvpool.pool.endpoint_batches import move_by_endpoint
from kvpool.pool.memory_moves import MemoryMove, move_by_memory
from kvpool.pool.kept_histories import KeptHistories
from kvpool.pool.session_client import MasterSession, session_error
from kvpool.ha.master_link import MasterLink, epoch_of
from kvpool.pool.objects import (
    GroupLocation,
    LookupResult,
    ObjectLocation,
    PutObject,
    PutResult,
    ReadStatus,
    checksums,
)
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool.shared_memory import SegmentMaps
from kvpool.transfer import Move, TransferEngine, local_host_name

log = structlog.get_logger(__name__)

RPC_TIMEOUT_S = 5.0
DEMOTE_BATCH = 4096  # the master takes at most this many names a call
# Lookups fail fast when the master cannot be reached: a lookup that cannot be
# answered now is a miss (the caller computes). A put waits for the master at
# most PUT_WAIT_S: long enough to ride out the channel's reconnect (its backoff
# is capped at RECONNECT_MAX_MS here), so no save made after the master is back
# is lost to a stale connection; short enough that a save during an outage
# gives its pages back quickly (a put that waited the full RPC timeout held the
# caller's memory and newer saves queued behind it). A chunk not stored is
# written back the next time it is a device hit whose group the pool lacks.
PUT_WAIT_S = 2.0
RECONNECT_MAX_MS = 250
# codes that mean "the master could not be reached", not "the master said no"
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# the one call that probes a master known down waits at most this long
PROBE_TIMEOUT_S = 0.05
_RESERVED = pool_pb2.PUT_STATUS_RESERVED
_ALREADY_EXISTS = pool_pb2.PUT_STATUS_ALREADY_EXISTS
# xxh3 hashes this much in well under a millisecond: cheaper inline than a thread hop
INLINE_CHECKSUM_BYTES = 1 << 20
NO_LEADER_TARGET = "unix:/nonexistent/kvpool-no-master-leader-yet"



def _release_done(error: grpc.aio.AioRpcError | None) -> None:
    if error is not None:  # the lease expires on its own
        log.info("pool_release_failed", code=error.code().name, corrupt_groups=0)


# what a master that predates PutStartRequest.groups answers one (it reads no items there)
OLD_EMPTY_PUT = "items: must not be empty"


def put_start_request(items: Sequence[tuple[str, str, int, int]], compact: bool = True,
                      **fields: Any) -> pool_pb2.PutStartRequest:
    """A ``PutStart`` of ``(key, group_id, group_size, size)`` items: as whole groups (``PutGroups``) where they
    are exactly such a put (a save's) and ``compact``, else one ``PutItem`` each."""
    groups = as_groups(items) if compact else None
    if groups is not None:
        group_ids, member_sizes, by_member = groups
        return pool_pb2.PutStartRequest(
            groups=pool_pb2.PutGroups(group_ids=group_ids, member_sizes=member_sizes, by_member=by_member), **fields)
    item = pool_pb2.PutItem
    return pool_pb2.PutStartRequest(
        items=[item(key=k, group_id=g, group_size=n, size=size) for k, g, n, size in items], **fields)


def put_end_request(items: Sequence[tuple[str, int]], compact: bool = True,
                    groups: bool = False) -> pool_pb2.PutEndRequest:
    """The commit of ``(key, checksum)`` pairs, as ``commit`` sends it and ``commit_soon`` rides it: whole
    groups' ids and the checksums where ``groups`` (the master takes them) and the keys are exactly whole
    groups' (``as_commit_groups``: a save's), else two flat arrays (``compact``), else one ``PutCommit`` each (a
    master that predates the arrays)."""
    if groups and compact:
        whole = as_commit_groups([k for k, _ in items])
        if whole is not None:
            group_ids, members, by_member = whole
            return pool_pb2.PutEndRequest(
                groups=pool_pb2.CommitGroups(group_ids=group_ids, members=members, by_member=by_member),
                checksums=[c for _, c in items])
    if compact:
        return pool_pb2.PutEndRequest(keys=[k for k, _ in items], checksums=[c for _, c in items])
    return pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key=k, checksum=c) for k, c in items])


def put_end_failed(error: grpc.aio.AioRpcError, objects: int) -> None:
    """A commit that did not take (the caller revokes its objects)."""
    log.warning("pool_put_end_failed", code=error.code().name, details=error.details(), objects=objects)


def access_from_message(message: pool_pb2.SegmentAccess) -> SegmentAccess:
    shared = shared_memory_from_message(message.shared_memory) if message.HasField("shared_memory") else None
    return SegmentAccess(message.segment_id, message.host, message.base_address, shared)


def access_message(access: SegmentAccess) -> pool_pb2.SegmentAccess:
    return pool_pb2.SegmentAccess(segment_id=access.segment_id, host=access.host, base_address=access.base_address,
                                  shared_memory=shared_memory_message(access.shared))

def put_locations(items: Sequence[tuple[str, str, int, int]], packed: pool_pb2.PackedPutResults,
                  segments: Sequence[pool_pb2.SegmentAccess]) -> list[ObjectLocation | PutResult]:
    """A PutStart's packed answer (``PutStartRequest.packed``) for ``(key, group_id, group_size, size)`` items:
    per item where to write it, or EXISTS, or NOT_STORED. An answer whose arrays do not match the items, or
    that names a segment it does not describe, is malformed (``ValueError``)."""
    statuses, numbers, addresses = list(packed.status), list(packed.segment), list(packed.address)
    if not len(statuses) == len(numbers) == len(addresses) == len(items):
        raise ValueError(f"packed: {len(statuses)}, {len(numbers)} and {len(addresses)} entries for {len(items)} "
                         "items")
    by_number = {s.number: (s.segment_id, s.endpoint) for s in segments}
    reserved: list[ObjectLocation | PutResult] = []
    for i, ((key, _, _, size), status) in enumerate(zip(items, statuses)):
        if status != _RESERVED:
            reserved.append(PutResult.EXISTS if status == _ALREADY_EXISTS else PutResult.NOT_STORED)
            continue
        try:
            segment_id, endpoint = by_number[numbers[i]]
        except KeyError:
            raise ValueError(f"packed.segment[{i}]: segment {numbers[i]} is not in the answer") from None
        reserved.append(ObjectLocation(key, endpoint, addresses[i], size, 0, segment_id))
    return reserved


def packed_groups(packed: pool_pb2.PackedGroups, segments: Sequence[pool_pb2.SegmentAccess],
                  group_ids: Sequence[str] | None = None) -> list[GroupLocation]:
    """A lookup's ``PackedGroups`` as located groups; a member naming a segment the answer does not
    describe is a malformed answer (``ValueError``). ``group_ids``: the answer is compact
    (``LookupResponse.compact``), and these are the ids its groups were asked by, from the first located."""
    by_number = {s.number: (s.segment_id, s.endpoint) for s in segments}
    keys, numbers, addresses = list(packed.key), list(packed.segment), list(packed.address)
    sizes, sums = list(packed.size), list(packed.checksum)
    counts = list(packed.num_members)
    if not (len(keys) == len(numbers) == len(addresses) == len(sizes) == len(sums) == sum(counts)):
        raise ValueError("packed: its arrays disagree in length")
    if group_ids is None:
        ids: Sequence[str] = packed.group_id
        if len(counts) != len(ids):
            raise ValueError("packed: its arrays disagree in length")
    elif len(packed.group_id) or len(counts) > len(group_ids):
        raise ValueError(f"packed: a compact answer of {len(counts)} groups (and {len(packed.group_id)} ids) to "
                         f"{len(group_ids)} asked")
    else:
        ids = group_ids
    groups = []
    i = 0
    for group_id, count in zip(ids, counts):
        if group_ids is not None:
            keys[i:i + count] = full_keys(group_id, keys[i:i + count])
        members = {}
        for j in range(i, i + count):
            try:
                segment_id, endpoint = by_number[numbers[j]]
            except KeyError:
                raise ValueError(f"packed.segment[{j}]: segment {numbers[j]} is not in the answer") from None
            members[keys[j]] = ObjectLocation(keys[j], endpoint, addresses[j], sizes[j], sums[j], segment_id)
        groups.append(GroupLocation(group_id, members))
        i += count
    return groups


def _lookup_request(group_ids: list[str], lease_ms: int, held_prefix: int, handle: int,
                    kept: int) -> pool_pb2.LookupRequest:
    """A lookup of ``group_ids``; with a kept ``handle`` for their first ``kept``, only the ids after them."""
    return pool_pb2.LookupRequest(group_ids=group_ids[kept:] if handle else group_ids, lease_ms=lease_ms,
                                  held_prefix=held_prefix, packed=True, packed_bytes=True, compact=True,
                                  history=handle, history_groups=kept if handle else 0)


class PoolClient:
    """Talks to one pool master and moves bytes by memory with the stores on its host and with one transfer
    engine with the others; without an engine (a one-host cluster opens none) a move that needs one fails
    as any failed move does: a read misses, a put is not stored."""

    def __init__(self, master: str, engine: TransferEngine | None, host_name: str | None = None,
                 engine_only: bool = False) -> None:
        if engine is None and engine_only:
            raise ValueError("engine_only: there is no transfer engine to move every byte with")
        self.master = master
        self.engine = engine
        self.host_name = host_name or local_host_name()
        self.engine_only = engine_only  # every byte by the engine, for comparison
        self.maps = SegmentMaps()  # same-host segments, mapped on first use
        self.accesses: dict[str, SegmentAccess] = {}  # by segment id, as the master's last answers said
        self.bytes_by_path: dict[tuple[str, str], int] = {
            (path.value, direction): 0 for path in BytePath for direction in ("read", "write")}
        options = [o for o in service.GRPC_OPTIONS if o[0] != "grpc.max_reconnect_backoff_ms"]
        options.append(("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS))
        # etcd://HOST:PORT: the leader etcd announces, followed as it changes (kvpool.ha.master_link)
        self.link = MasterLink(master, lambda address: service.channel(address, options))
        # until a leader is known, a channel that reaches nothing: a call is a miss, as with a master down
        self._no_leader = None if self.link.channel is not None else service.channel(NO_LEADER_TARGET, options)
        self._channel = self.link.channel or self._no_leader
        self._stub = pool_pb2_grpc.PoolMasterStub(self._channel)
        # lookups, releases and puts ride one stream (a unary call each costs the master several times more)
        self.session = MasterSession(self._channel, self._stub, self._admit_epoch)
        self.histories = KeptHistories()  # the master's handles for histories found, for their next lookup
        self._regions: list[tuple[int, int]] = []
        # a master known down is answered at once: lookups miss, puts are not stored
        self.breaker = MasterBreaker()
        # puts as whole groups and commits as flat arrays; off for good once a master refuses a put of whole
        # groups as empty (it predates them: it reads no items there)
        self.compact_puts = True
        # commits as whole groups (PutEndRequest.groups): as the master's last put answer says it takes them
        self.commits_groups = False
        self._watch: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # revokes of commits that did not take

    def start(self) -> None:
        """Follow the master from now on (with etcd: watch for the leader and reach it), so a process's first
        request finds it known, rather than missing the pool while the watch starts. Call on the running loop."""
        self._start_watch()

    def _admit_epoch(self, epoch: int) -> bool:
        return self.link.admit(epoch)

    async def connect(self, timeout_s: float = PUT_WAIT_S) -> bool:
        """With etcd: wait (at most ``timeout_s``) for a leader and reach it; true once one is reached (always
        true for a master named by address)."""
        if self.link.watch is None:
            return True
        self._start_watch()
        if not await self.link.connect(timeout_s):
            return False
        if self.link.channel is not self._channel:
            await self._reach_leader()
        return True

    async def _follow_leader(self) -> None:
        """With etcd: move to each new leader as the watch announces it."""
        changed = self.link.changed
        assert changed is not None
        await self.link.connect(0.0)
        while True:
            changed.clear()  # before looking: a change from here on wakes the wait below
            if self.link.stale():
                await self.link.follow()
            if self.link.channel is not None and self.link.channel is not self._channel:
                await self._reach_leader()
            await changed.wait()

    async def _reach_leader(self) -> None:
        """Calls go to the link's channel from now on; calls on the old session fail (a miss, a put not stored)."""
        old_session, old_channel = self.session, self._channel
        assert self.link.channel is not None
        self._channel = self.link.channel
        self._stub = pool_pb2_grpc.PoolMasterStub(self._channel)
        self.session = MasterSession(self._channel, self._stub, self._admit_epoch)
        self.histories.clear()  # the new leader keeps none of the old one's handles
        if self._watch is not None:  # the breaker follows the new channel's connectivity
            self._watch.cancel()
            self._watch = asyncio.get_running_loop().create_task(self._watch_channel())
        self.breaker.success()
        log.info("pool_master_leader_reached", master=self.link.address, epoch=self.link.epoch)
        await old_session.close()
        if old_channel is self._no_leader:  # the link closes the channels it opened
            await old_channel.close()
            self._no_leader = None

    async def close(self) -> None:
        for task in (self._watch, self._follower):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.session.close()
        for task in list(self._background):
            task.cancel()
        if self._no_leader is not None:
            await self._no_leader.close()
        await self.link.close()
        await self.maps.close()

    # ---- the path of each move -------------------------------------------

    def _learn(self, segments: Sequence[pool_pb2.SegmentAccess]) -> None:
        """Keep how each named segment is reached, as the master's answer says now."""
        self.learn([access_from_message(s) for s in segments])

    def learn(self, accesses: Sequence[SegmentAccess]) -> None:
        """Keep how these segments are reached (another stage's lookup passed on with its locations)."""
        for access in accesses:
            self.accesses[access.segment_id] = access

    def accesses_of(self, segment_ids: Collection[str]) -> list[SegmentAccess]:
        """How to reach these segments, as the master's answers said (another stage is sent them)."""
        return [a for segment_id, a in self.accesses.items() if segment_id in segment_ids]

    def _path(self, segment_id: str) -> BytePath:
        return byte_path(self.accesses.get(segment_id), self.host_name, self.engine_only)

    async def _move(self, moves: list[tuple[str, Move]], write: bool,
                    expected: list[int] | None = None) -> list[Any]:
        """Each (segment id, move) by its segment's path, both paths at once; per move what the path says."""
        memory: list[int] = []
        engine: list[int] = []
        for i, (segment_id, _) in enumerate(moves):
            (memory if self._path(segment_id) is BytePath.MEMORY else engine).append(i)

        def want(indices: list[int]) -> list[int] | None:
            return None if expected is None else [expected[i] for i in indices]

        async def by_engine(indices: list[int]) -> list[Any]:
            engine_expected = want(indices)
            if self.engine is None:  # nothing can reach these segments from here
                if indices:
                    log.info("pool_move_needs_engine", moves=len(indices))
                return [False if engine_expected is None else ReadStatus.NOT_READ] * len(indices)
            engine_moves = [moves[i][1] for i in indices]
            if engine_expected is None:
                return await move_by_endpoint(self.engine, engine_moves, write)
            return await move_by_endpoint(self.engine, engine_moves, write, engine_expected)

        by_memory = move_by_memory(
            self.maps, self.accesses,
            [MemoryMove(moves[i][0], moves[i][1].local, moves[i][1].remote, moves[i][1].size) for i in memory],
            write, want(memory))
        memory_done, engine_done = await asyncio.gather(by_memory, by_engine(engine))
        unmapped = [i for i, outcome in zip(memory, memory_done) if outcome is None]
        if unmapped:  # a segment this process cannot map (gone, or out of reach): the engine tries them
            memory = [i for i, outcome in zip(memory, memory_done) if outcome is not None]
            memory_done = [outcome for outcome in memory_done if outcome is not None]
            engine, engine_done = engine + unmapped, list(engine_done) + list(await by_engine(unmapped))
        result: list[Any] = [None] * len(moves)
        direction = "write" if write else "read"
        for path, indices, done in ((BytePath.MEMORY, memory, memory_done), (BytePath.ENGINE, engine, engine_done)):
            for i, outcome in zip(indices, done):
                result[i] = outcome
                if outcome is True or outcome is ReadStatus.VERIFIED:
                    self.bytes_by_path[(path.value, direction)] += moves[i][1].size
        return result

    # ---- the master's reachability ----------------------------------------

    def _start_watch(self) -> None:
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_channel())
        if self.link.watch is not None and self._follower is None:
            self._follower = asyncio.get_running_loop().create_task(self._follow_leader())

    async def _watch_channel(self) -> None:
        """The channel's own connectivity opens and closes the breaker, so no request has to find out."""
        state = self._channel.get_state(try_to_connect=False)
        while True:
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE and not self.breaker.known_down:
                self._failed("channel")
            elif state == grpc.ChannelConnectivity.READY and self.breaker.known_down:
                self.breaker.success()
                log.info("pool_master_reachable", master=self.master)
            await self._channel.wait_for_state_change(state)
            # a channel in failure keeps reconnecting (backoff capped at RECONNECT_MAX_MS)
            state = self._channel.get_state(try_to_connect=self.breaker.known_down)

    def _failed(self, why: str) -> None:
        was_down = self.breaker.known_down
        self.breaker.failure(asyncio.get_running_loop().time())
        if not was_down:
            log.warning("pool_master_unreachable", master=self.master, why=why)

    def _admit(self) -> tuple[bool, bool]:
        """(may call the master now, the call is the probe of a master known down)."""
        self._start_watch()
        probing = self.breaker.known_down
        return self.breaker.allow(asyncio.get_running_loop().time()), probing

    def _outcome(self, exc: grpc.aio.AioRpcError | None) -> None:
        if exc is not None and exc.code() in _UNREACHABLE:
            self._failed(exc.code().name)
        else:
            self.breaker.success()

    def register(self, address: int, size: int) -> None:
        """Register caller memory with the engine (if any) once; puts and reads must stay inside it."""
        if self.engine is not None:
            self.engine.register(address, size)
        self._regions.append((address, address + size))

    # ---- writes ---------------------------------------------------------

    async def put(self, objects: Sequence[PutObject], tenant: str = "") -> list[PutResult]:
        """Store a batch of ``tenant``'s chunks (its share of the pool decides what room
        it may make); per object STORED, EXISTS or NOT_STORED, in order."""
        if not objects:
            return []
        total = 0
        for i, obj in enumerate(objects):
            if obj.size <= 0:
                raise ValueError(f"objects[{i}].size: must be positive, got {obj.size}")
            self._check_registered(obj.address, obj.size, f"objects[{i}]")
            total += obj.size
        # checksums overlap the PutStart round trip; a small batch hashes faster than a thread hop
        sums: list[int] | asyncio.Future[list[int]]
        if total <= INLINE_CHECKSUM_BYTES:
            sums = checksums(objects)
        else:
            sums = asyncio.ensure_future(asyncio.to_thread(checksums, objects))
        try:
            reserved = await self.reserve([(o.key, o.group_id, o.group_size, o.size) for o in objects], tenant)
        except BaseException:
            if isinstance(sums, asyncio.Future):
                await asyncio.gather(sums, return_exceptions=True)
            raise
        results = [r if isinstance(r, PutResult) else PutResult.NOT_STORED for r in reserved]
        located = [(i, r) for i, r in enumerate(reserved) if isinstance(r, ObjectLocation)]
        if not located:
            if isinstance(sums, asyncio.Future):
                await asyncio.gather(sums, return_exceptions=True)
            return results
        indices = [i for i, _ in located]
        written = await self._move([(loc.segment_id, Move(loc.endpoint, objects[i].address, loc.address, loc.size))
                                    for i, loc in located], write=True)
        sums_done = sums if isinstance(sums, list) else await sums
        ok = [i for i, good in zip(indices, written) if good]
        failed = [objects[i].key for i, good in zip(indices, written) if not good]
        if failed:
            await self.revoke(failed)
        if ok and await self.commit([(objects[i].key, sums_done[i]) for i in ok]):
            for i in ok:
                results[i] = PutResult.STORED
        return results

    async def reserve(self, items: Sequence[tuple[str, str, int, int]], tenant: str = "",
                      release: tuple[int, Sequence[str]] | None = None) -> list[ObjectLocation | PutResult]:
        """Reserve room for ``(key, group_id, group_size, size)`` items (one ``PutStart``): per item where to
        write it (an ``ObjectLocation``, checksum 0), or EXISTS, or NOT_STORED (no room, a failed group, the
        master unreachable). Each reserved item must then be committed (``commit``) or revoked (``revoke``);
        a reservation nobody ends is revoked by the master's put timeout. ``release``: a lease (with the
        groups its reader found corrupt) the same call ends, as ``release`` would; a call that fails leaves
        it to expire."""
        not_stored: list[ObjectLocation | PutResult] = [PutResult.NOT_STORED] * len(items)
        if not items:
            return []
        allowed, probing = self._admit()
        if not allowed:
            return not_stored
        lease_id, corrupt = release if release is not None else (0, ())
        try:
            while True:
                request = put_start_request(items, self.compact_puts, client_host=self.host_name, tenant=tenant,
                                            release_lease_id=int(lease_id), release_corrupt_group_ids=list(corrupt),
                                            packed=True)
                try:
                    started = await self.session.call(
                        "put_start", request, self._stub.PutStart,
                        # a probe does not wait for the channel; otherwise ride out a reconnect briefly
                        timeout=PROBE_TIMEOUT_S if probing else PUT_WAIT_S, wait_for_ready=not probing,
                    )
                    break
                except grpc.aio.AioRpcError as exc:
                    if not (request.HasField("groups") and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                            and exc.details() == OLD_EMPTY_PUT):
                        raise
                    # a master that predates whole groups (it read no items; nothing changed): as items from now on
                    log.info("pool_master_predates_compact_puts", details=exc.details())
                    self.compact_puts = False
        except grpc.aio.AioRpcError as exc:
            self._outcome(exc)
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from exc
            log.info("pool_put_not_stored", code=exc.code().name, details=exc.details(), objects=len(items))
            return not_stored
        except asyncio.CancelledError:
            self.breaker.abandoned()
            raise
        self._outcome(None)
        self._learn(started.segments)
        self.commits_groups = started.commits_groups
        if started.HasField("packed"):
            try:
                return put_locations(items, started.packed, started.segments)
            except ValueError as exc:  # the master's answer is not one this client can read: give it all back
                log.error("pool_put_answer_malformed", error=str(exc), objects=len(items))
                await self.revoke([key for key, _, _, _ in items])
                return not_stored
        reserved: list[ObjectLocation | PutResult] = []  # a master that predates packed answers
        for (key, _, _, size), result in zip(items, started.results):
            status = result.status
            if status == _RESERVED:
                location = result.location
                reserved.append(ObjectLocation(key, location.endpoint, location.address, size, 0,
                                               location.segment_id))
            else:
                reserved.append(PutResult.EXISTS if status == _ALREADY_EXISTS else PutResult.NOT_STORED)
        return reserved

    async def write(self, writes: Sequence[tuple[int, ObjectLocation]]) -> list[int | None]:
        """Write reserved objects from local memory (``address``, ``location``: a ``reserve`` answer, perhaps
        another process's): per write the xxh3-64 of the bytes written, or None where the move failed."""
        for i, (address, location) in enumerate(writes):
            self._check_registered(address, location.size, f"writes[{i}]")
        if not writes:
            return []
        objects = [PutObject(loc.key, "", 0, address, loc.size) for address, loc in writes]
        total = sum(loc.size for _, loc in writes)
        sums = (checksums(objects) if total <= INLINE_CHECKSUM_BYTES
                else asyncio.ensure_future(asyncio.to_thread(checksums, objects)))
        try:
            written = await self._move([(loc.segment_id, Move(loc.endpoint, address, loc.address, loc.size))
                                        for address, loc in writes], write=True)
        finally:
            if isinstance(sums, asyncio.Future) and not sums.done():
                await asyncio.gather(sums, return_exceptions=True)
        sums_done = sums if isinstance(sums, list) else sums.result()
        return [s if good else None for s, good in zip(sums_done, written)]

    async def commit(self, items: Sequence[tuple[str, int]]) -> bool:
        """Commit reserved objects written, ``(key, checksum)``, all or none (one ``PutEnd``); on failure
        they are revoked."""
        if not items:
            return True
        try:
            await self.session.call("put_end", put_end_request(items, self.compact_puts, self.commits_groups),
                                    self._stub.PutEnd,
                                    timeout=RPC_TIMEOUT_S)
            return True
        except grpc.aio.AioRpcError as exc:
            # e.g. the master restarted or revoked our put after a timeout
            put_end_failed(exc, len(items))
            await self.revoke([k for k, _ in items])
            return False

    def commit_soon(self, items: Sequence[tuple[str, int]], on_done: Callable[[bool], None] | None = None) -> None:
        """``commit`` that nobody waits for: it rides on this client's next message to the master, or goes on its
        own within a few milliseconds (``kvpool.pool.session_client``: one message fewer a save). ``on_done``
        hears whether it took; when it did not, the objects are revoked, as ``commit``'s are."""
        if not items:
            if on_done is not None:
                on_done(True)
            return
        keys = [k for k, _ in items]

        def done(error: grpc.aio.AioRpcError | None) -> None:
            if error is not None:
                put_end_failed(error, len(keys))
                if error.code() != grpc.StatusCode.CANCELLED:  # (closing: the put timeout gives them back)
                    # (a commit the master took meanwhile stays: a revoke leaves committed keys alone)
                    task = asyncio.get_running_loop().create_task(self.revoke(keys))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
            if on_done is not None:
                on_done(error is None)

        self._start_watch()
        self.session.ride("put_end", put_end_request(items, self.compact_puts, self.commits_groups), done)

    async def revoke(self, keys: Sequence[str]) -> None:
        """Give back reserved objects that will not be written (one ``PutRevoke``; best effort)."""
        if not keys:
            return
        try:
            await self.session.call("put_revoke", pool_pb2.PutRevokeRequest(keys=list(keys)), self._stub.PutRevoke,
                                    timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            # the master's put timeout gives the space back anyway
            log.warning("pool_put_revoke_failed", code=exc.code().name, objects=len(keys))

    # ---- reads ----------------------------------------------------------

    async def lookup(self, group_ids: Sequence[str], lease_ms: int = 0, held_prefix: int = 0) -> LookupResult:
        """Leading complete groups with member locations; an unreachable master is a miss.

        ``held_prefix``: the first so many groups are the caller's own (its device cache): the master
        counts and touches them but neither leases nor locates them (``LookupResult.first``). An older
        master that locates them anyway is answered the same way."""
        if not group_ids:
            return LookupResult([], 0, 0)
        allowed, probing = self._admit()
        if not allowed:
            return LookupResult([], 0, 0)
        group_ids = list(group_ids)
        timeout = PROBE_TIMEOUT_S if probing else RPC_TIMEOUT_S
        handle, kept = self.histories.take(group_ids)
        try:
            response = await self._session("lookup", _lookup_request(group_ids, lease_ms, held_prefix, handle, kept),
                                           self._stub.Lookup, timeout)
            if kept and response.history_groups != kept:
                # not taken: a master that no longer keeps it (that one is gone: take() took it out), or an older
                # one that does not know handles and answered for the ids after it (its lease given back, and
                # none of the handles will do there): every id again
                if not response.history_unknown:
                    self.histories.clear()
                    await self.release(response.lease_id)
                response = await self._session("lookup", _lookup_request(group_ids, lease_ms, held_prefix, 0, 0),
                                               self._stub.Lookup, timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and kept:
                # a master that does not know handles reads the ids after the handle as the whole history, and
                # refuses a held prefix longer than they are: every id again, and no handle from now on there
                log.info("pool_lookup_handle_refused", details=exc.details())
                self.histories.clear()
                return await self.lookup(group_ids, lease_ms, held_prefix)
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from exc
            log.info("pool_lookup_miss", code=exc.code().name, details=exc.details())
            return LookupResult([], 0, 0)
        except asyncio.CancelledError:
            self.breaker.abandoned()
            raise
        self._learn(response.segments)
        if response.history and response.num_complete:
            self.histories.keep(group_ids[:response.num_complete], response.history)
        if response.HasField("packed"):
            try:
                packed = response.packed
                if response.packed_bytes:  # a master that answers packed_bytes
                    packed = pool_pb2.PackedGroups.FromString(response.packed_bytes)
                groups = packed_groups(packed, response.segments,
                                       group_ids[held_prefix:] if response.compact else None)
            except (ValueError, DecodeError) as exc:  # never from a master of this version: a miss, lease given back
                log.warning("pool_lookup_malformed", error=str(exc))
                await self.release(response.lease_id)
                return LookupResult([], 0, 0)
            return LookupResult(groups, response.lease_id, response.lease_ms, held_prefix, response.num_complete)
        groups = []  # a master without the packed form: every found group, from the first
        for g in response.groups:
            members = {}
            for m in g.members:
                key, location = m.key, m.location
                members[key] = ObjectLocation(key, location.endpoint, location.address, location.size, m.checksum,
                                              location.segment_id)
            groups.append(GroupLocation(g.group_id, members))
        first = min(held_prefix, len(groups))
        return LookupResult(groups[first:], response.lease_id, response.lease_ms, first, len(groups))

    async def read(self, items: Sequence[tuple[ObjectLocation, int]]) -> list[bool]:
        """Read each object into the local address given with it; True where it verified."""
        return [s is ReadStatus.VERIFIED for s in await self.read_checked(items)]

    async def read_checked(self, items: Sequence[tuple[ObjectLocation, int]]) -> list[ReadStatus]:
        """Read each object into the local address given with it; per object, whether it
        verified, arrived corrupt, or was not read."""
        for i, (loc, address) in enumerate(items):
            self._check_registered(address, loc.size, f"items[{i}]")
        statuses = await self._move([(loc.segment_id, Move(loc.endpoint, address, loc.address, loc.size))
                                     for loc, address in items], write=False,
                                    expected=[loc.checksum for loc, _ in items])
        bad = [loc.key for status, (loc, _) in zip(statuses, items) if status is not ReadStatus.VERIFIED]
        if bad:
            corrupt = sum(s is ReadStatus.CORRUPT for s in statuses)
            log.warning("pool_read_miss", objects=len(bad), corrupt=corrupt, first_key=bad[0])
        return statuses

    async def release(self, lease_id: int, corrupt_group_ids: Sequence[str] = ()) -> None:
        """End a lease; ``corrupt_group_ids``: its groups whose bytes failed their checksum
        (the master drops them, so the next save stores them afresh)."""
        if lease_id == 0:
            return
        request = pool_pb2.ReleaseLeaseRequest(lease_id=lease_id, corrupt_group_ids=list(corrupt_group_ids))
        if not corrupt_group_ids:  # nobody waits for a clean release: it rides on the next message
            self._start_watch()
            self.session.ride("release_lease", request, _release_done)
            return
        try:
            await self._session("release_lease", request, self._stub.ReleaseLease, RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            # the lease expires on its own; a corrupt group is reported again by its next reader
            log.info("pool_release_failed", code=exc.code().name, corrupt_groups=len(corrupt_group_ids))

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` are committed, this client's own commits that ride (``commit_soon``) included."""
        await self.session.flush()  # (a unary call could overtake them)
        response = await self._call(self._stub.Exists, pool_pb2.ExistsRequest(keys=list(keys)))
        return list(response.exists)

    async def remove(self, group_ids: Sequence[str]) -> tuple[int, list[str]]:
        """Remove whole groups; busy ones are named. This client's own releases that ride are applied first: a
        group whose lease it just released is not busy on its account (a unary call could overtake them)."""
        await self.session.flush()
        response = await self._stub.Remove(pool_pb2.RemoveRequest(group_ids=list(group_ids)), timeout=RPC_TIMEOUT_S)
        return response.num_removed, list(response.busy_group_ids)

    async def demote(self, group_ids: Sequence[str]) -> int:
        """Lower groups to the front of eviction (a session ended), at most the master's batch per call. This
        client's riding releases go first: a release applied after it would touch its groups again."""
        await self.session.flush()
        demoted = 0
        for start in range(0, len(group_ids), DEMOTE_BATCH):
            request = pool_pb2.DemoteRequest(group_ids=list(group_ids[start:start + DEMOTE_BATCH]))
            demoted += (await self._call(self._stub.Demote, request)).num_demoted
        return demoted

    async def stats(self) -> pool_pb2.StatsResponse:
        """The master's counts, after this client's riding releases and commits (a unary call could overtake them)."""
        await self.session.flush()
        return await self._call(self._stub.Stats, pool_pb2.StatsRequest())

    # ---- internals ------------------------------------------------------

    async def _session(self, kind: str, request: Any, unary: Any, timeout: float) -> Any:
        """A call on the session stream (``unary``: its method, for a master without one); every answer tells
        the breaker the master is there."""
        self._start_watch()
        try:
            response = await self.session.call(kind, request, unary, timeout)
        except grpc.aio.AioRpcError as exc:
            self._outcome(exc)
            raise
        self._outcome(None)
        return response

    async def _call(self, method, request):  # type: ignore[no-untyped-def]
        """Idempotent calls (gRPC tries them again: ``kvpool.core.admission.retry``). Every answer tells the breaker
        the master is there."""
        self._start_watch()
        try:
            if self.link.watch is None:
                response = await method(request, timeout=RPC_TIMEOUT_S)
            else:  # with standbys: an answer of an older epoch than one already taken is refused
                call = method(request, timeout=RPC_TIMEOUT_S)
                response = await call
                if not self.link.admit(epoch_of(await call.initial_metadata())):
                    raise session_error(grpc.StatusCode.UNAVAILABLE, "a deposed master answered (older epoch)")
        except grpc.aio.AioRpcError as exc:
            self._outcome(exc)
            raise
        self._outcome(None)
        return response

    def _check_registered(self, address: int, size: int, field_name: str) -> None:
        for start, end in self._regions:
            if start <= address and address + size <= end:
                return
        raise ValueError(f"{field_name}: [{address:#x}, +{size}) is not inside memory registered with this client")
