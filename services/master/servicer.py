"""PoolMaster gRPC servicer: validates at the edge, converts protobuf ↔ index calls."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from itertools import chain, repeat
from operator import attrgetter
from typing import Any

import grpc
import structlog

from kvpool.core.errors import InvalidArgument, KvpoolError, ResourceExhausted, Unavailable
from kvpool.core.pool import fields
from kvpool.core.pool.compact import compact_keys
from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.puts import PlacedGroups
from kvpool.core.pool.put_groups import PLACES as _PLACES, group_items, group_keys
from kvpool.core.tenancy.shares import MAX_TENANT_BYTES, tenant_name
from kvpool.core.pool.records import (
    ChangeRow,
    JournalChanges,
    Group,
    ObjectRecord,
    PutOutcome,
    PutRequestItem,
    PutStatus,
    Segment,
    SegmentChange,
    change_of_row,
    shared,
)
from kvpool.handoff_messages import shared_memory_from_message, shared_memory_message
from kvpool.pool.session_client import ride_items
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool import tracing
from opentelemetry import context as otel_context
from opentelemetry import trace
from kvpool.request_id import bound_request_id, current_request_id, is_sane, served
from kvpool.request_record import RequestRecord
from kvpool.status import rejected, status_errors
from kvpool.services.master.election import HaState
from kvpool.services.master.metrics import MasterMetrics

log = structlog.get_logger(__name__)

MAX_KEY_BYTES = 512
MAX_BATCH = 4096
MAX_RIDES = 256  # calls riding on one Session message (a pool client sends at most 64)
MAX_GROUP_SIZE = 64
MAX_LEASE_MS = 600_000
MAX_WAIT_MS = 60_000  # a heartbeat's long-poll
_ENDPOINT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


def check_name(value: str, field_name: str) -> None:
    if not value:
        raise InvalidArgument(f"{field_name}: must not be empty")
    if len(value.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(f"{field_name}: {len(value.encode())} bytes is longer than {MAX_KEY_BYTES}")


def name_ok(value: str, longest: int = MAX_KEY_BYTES) -> bool:
    """The fast form of :func:`check_name` (no message built), at most ``longest`` bytes; ASCII needs no
    encoding."""
    return 0 < len(value) <= longest and (value.isascii() or len(value.encode()) <= longest)


def check_names(values: Sequence[str], field_name: str, suffix: str = "") -> None:
    """``check_name`` on every entry of a repeated field, naming the first bad one. All ASCII and of sane
    lengths (nearly always) is decided in C, a whole field at once."""
    if names_ok(values):
        return
    for i, value in enumerate(values):
        if not name_ok(value):
            check_name(value, f"{field_name}[{i}]{suffix}")


def put_items(request_items: Sequence[pool_pb2.PutItem], tenant: str) -> list[PutRequestItem]:
    """A PutStart's items, checked: each field a whole column at a time (in C, nearly always enough); the
    precise message, naming the first bad item, only when a column fails."""
    keys = [item.key for item in request_items]
    group_ids = [item.group_id for item in request_items]
    group_sizes = [item.group_size for item in request_items]
    sizes = [item.size for item in request_items]
    if not (names_ok(keys) and names_ok(group_ids) and min(group_sizes) >= 1 and max(group_sizes) <= MAX_GROUP_SIZE
            and min(sizes) > 0):
        for i, item in enumerate(request_items):
            check_put_item(i, item)
    if len(_SIZES) > MAX_SIZES:  # (a caller sending ever new sizes does not grow it without bound)
        _SIZES.clear()
    # one int per distinct size, not one per object: each parsed size is an int of its own, and the index keeps
    # it for the object's life (its record, and the allocator's when the size is aligned): 32 bytes an object
    sizes = list(map(_SIZES.setdefault, sizes, sizes))
    return list(map(PutRequestItem, keys, group_ids, group_sizes, sizes, repeat(tenant)))


def commit_keys(request: pool_pb2.PutEndRequest) -> Sequence[str]:
    """The keys a PutEnd commits, in any form."""
    if request.HasField("groups"):
        groups = request.groups
        return group_keys(groups.group_ids, groups.members, groups.by_member)
    return request.keys if request.keys else [item.key for item in request.items]


def checked_groups(groups: pool_pb2.PutGroups) -> tuple[list[str], list[int]]:
    """A PutStart's whole groups (``PutGroups``), checked: their ids and their members' sizes."""
    member_sizes = list(groups.member_sizes)
    members = len(member_sizes)
    if not 1 <= members <= MAX_GROUP_SIZE:
        if not groups.group_ids:
            raise InvalidArgument("groups.group_ids: must not be empty")
        raise InvalidArgument(f"groups.member_sizes: {members} members is outside 1..{MAX_GROUP_SIZE}")
    group_ids, _ = checked_ids(groups.group_ids, members, "groups")
    for m, size in enumerate(member_sizes):
        if size <= 0:
            raise InvalidArgument(f"groups.member_sizes[{m}]: must be positive, got {size}")
    if len(_SIZES) > MAX_SIZES:
        _SIZES.clear()
    return group_ids, list(map(_SIZES.setdefault, member_sizes, member_sizes))


def checked_ids(ids: Sequence[str], members: int, field: str) -> tuple[list[str], int]:
    """Whole groups' ids (a ``PutGroups`` or a ``CommitGroups``, ``field``) and their member count, checked: some
    ids, each a name whose keys ("<id>/<m>") are names too, none twice, 1..MAX_GROUP_SIZE members."""
    group_ids = list(ids)
    if not group_ids:
        raise InvalidArgument(f"{field}.group_ids: must not be empty")
    if not 1 <= members <= MAX_GROUP_SIZE:
        raise InvalidArgument(f"{field}.members: {members} is outside 1..{MAX_GROUP_SIZE}")
    check_batch(len(group_ids) * members, field)
    longest = MAX_KEY_BYTES - 1 - len(_PLACES[members - 1])  # a key is the id, "/" and its member's place
    if not names_ok(group_ids, longest):
        for i, group_id in enumerate(group_ids):
            check_name(group_id, f"{field}.group_ids[{i}]")
            if len(group_id.encode()) > longest:
                raise InvalidArgument(f"{field}.group_ids[{i}]: its keys would be longer than {MAX_KEY_BYTES} "
                                      "bytes")
    if len(set(group_ids)) != len(group_ids):
        seen: set[str] = set()
        for i, group_id in enumerate(group_ids):
            if group_id in seen:
                raise InvalidArgument(f"{field}.group_ids[{i}]: {group_id!r} named twice")
            seen.add(group_id)
    return group_ids, members


_SIZES: dict[int, int] = {}
MAX_SIZES = 4096


def names_ok(values: Sequence[str], longest: int = MAX_KEY_BYTES) -> bool:
    """Every one of ``values`` passes :func:`name_ok` (decided in C when all are ASCII)."""
    if not values:
        return True
    if min(map(len, values)) > 0 and max(map(len, values)) <= longest and "".join(values).isascii():
        return True
    return all(map(name_ok, values, repeat(longest)))


def check_put_item(i: int, item: pool_pb2.PutItem) -> None:
    check_name(item.key, f"items[{i}].key")
    check_name(item.group_id, f"items[{i}].group_id")
    if not 1 <= item.group_size <= MAX_GROUP_SIZE:
        raise InvalidArgument(f"items[{i}].group_size: {item.group_size} is outside 1..{MAX_GROUP_SIZE}")
    if item.size <= 0:
        raise InvalidArgument(f"items[{i}].size: must be positive, got {item.size}")


def check_record(i: int, record: pool_pb2.ObjectRecord) -> None:
    check_name(record.key, f"records[{i}].key")
    check_name(record.group_id, f"records[{i}].group_id")
    if not 1 <= record.group_size <= MAX_GROUP_SIZE:
        raise InvalidArgument(f"records[{i}].group_size: {record.group_size} is outside 1..{MAX_GROUP_SIZE}")
    if record.size <= 0:
        raise InvalidArgument(f"records[{i}].size: must be positive, got {record.size}")


def record_message(record: ObjectRecord) -> pool_pb2.ObjectRecord:
    return pool_pb2.ObjectRecord(
        key=record.key, group_id=record.group_id, group_size=record.group_size,
        offset=record.offset, size=record.size, checksum=record.checksum, tenant=record.tenant,
    )


def change_message(change: SegmentChange) -> pool_pb2.SegmentChange:
    if change.added is not None:
        return pool_pb2.SegmentChange(sequence=change.sequence, added=record_message(change.added))
    return pool_pb2.SegmentChange(sequence=change.sequence, removed_key=change.removed_key)


def packed_changes(rows: Sequence[ChangeRow]) -> pool_pb2.PackedChanges:
    """A heartbeat's changes as ``PackedChanges``: the journal's rows made into columns in C (a save's 88 commits
    and the evictions beside them were 176 submessages built one by one)."""
    if not rows:
        return pool_pb2.PackedChanges()
    sequence, key, group_id, group_size, offset, size, checksum, tenant = zip(*rows)
    return pool_pb2.PackedChanges(sequence=sequence, key=key, group_id=group_id, group_size=group_size,
                                  offset=offset, size=size, checksum=checksum, tenant=tenant)


def grouped_changes(changes: JournalChanges) -> pool_pb2.GroupedChanges:
    """A heartbeat's changes as ``GroupedChanges``: the journal's columns as they are (a save's chunk is one entry
    of four changes, as is each group it evicts)."""
    return pool_pb2.GroupedChanges(first=changes.first, count=changes.count, prefix=changes.prefix,
                                   group_id=changes.group_id, group_size=changes.group_size, tenant=changes.tenant,
                                   part=changes.part, offset=changes.offset, size=changes.size,
                                   checksum=changes.checksum)


def heartbeat_response(changes: JournalChanges, form: str, **fields: Any) -> pool_pb2.HeartbeatResponse:
    """The answer to a heartbeat, in the form it asked for: "grouped", "packed" or "" (one message a change)."""
    if form == "grouped":
        return pool_pb2.HeartbeatResponse(grouped_changes=grouped_changes(changes), **fields)
    rows = changes.rows()
    if form == "packed":
        return pool_pb2.HeartbeatResponse(packed_changes=packed_changes(rows), **fields)
    return pool_pb2.HeartbeatResponse(changes=[change_message(change_of_row(row)) for row in rows], **fields)


def heartbeat_form(request: pool_pb2.HeartbeatRequest) -> str:
    return "grouped" if request.grouped else "packed" if request.packed else ""


def check_tenant(tenant: str, field_name: str) -> str:
    """The tenant named (bounded: it is a metric label and a key of the index), "" the default one."""
    if len(tenant.encode()) > MAX_TENANT_BYTES:
        raise InvalidArgument(f"{field_name}: longer than {MAX_TENANT_BYTES} bytes")
    return tenant_name(tenant)


def check_batch(count: int, field_name: str) -> None:
    if count == 0:
        raise InvalidArgument(f"{field_name}: must not be empty")
    if count > MAX_BATCH:
        raise InvalidArgument(f"{field_name}: {count} entries is more than {MAX_BATCH} in one call")


def check_corrupt(corrupt: Any, field_name: str) -> None:
    """A reader's corrupt group ids (``ReleaseLease``'s, or those a ``PutStart`` carries): bounded, each a name."""
    if len(corrupt) > MAX_BATCH:
        raise InvalidArgument(f"{field_name}: {len(corrupt)} entries is more than {MAX_BATCH} in one call")
    check_names(corrupt, field_name)


def add_accesses(field: Any, segments: Iterable[Segment]) -> None:
    """How a client reaches each segment a response's locations name: its host, base and shared memory, its
    number (in packed answers) and its endpoint."""
    for segment in segments:
        field.add(segment_id=segment.segment_id, host=segment.host, base_address=segment.base_address,
                  shared_memory=shared_memory_message(segment.shared), number=segment.number,
                  endpoint=segment.endpoint)


def packed_put_results(outcomes: Sequence[PutOutcome]) -> pool_pb2.PutStartResponse:
    """A PutStart's answer as ``PackedPutResults``: three flat arrays filled in C, not a message per item."""
    response = pool_pb2.PutStartResponse()
    packed = response.packed
    packed.status.extend([outcome.status.value for outcome in outcomes])
    segments = [outcome.segment for outcome in outcomes]
    if None in segments:  # not every item reserved: 0, 0 for those
        packed.segment.extend([s.number if s is not None else 0 for s in segments])
        packed.address.extend([s.base_address + o.offset if s is not None else 0 for s, o in zip(segments, outcomes)])
    else:
        packed.segment.extend(map(_NUMBER, segments))  # type: ignore[arg-type]
        packed.address.extend([s.base_address + o.offset for s, o in zip(segments, outcomes)])  # type: ignore
    add_accesses(response.segments, {s.segment_id: s for s in segments if s is not None}.values())
    return response


_NUMBER = attrgetter("number")


def packed_group_results(placed: PlacedGroups, members: int, by_member: bool) -> pool_pb2.PutStartResponse:
    """The answer to a put of whole groups placed at once (``PutTable.put_groups``), as ``packed_put_results``
    answers the items it stands for: every one reserved, in their order (member by member, or group by group),
    each column made in that order at once (not made group by group and reordered)."""
    response = pool_pb2.PutStartResponse()
    packed = response.packed
    segments, offsets = placed.segments, placed.offsets
    packed.status.extend([pool_pb2.PUT_STATUS_RESERVED] * (len(segments) * members))
    numbers = list(map(_NUMBER, segments))
    bases = list(map(_BASE, segments))
    if by_member:
        packed.segment.extend(numbers * members)
        packed.address.extend([base + mine[m] for m in range(members) for base, mine in zip(bases, offsets)])
    else:
        packed.segment.extend([number for number in numbers for _ in range(members)])
        packed.address.extend([base + offset for base, mine in zip(bases, offsets) for offset in mine])
    add_accesses(response.segments, {s.segment_id: s for s in segments}.values())
    return response


_BASE = attrgetter("base_address")


def packed_group(group: Group, segments: dict[str, Segment], compact: bool = False) -> tuple[bytes, tuple[str, ...]]:
    """One complete group's part of a packed lookup answer (``PackedGroups``: packed repeated fields of
    concatenated encodings merge in order), and the ids of the segments it names. Made once per group: the
    index forgets it whenever a member changes (``Group.encoded``, ``Group.compact``). ``compact``: without
    the group's id, and with each key a reader derives as "" (``kvpool.core.pool.compact``)."""
    segment_ids = group.segment_ids
    if compact and not group.whole and group.keys == _PLACES[:len(group.keys)]:
        keys: Sequence[str] = [""] * len(segment_ids)  # each "<group_id>/<place>": the reader derives them all
    else:
        keys = group.full_keys()
        if compact:
            keys = compact_keys(group.group_id, keys)
    named = {segment_id: segments[segment_id] for segment_id in segment_ids}
    if len(named) == 1:  # nearly always: the whole group in one segment
        (segment,) = named.values()
        numbers, base = [segment.number] * len(keys), segment.base_address
        addresses = [base + offset for offset in group.offsets]
    else:
        numbers = [named[s].number for s in segment_ids]
        addresses = [named[s].base_address + offset for s, offset in zip(segment_ids, group.offsets)]
    message = pool_pb2.PackedGroups(
        group_id=() if compact else [group.group_id], num_members=[len(keys)],
        key=keys,
        segment=numbers, address=addresses, size=group.sizes, checksum=group.checksums)
    return message.SerializeToString(), shared(tuple(named))  # (shared: a lookup reads equal ones once)




def _apply(call: Callable[[Any], Any], request: Any) -> None:
    call(request)


def _fail_rides(answer: pool_pb2.SessionResponse, count: int, code: int, message: str, field: str = "") -> None:
    """Every one of a message's ``count`` rides failed, none applied (taken, so the client does not send them
    again as calls)."""
    if count:
        answer.rides_taken = count
        for index in range(count):
            answer.ride_failures.add(index=index, code=code, message=message, field=field)


class PoolMasterServicer(pool_pb2_grpc.PoolMasterServicer):
    """Thin shell over :class:`PoolIndex`; every call runs on the event loop, so the index needs no lock."""

    def __init__(self, index: PoolIndex, incarnation: str, heartbeat_interval_s: float, metrics: MasterMetrics,
                 ha: HaState | None = None) -> None:
        self.index = index
        self.ha = ha  # None: the one master, without etcd
        self.incarnation = incarnation
        self.heartbeat_interval_s = heartbeat_interval_s
        self.metrics = metrics
        self.record = RequestRecord("master")  # each pool operation, with its request id (simulate --validate)
        self.tracer = tracing.tracer()  # a span per Session message of a request, when tracing
        # a Session message's body: the call that answers it, and the unary method it stands for
        self.session_calls = {
            "lookup": (self.lookup, "Lookup"), "release_lease": (self.release_lease, "ReleaseLease"),
            "put_start": (self.put_start, "PutStart"), "put_end": (self.put_end, "PutEnd"),
            "put_revoke": (self.put_revoke, "PutRevoke"),
        }

    # ---- the session stream ------------------------------------------------

    async def Session(self, requests: AsyncIterator[pool_pb2.SessionRequest],
                      context: Any) -> AsyncIterator[pool_pb2.SessionResponse]:
        """Each message answered in order, as its unary method would answer it; an error ends only its own
        call (``SessionResponse.code``), never the stream. Headers go first: the client writes once it has them,
        so a stream refused as it opens (a role check) ends with its own status, not a failed write's.
        With standbys: the headers carry the epoch, and a ``put_end`` is answered once the stores hold its commit
        (out of order: each answer names its call)."""
        if self.ha is None:
            await context.send_initial_metadata(())
            async for message in requests:
                yield self.session_answer(message)
            return
        refusal = self.ha.refusal()
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        await context.send_initial_metadata(self.ha.metadata)
        answers: asyncio.Queue[pool_pb2.SessionResponse | None] = asyncio.Queue()
        reader = asyncio.create_task(self._read_session(requests, answers))
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read_session(self, requests: AsyncIterator[pool_pb2.SessionRequest],
                            answers: asyncio.Queue[pool_pb2.SessionResponse | None]) -> None:
        held: set[asyncio.Task[None]] = set()
        try:
            async for message in requests:
                answer = self.session_answer(message)
                targets = self._commit_targets(commit_keys(message.put_end)) \
                    if not answer.code and message.WhichOneof("body") == "put_end" else None
                if not targets:
                    answers.put_nowait(answer)
                    continue
                task = asyncio.create_task(self._answer_when_durable(answer, targets, answers))
                held.add(task)
                task.add_done_callback(held.discard)
            if held:
                await asyncio.gather(*held, return_exceptions=True)
        finally:
            for task in held:
                task.cancel()
            answers.put_nowait(None)

    async def _answer_when_durable(self, answer: pool_pb2.SessionResponse, targets: dict[str, int],
                                   answers: asyncio.Queue[pool_pb2.SessionResponse | None]) -> None:
        assert self.ha is not None
        try:
            await self.ha.waiters.durable(targets)
        except Unavailable as exc:
            answer.ClearField("put_end")
            answer.code, answer.message, answer.field = grpc.StatusCode.UNAVAILABLE.value[0], str(exc), "items"
        answers.put_nowait(answer)

    def _commit_targets(self, keys: Iterable[str]) -> dict[str, int]:
        """Per segment, the journal sequence its store must hold for these committed keys to be durable."""
        targets: dict[str, int] = {}
        owner, segments = self.index.owner, self.index.segments
        for key in keys:
            found = owner(key)
            if found is None:
                continue
            group, position = found
            segment_id = group.segment_ids[position]
            if group.committed(position) and segment_id not in targets:
                segment = segments.get(segment_id)
                if segment is not None and segment.journal.acked < segment.journal.sequence:
                    targets[segment_id] = segment.journal.sequence
        return targets

    async def leading(self, context: Any) -> None:
        """With standbys: refuse unless this master leads now, and tell the caller its epoch."""
        if self.ha is None:
            return
        refusal = self.ha.refusal()
        if refusal is not None:
            raise Unavailable(refusal, field="")
        await context.send_initial_metadata(self.ha.metadata)

    def session_answer(self, message: pool_pb2.SessionRequest) -> pool_pb2.SessionResponse:
        answer = pool_pb2.SessionResponse(call=message.call)
        kind = message.WhichOneof("body")
        rides = message.rides
        if self.ha is not None and (refusal := self.ha.refusal()) is not None:
            answer.code, answer.message = grpc.StatusCode.UNAVAILABLE.value[0], refusal
            _fail_rides(answer, len(rides), answer.code, refusal)  # not applied: each as its unary call would
            return answer
        if rides:
            self._ride(answer, rides)
            if kind is None:  # the client flushing its rides
                return answer
        if kind is None:
            error = InvalidArgument("body: names no call (lookup, release_lease, put_start, put_end or put_revoke)",
                                    field="body")
            answer.code, answer.message, answer.field = rejected(error, "Session").value[0], str(error), "body"
            return answer
        code, text, field = self._served(message, kind, lambda call, request: self._answer(answer, kind, call, request))
        if code:
            answer.code, answer.message, answer.field = code, text, field
        return answer

    def _served(self, message: Any, kind: str, apply: Callable[[Any, Any], None]) -> tuple[int, str, str]:
        """Serve one call of a Session message (its body, or a ride: ``message`` carries its request id and
        span) as a unary call's interceptors would: the id bound, one access-log line, a span when tracing.
        ``apply(handler, request)``; returns the status (0 when it succeeded), its message and its field."""
        call, name = self.session_calls[kind]
        request_id = message.request_id if message.request_id and is_sane(message.request_id) else ""
        span = token = None
        if self.tracer is not None and (request_id or message.traceparent):
            span = tracing.session_span(self.tracer, f"/kvpool.rpc.PoolMaster/{name}", request_id,
                                        message.traceparent, message.sent, message.detached, time.time_ns())
            token = otel_context.attach(trace.set_span_in_context(span.span))  # its logs name the trace
        code, text, field = 0, "", ""
        try:
            if request_id:  # as a unary call's interceptor does: the id bound, and one access-log line
                with bound_request_id(request_id), served(f"/kvpool.rpc.PoolMaster/{name}"):
                    apply(call, getattr(message, kind))
            else:
                apply(call, getattr(message, kind))
        except KvpoolError as exc:
            code, text, field = rejected(exc, name).value[0], str(exc), exc.field or ""
        except Exception:  # a bug: this call fails as a unary one would (UNKNOWN); the stream goes on
            log.exception("session_call_failed", method=name)
            code, text = grpc.StatusCode.UNKNOWN.value[0], f"{name}: internal error"
        if span is not None:
            otel_context.detach(token)
            span.replied()
            span.end(RuntimeError(text) if code else None)
        return code, text, field

    def _ride(self, answer: pool_pb2.SessionResponse, rides: Any) -> None:
        """Apply a message's rides in order (calls nobody waits for: a release, a commit), each under its own
        request id; a failure is answered in ``ride_failures`` and stops neither the others nor the body."""
        answer.rides_taken = len(rides)
        # bounded as one call is: a message's rides hold the loop no longer than a full batch would
        items = sum(map(ride_items, rides))
        if len(rides) > MAX_RIDES or items > MAX_BATCH:  # none applied: each fails
            error = InvalidArgument(f"rides: {len(rides)} rides of {items} items in all is more than "
                                    f"{MAX_RIDES} rides or {MAX_BATCH} items on one message", field="rides")
            _fail_rides(answer, len(rides), rejected(error, "Session").value[0], str(error), "rides")
            return
        for index, ride in enumerate(rides):
            kind = ride.WhichOneof("body")
            if kind is None:
                answer.ride_failures.add(index=index, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                         message=f"rides[{index}].body: names no call (release_lease or put_end)",
                                         field=f"rides[{index}].body")
                continue
            code, text, field = self._served(ride, kind, _apply)
            if code:
                answer.ride_failures.add(index=index, code=code, message=f"rides[{index}]: {text}",
                                         field=f"rides[{index}].{field}" if field else f"rides[{index}]")

    @staticmethod
    def _answer(answer: pool_pb2.SessionResponse, kind: str, call: Any, request: Any) -> None:
        if kind == "lookup":  # the largest answer: filled in place, not copied
            call(request, answer.lookup)
            answer.lookup.SetInParent()  # present though every field is zero (nothing found)
        else:
            getattr(answer, kind).CopyFrom(call(request))

    # ---- segments -------------------------------------------------------

    @status_errors
    async def MountSegment(self, request: pool_pb2.MountSegmentRequest, context: Any) -> pool_pb2.MountSegmentResponse:
        check_name(request.segment_id, "segment_id")
        # no endpoint: a store without a transfer engine, reached only by its host's shared memory
        if request.endpoint and not _ENDPOINT.match(request.endpoint):
            raise InvalidArgument(f"endpoint: {request.endpoint!r} is not host:port")
        if not request.endpoint and not request.HasField("shared_memory"):
            raise InvalidArgument("endpoint: '' is not host:port (a segment without a transfer engine needs "
                                  "shared_memory)")
        if request.size <= 0:
            raise InvalidArgument(f"size: must be positive, got {request.size}")
        if request.base_address == 0:
            raise InvalidArgument("base_address: must not be zero")
        records = []
        for i, r in enumerate(request.records):
            check_record(i, r)
            tenant = check_tenant(r.tenant, f"records[{i}].tenant")
            records.append(ObjectRecord(r.key, r.group_id, r.group_size, r.offset, r.size, r.checksum, tenant))
        shared = shared_memory_from_message(request.shared_memory) if request.HasField("shared_memory") else None
        if shared is not None:
            shared.check("shared_memory")
        await self.leading(context)
        result = self.index.mount_segment(
            request.segment_id, request.endpoint, request.host, request.base_address, request.size, request.numa_node,
            records, shared,
        )
        log.info(
            "segment_mounted" if result.fresh else "segment_remounted",
            segment_id=request.segment_id,
            endpoint=request.endpoint,
            host=request.host,
            size=request.size,
            numa_node=request.numa_node,
            shared_memory=shared.socket_path if shared is not None else None,
            reported=len(records),
            adopted=result.adopted,
            rejected=len(result.rejected_keys),
        )
        return pool_pb2.MountSegmentResponse(
            master_incarnation=self.incarnation, heartbeat_interval_s=self.heartbeat_interval_s,
            rejected_keys=result.rejected_keys, sequence=result.sequence, num_adopted=result.adopted,
            epoch=self.ha.epoch if self.ha is not None else 0,
        )

    @status_errors
    async def UnmountSegment(self, request: pool_pb2.UnmountSegmentRequest, context: Any) -> pool_pb2.UnmountSegmentResponse:
        check_name(request.segment_id, "segment_id")
        await self.leading(context)
        dropped = self.index.unmount_segment(request.segment_id)
        if self.ha is not None:
            self.ha.waiters.dropped(request.segment_id)
        log.info("segment_unmounted", segment_id=request.segment_id, objects_dropped=dropped)
        return pool_pb2.UnmountSegmentResponse(objects_dropped=dropped)

    @status_errors
    async def Heartbeat(self, request: pool_pb2.HeartbeatRequest, context: Any) -> pool_pb2.HeartbeatResponse:
        check_name(request.segment_id, "segment_id")
        if request.wait_ms > MAX_WAIT_MS:
            raise InvalidArgument(f"wait_ms: {request.wait_ms} is more than {MAX_WAIT_MS}")
        form = heartbeat_form(request)
        if self.ha is None:
            changes, more = self.index.heartbeat_changes(request.segment_id, request.acked_sequence)
            return heartbeat_response(changes, form, master_incarnation=self.incarnation, more=more)
        await self.leading(context)
        index = self.index
        changes, more = index.heartbeat_changes(request.segment_id, request.acked_sequence)
        self.ha.waiters.acked(request.segment_id, index.segments[request.segment_id].journal.acked)
        if not changes and request.wait_ms:  # long-poll: answer as soon as a commit waits for this store
            await self.ha.waiters.hold(request.segment_id, False, request.wait_ms / 1000)
            if self.index is not index or self.ha.refusal() is not None:
                raise Unavailable(self.ha.refusal() or "master: a new term began while the heartbeat waited")
            changes, more = index.heartbeat_changes(request.segment_id, request.acked_sequence)
        return heartbeat_response(changes, form, master_incarnation=self.incarnation, more=more,
                                  epoch=self.ha.epoch)

    # ---- writes ---------------------------------------------------------

    @status_errors
    async def PutStart(self, request: pool_pb2.PutStartRequest, context: Any) -> pool_pb2.PutStartResponse:
        await self.leading(context)
        return self.put_start(request)

    def put_start(self, request: pool_pb2.PutStartRequest) -> pool_pb2.PutStartResponse:
        response = self._put_start(request)
        response.commits_groups = True  # its commit may come as whole groups (PutEndRequest.groups)
        return response

    def _put_start(self, request: pool_pb2.PutStartRequest) -> pool_pb2.PutStartResponse:
        grouped = request.HasField("groups")
        if grouped and request.items:
            raise InvalidArgument("groups: given with items (a put sends one or the other)")
        if not grouped:
            check_batch(len(request.items), "items")
        tenant = check_tenant(request.tenant, "tenant")
        if grouped:
            group_ids, member_sizes = checked_groups(request.groups)
        else:
            items = put_items(request.items, tenant)
        corrupt = request.release_corrupt_group_ids
        if corrupt and not request.release_lease_id:
            raise InvalidArgument("release_corrupt_group_ids: given without release_lease_id")
        check_corrupt(corrupt, "release_corrupt_group_ids")  # before anything changes
        corrupt_ids = frozenset(corrupt) if corrupt else frozenset()
        evicted_before = self.index.counters.evicted_groups
        if grouped and request.packed:
            # new groups with room: placed a group at a time, with no item made (none made here either), after
            # what their items would evict past the watermark
            placed = self.index.put_groups(request.client_host, group_ids, member_sizes, request.groups.by_member,
                                           tenant, request.release_lease_id, corrupt_ids)
            if placed is not None:
                self._started(group_ids[0] + "/0", len(group_ids) * len(member_sizes),
                              self.index.counters.evicted_groups - evicted_before, request.release_lease_id, corrupt)
                return packed_group_results(placed, len(member_sizes), request.groups.by_member)
        if grouped:
            keys, ids, sizes = group_items(group_ids, member_sizes, request.groups.by_member)
            items = list(map(PutRequestItem, keys, ids, repeat(len(member_sizes)), sizes, repeat(tenant)))
        # the restore this save follows read first: its read is a use before this put (PoolIndex.put_start)
        outcomes = self.index.put_start(request.client_host, items, request.release_lease_id, corrupt_ids)
        self._started(items[0].key, len(items), self.index.counters.evicted_groups - evicted_before,
                      request.release_lease_id, corrupt)
        if all(o.status is PutStatus.NO_SPACE for o in outcomes):
            raise ResourceExhausted(
                f"items: no space for {len(items)} objects (pool {self.index.used_bytes}/"
                f"{self.index.capacity} bytes used, nothing evictable)"
            )
        if request.packed:
            return packed_put_results(outcomes)
        response = pool_pb2.PutStartResponse()
        add = response.results.add
        named: dict[str, Segment] = {}
        for outcome, item in zip(outcomes, items):
            segment = outcome.segment
            if segment is None:
                add(status=outcome.status.value)
                continue
            # setting fields on one fetched submessage is the cheapest way to fill it
            location = add(status=outcome.status.value).location
            location.segment_id = segment.segment_id
            location.endpoint = segment.endpoint
            location.address = segment.base_address + outcome.offset
            location.size = item.size
            named[segment.segment_id] = segment
        add_accesses(response.segments, named.values())
        return response

    def _started(self, first_key: str, num_items: int, evicted: int, release_lease_id: int, corrupt: Any) -> None:
        """What follows a put's start: its log and record, then the end of the lease it carries."""
        if evicted:
            log.info("groups_evicted", count=evicted)
        # the master's order of operations (kvpool simulate --validate follows it); a no-op unless debug
        log.debug("pool_op", op="put_start", first_key=first_key, items=num_items, evicted=evicted)
        self.record.write("pool_op", current_request_id(), op="put_start", first_key=first_key, items=num_items,
                          evicted=evicted)
        if release_lease_id:  # and its lease ends after the put, whose eviction spared what it read
            self._release(release_lease_id, corrupt, via="put_start")

    @status_errors
    async def PutEnd(self, request: pool_pb2.PutEndRequest, context: Any) -> pool_pb2.PutEndResponse:
        if self.ha is None:
            return self.put_end(request)
        await self.leading(context)
        response = self.put_end(request)
        targets = self._commit_targets(commit_keys(request))
        if targets:
            await self.ha.waiters.durable(targets)
        return response

    def put_end(self, request: pool_pb2.PutEndRequest) -> pool_pb2.PutEndResponse:
        if request.HasField("groups"):  # whole groups: an entry a group
            if request.items or request.keys:
                raise InvalidArgument("groups: given with items or keys (a commit sends one form)")
            group_ids, members = checked_ids(request.groups.group_ids, request.groups.members, "groups")
            if len(request.checksums) != len(group_ids) * members:
                raise InvalidArgument(f"checksums: {len(request.checksums)} entries, but groups stand for "
                                      f"{len(group_ids) * members} keys")
            committed = self.index.put_end_groups(group_ids, members, request.groups.by_member,
                                                  list(request.checksums), "groups (key {})")
            first_key = group_ids[0] + "/0"
        else:
            if request.keys or request.checksums:  # two flat arrays
                if request.items:
                    raise InvalidArgument("keys: given with items (a commit sends one or the other)")
                keys = list(request.keys)
                check_batch(len(keys), "keys")
                if len(request.checksums) != len(keys):
                    raise InvalidArgument(f"checksums: {len(request.checksums)} entries, but keys has {len(keys)}")
                check_names(keys, "keys")
                commits, field = list(zip(keys, request.checksums)), "keys[{}]"
            else:
                check_batch(len(request.items), "items")
                commits, field = [(item.key, item.checksum) for item in request.items], "items[{}].key"
                check_names([key for key, _ in commits], "items", ".key")
            committed = self.index.put_end(commits, field)
            first_key = commits[0][0]
        log.debug("pool_op", op="put_end", first_key=first_key, items=committed)
        self.record.write("pool_op", current_request_id(), op="put_end", first_key=first_key, items=committed)
        return pool_pb2.PutEndResponse(num_committed=committed)

    @status_errors
    async def PutRevoke(self, request: pool_pb2.PutRevokeRequest, context: Any) -> pool_pb2.PutRevokeResponse:
        await self.leading(context)
        return self.put_revoke(request)

    def put_revoke(self, request: pool_pb2.PutRevokeRequest) -> pool_pb2.PutRevokeResponse:
        check_batch(len(request.keys), "keys")
        check_names(request.keys, "keys")
        revoked = self.index.put_revoke(request.keys)
        log.debug("pool_op", op="put_revoke", first_key=request.keys[0], items=revoked)
        return pool_pb2.PutRevokeResponse(num_revoked=revoked)

    # ---- reads ----------------------------------------------------------

    @status_errors
    async def Lookup(self, request: pool_pb2.LookupRequest, context: Any) -> pool_pb2.LookupResponse:
        await self.leading(context)
        return self.lookup(request)

    def lookup(self, request: pool_pb2.LookupRequest,
               response: pool_pb2.LookupResponse | None = None) -> pool_pb2.LookupResponse:
        """``response``: a message to fill (a session's answer), else a new one."""
        group_ids = request.group_ids
        if self.ha is not None and not self.ha.lookups_open(frozenset(self.index.segments)):
            raise Unavailable("master: a new leader is adopting the stores' block reports (a miss: compute)",
                              field="")
        history, kept = request.history, request.history_groups
        if bool(history) != bool(kept):
            raise InvalidArgument(f"history_groups: {kept} with history {history} (both are given, or neither)")
        if not group_ids and not kept:
            raise InvalidArgument("group_ids: must not be empty")
        check_batch(len(group_ids) + kept, "group_ids")  # (with the handle's groups)
        check_names(group_ids, "group_ids")
        if not 0 <= request.lease_ms <= MAX_LEASE_MS:
            raise InvalidArgument(f"lease_ms: {request.lease_ms} is outside 0..{MAX_LEASE_MS}")
        num_groups = len(group_ids) + kept
        if request.held_prefix > num_groups:
            raise InvalidArgument(f"held_prefix: {request.held_prefix} is more than the {num_groups} group ids")
        lease_s = request.lease_ms / 1000 if request.lease_ms else None
        result = self.index.lookup(group_ids, lease_s, request.held_prefix, history, kept)
        log.debug("pool_op", op="lookup", groups=num_groups, complete=result.num_found, lease_id=result.lease_id,
                  history=bool(history))
        self.record.write("pool_op", current_request_id(), op="lookup", groups=num_groups,
                          complete=result.num_found)
        if response is None:
            response = pool_pb2.LookupResponse()
        response.num_complete, response.lease_id = result.num_found, result.lease_id
        response.lease_ms = round(result.lease_s * 1000)
        response.history, response.history_unknown = result.history, result.unknown_history
        if history and not result.unknown_history:
            response.history_groups = kept
        if request.packed:
            add_accesses(response.segments, self._packed(response, result.groups, request.packed_bytes,
                                                                 request.compact))
        else:
            add_accesses(response.segments, self._groups(response, result.groups))
        self.metrics.observe_lookup(num_groups, result.num_found)
        return response

    def _packed(self, response: pool_pb2.LookupResponse, groups: list[Group], as_bytes: bool,
                compact: bool) -> Iterable[Segment]:
        """The located groups as ``PackedGroups``: each group's encoding made once and joined, as bytes
        (``as_bytes``: never parsed here) or parsed in C into ``packed``; ``compact``: in the compact form."""
        segments = self.index.segments
        encodings = fields.values(groups, Group, "compact" if compact else "encoded")
        if None in encodings:  # (by identity first: a tuple never equals None) groups no lookup found yet
            for i, group in enumerate(groups):
                if encodings[i] is None:
                    encodings[i] = packed_group(group, segments, compact)
                    if compact:
                        group.compact = encodings[i]
                    else:
                        group.encoded = encodings[i]
        response.packed.SetInParent()  # present even when empty: this master answered in the packed form
        response.compact = compact
        if not encodings:
            return []
        joined, named = fields.join_pairs(encodings)
        if as_bytes:
            response.packed_bytes = joined
        else:
            response.packed.MergeFromString(joined)
        return [segments[s] for s in sorted(named)]

    def _groups(self, response: pool_pb2.LookupResponse, groups: list[Group]) -> Iterable[Segment]:
        """The located groups, one message per object (a client that did not ask for ``packed``)."""
        segments = self.index.segments
        named: dict[str, Segment] = {}
        add_group = response.groups.add
        for group in groups:
            add_member = add_group(group_id=group.group_id).members.add
            for key, segment_id, offset, size, checksum in zip(group.full_keys(), group.segment_ids, group.offsets,
                                                               group.sizes, group.checksums):
                segment = named[segment_id] = segments[segment_id]
                location = add_member(key=key, checksum=checksum).location
                location.segment_id = segment_id
                location.endpoint = segment.endpoint
                location.address = segment.base_address + offset
                location.size = size
        return named.values()

    @status_errors
    async def ReleaseLease(self, request: pool_pb2.ReleaseLeaseRequest, context: Any) -> pool_pb2.ReleaseLeaseResponse:
        await self.leading(context)
        return self.release_lease(request)

    def release_lease(self, request: pool_pb2.ReleaseLeaseRequest) -> pool_pb2.ReleaseLeaseResponse:
        check_corrupt(request.corrupt_group_ids, "corrupt_group_ids")
        return pool_pb2.ReleaseLeaseResponse(released=self._release(request.lease_id, request.corrupt_group_ids))

    def _release(self, lease_id: int, corrupt: Any, via: str = "") -> bool:
        """End a lease (``ReleaseLease``, or a ``PutStart`` that carries it: ``via``) with its corrupt groups,
        already checked (``check_corrupt``)."""
        extra = {"via": via} if via else {}
        if not corrupt:
            released = self.index.release_lease(lease_id)
            log.debug("pool_op", op="release", lease_id=lease_id, released=released, **extra)
            self.record.write("pool_op", current_request_id(), op="release", released=released, **extra)
            return released
        before = self.index.counters.corrupt_groups
        released = self.index.release_lease(lease_id, frozenset(corrupt))
        # a reader got these groups' bytes but not their checksums: the pool's copies are bad
        log.warning("corrupt_groups_reported", lease_id=lease_id, count=len(corrupt),
                    first_group_id=corrupt[0], dropped=self.index.counters.corrupt_groups - before,
                    lease_known=released)
        self.record.write("pool_op", current_request_id(), op="release", released=released, **extra)
        return released

    @status_errors
    async def Exists(self, request: pool_pb2.ExistsRequest, context: Any) -> pool_pb2.ExistsResponse:
        await self.leading(context)
        check_batch(len(request.keys), "keys")
        check_names(request.keys, "keys")
        return pool_pb2.ExistsResponse(exists=self.index.exists(request.keys))

    @status_errors
    async def Remove(self, request: pool_pb2.RemoveRequest, context: Any) -> pool_pb2.RemoveResponse:
        await self.leading(context)
        check_batch(len(request.group_ids), "group_ids")
        check_names(request.group_ids, "group_ids")
        removed, busy = self.index.remove(request.group_ids)
        return pool_pb2.RemoveResponse(num_removed=removed, busy_group_ids=busy)

    @status_errors
    async def Demote(self, request: pool_pb2.DemoteRequest, context: Any) -> pool_pb2.DemoteResponse:
        await self.leading(context)
        check_batch(len(request.group_ids), "group_ids")
        check_names(request.group_ids, "group_ids")
        return pool_pb2.DemoteResponse(num_demoted=self.index.demote(request.group_ids))

    @status_errors
    async def Stats(self, request: pool_pb2.StatsRequest, context: Any) -> pool_pb2.StatsResponse:
        await self.leading(context)
        return stats_message(self.index, self.incarnation)


def stats_message(index: PoolIndex, incarnation: str) -> pool_pb2.StatsResponse:
    response = pool_pb2.StatsResponse(
        capacity_bytes=index.capacity,
        used_bytes=index.used_bytes,
        num_objects=index.num_objects,
        num_groups=len(index.groups),
        num_complete_groups=index.group_table.num_complete,
        num_puts_in_flight=index.num_in_flight,
        num_leases=index.num_leases,
        evicted_groups=index.counters.evicted_groups,
        evicted_bytes=index.counters.evicted_bytes,
        revoked_puts=index.counters.revoked_puts,
        high_watermark=index.settings.high_watermark,
        low_watermark=index.settings.low_watermark,
        master_incarnation=incarnation,
        failed_groups=index.counters.failed_groups,
        adopted_objects=index.counters.adopted_objects,
        rejected_records=index.counters.rejected_records,
        abandoned_groups=index.counters.abandoned_groups,
        index_order="c" if index.group_table.native else "python",
    )
    by_tenant = index.counters.evicted_groups_by_tenant
    held = index.tenant_bytes
    shares = index.shares.shares(held, next(iter(held), "default"), index.share_capacity) if held else {}
    for tenant in sorted(set(held) | set(by_tenant)):
        response.tenants.add(tenant=tenant, bytes=held.get(tenant, 0), num_groups=len(index.tenant_groups(tenant)),
                             evicted_groups=by_tenant.get(tenant, 0), share_bytes=int(shares.get(tenant, 0)))
    for segment in sorted(index.segments.values(), key=lambda s: s.segment_id):
        response.segments.add(
            segment_id=segment.segment_id,
            endpoint=segment.endpoint,
            host=segment.host,
            numa_node=segment.numa_node,
            capacity_bytes=segment.size,
            used_bytes=segment.allocator.used_bytes,
            num_objects=segment.num_objects,
            largest_free_bytes=segment.allocator.largest_free,
            sequence=segment.journal.sequence,
            acked_sequence=segment.journal.acked,
        )
    return response
