"""The prefill side of the handoff: every stage streams its layers to decode as its forward passes them.

``StageHandoff`` (every stage): for a request with a target, ``begin`` a
``RequestWrites``; the stage's Forward hands it each token range whose KV is
final (the restored prefix at once, then each piece of the forward as it
ends, the last stage also the final logits). Each range is gathered from the
pages into one slab of the stage's registered handoff arena and written in
the layout's transfers (one per layer, at most 8 MiB each) into the stage's
part of decode's region (``kvpool.handoff``), then decode is told
(``Decode.Landed``) and scatters it into the request's pages while prefill
goes on. Stage 0 collects every stage's figures after the forward
(``HandoffDone``), which also raises a stage's write failure.

Same host (``handoff_path``: the target names this stage's declared host and
decode's arena as shared memory, and ``--handoff-path`` is ``auto``): the
stage maps decode's arena once (``SegmentMaps``, cached) and gathers each
range straight into the region, no slab and no engine. It makes no call to
decode: right before each copy it reads the region's fence in its control
record (``kvpool.core.handoff.control``) and copies only while the fence holds
the region's id; after it, it publishes how far its landed ranges reach and
rings decode's doorbell, and decode scatters them. A decode that offers no
control record or no doorbell (an older one) is asked and told with
``Decode.Landed`` as above. An arena that cannot be mapped (decode gone or
restarted) fails the handoff as a failed engine write does. Bytes are counted per path
(``kvpool_prefill_handoff_bytes_total{path}``).

A stage without a transfer engine (``--no-transfer-engine``) has no handoff
arena and writes by memory only: a target its path decision sends to the
engine (decode on another host, or offering no shared memory) is refused
UNAVAILABLE naming the target before any work, and one whose arena turns out
out of reach fails the same way.

Invariants: nothing is written before the whole target checked out (stage
0, before any work); nothing is written into a region decode no longer holds
for it (its fence read, or decode asked, right before each write or copy); a slab is freed only
after the engine stopped reading it; a mapping is pinned while a copy writes
it; the writes of a request run to their end even if its caller goes away
(the pages they read stay the request's until stage 0 has them all done).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import structlog
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvpool.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvpoolError,
    ResourceExhausted,
    Unavailable,
)
from kvpool.core.handoff.control import RECORD_BYTES, ControlRecords, Frontier, fresh_nonce
from kvpool.core.handoff.layout import HandoffLayout, RangeTransfer, range_transfers, transfer_plan
from kvpool.core.handoff.target import HandoffTarget, StageHandoffFigures, check_target, handoff_path
from kvpool.core.pool.paths import BytePath
from kvpool.handoff import gather_range, gather_range_into, memory_tensor, region_range
from kvpool.services.prefill.arena import Arena
from kvpool.services.prefill.decode_client import LandedClient
from kvpool.services.prefill.stage_runner import StageRunner
from kvpool.shared_memory import MappedSegment, OutOfReach, SegmentMaps, SharedMemoryUnavailable
from kvpool.transfer import local_host_name

log = structlog.get_logger(__name__)

ARENA_WAIT_S = 30.0  # for room in the handoff arena, at most
# finished handoffs nobody asked about (stage 0 gone) are forgotten past this many
MAX_FINISHED = 1024
INLINE_COPY_BYTES = 1 << 20  # a same-host copy this small runs on the event loop (about 0.1 ms)
_SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class ArenaOutOfReach(Exception):
    """Decode's arena is on this host but its socket is not within this process's reach."""


class RegionClosed(Exception):
    """The region's fence is down: decode gave it back, it expired, or its Generate claimed it."""


def control_region_id(target: HandoffTarget, arena_bytes: int, region_offset: int) -> int | None:
    """The region id whose control record ``target`` points at, when it points at one that lies inside the
    mapped arena and outside the region; None when the target has none (an older decode)."""
    record = target.control_offset
    if not record:
        return None
    if record + RECORD_BYTES > arena_bytes or record < region_offset + target.layout.nbytes and \
            region_offset < record + RECORD_BYTES:
        raise InvalidArgument(f"target.control_offset: {record} is not a control record outside the region "
                              f"in decode's shared arena of {arena_bytes} bytes")
    try:
        region_id = int(target.region_id)
    except ValueError:
        raise InvalidArgument(f"target.region_id: {target.region_id!r} is not a number, and the target has a "
                              "control record") from None
    if region_id <= 0:
        raise InvalidArgument(f"target.region_id: {region_id} must be positive")
    return region_id


@contextlib.contextmanager
def control_record(mapped: MappedSegment, record_offset: int) -> Iterator[ControlRecords]:
    """One region's control record in a pinned mapping (its views released on the way out)."""
    view = mapped.view(record_offset, RECORD_BYTES)
    words = view.cast("Q")
    try:
        yield ControlRecords(words, 1)
    finally:
        words.release()
        view.release()


class HandoffMetrics:
    """Per stage: the writes it issued and their bytes, the bytes by path; stage 0 also times whole handoffs."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.transfers = Counter("kvpool_handoff_transfers", "Writes this stage issued into decode regions",
                                 registry=registry)
        self.bytes = Counter("kvpool_handoff_bytes", "Bytes this stage wrote into decode regions", registry=registry)
        self.seconds = Histogram("kvpool_handoff_seconds", "Handoff time at stage 0, forward end to the last byte",
                                 buckets=_SECONDS_BUCKETS, registry=registry)
        self.requests = Counter("kvpool_handoff_requests", "Handoffs stage 0 ran, by outcome", ["outcome"],
                                registry=registry)
        self.path_bytes = Counter("kvpool_prefill_handoff_bytes", "Bytes this stage moved into decode regions, "
                                  "by path (memory: copied into decode's shared arena; engine: transfer engine)",
                                  ["path"], registry=registry)
        for path in BytePath:
            self.path_bytes.labels(path.value)


def now_unix_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class WriteTotals:
    transfers: int = 0
    nbytes: int = 0
    ranges: int = 0
    gather_s: float = 0.0
    write_s: float = 0.0
    scatter_s: float = 0.0
    forward_end_unix_ms: float = 0.0
    last_write_end_unix_ms: float = 0.0


class RequestWrites:
    """One request's writes from one stage: each final token range, in the background."""

    def __init__(self, owner: StageHandoff, request_id: str, block_table: list[int],
                 target: HandoffTarget, layout: HandoffLayout) -> None:
        self.owner = owner
        self.request_id = request_id
        self.block_table = block_table
        self.target = target
        self.layout = layout
        self.totals = WriteTotals()
        self.tasks: list[asyncio.Task[None]] = []
        self.frontier = Frontier()  # the ranges landed, published in the region's control record
        self.nonce = 0  # this attempt's, chosen at its first publish (kvpool.core.handoff.control)

    def write(self, token_start: int, token_end: int, trailer: bytes = b"") -> None:
        """Start writing tokens ``[token_start, token_end)`` of this stage's layers (and ``trailer``)."""
        if token_start >= token_end and not trailer:
            return
        self.tasks.append(asyncio.ensure_future(self.owner.write_range(self, token_start, token_end, trailer)))

    def forward_ended(self) -> None:
        self.totals.forward_end_unix_ms = time.time() * 1e3

    async def finish(self) -> StageHandoffFigures:
        """Wait for every write; the figures, or the first failure."""
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            error = failed[0]
            raise error if isinstance(error, KvpoolError) else Unavailable(f"handoff: {error}")
        t = self.totals
        return StageHandoffFigures(
            stage=self.owner.stage, transfers=t.transfers, bytes=t.nbytes, gather_seconds=t.gather_s,
            write_seconds=t.write_s, scatter_seconds=t.scatter_s, ranges=t.ranges,
            forward_end_unix_ms=t.forward_end_unix_ms, last_write_end_unix_ms=t.last_write_end_unix_ms)


class StageHandoff:
    """This stage's handoff writes of every request (see the module doc)."""

    def __init__(self, runner: StageRunner, metrics: HandoffMetrics) -> None:
        self.runner = runner
        self.metrics = metrics
        self.settings = runner.settings
        self.stage = runner.settings.stage
        self.entry_bytes = runner.kv_cache.shape[-1] * runner.kv_cache.element_size()
        # the engine's slabs: without an engine every write is a copy into decode's arena, and needs none
        self.arena = Arena("handoff", self.settings.handoff_arena_bytes, runner.engine) if runner.engine else None
        self._requests: dict[str, RequestWrites] = {}
        self.decode = LandedClient(self.stage)
        self.host_name = local_host_name()
        self.engine_only = self.settings.handoff_path == "engine"
        self.maps = SegmentMaps()  # decode arenas on this host, mapped once

    async def close(self) -> None:
        await self.decode.close()
        await self.maps.close()
        if self.arena is not None:
            self.arena.close()

    def check(self, target: HandoffTarget, num_tokens: int, num_logits: int) -> HandoffLayout:
        """The target's layout, checked against this request and pipeline before any work (stage 0)."""
        layout = target.layout
        if layout.num_tokens != num_tokens:
            raise InvalidArgument(f"target.layout.num_tokens: {layout.num_tokens}, the prompt has {num_tokens}")
        if layout.trailer_bytes not in (0, num_logits * 4):
            raise InvalidArgument(f"target.layout.trailer_bytes: {layout.trailer_bytes}, the final logits take "
                                  f"{num_logits * 4}")
        check_target(target, layout, self.settings.layer_split, self.entry_bytes, now_unix_ms())
        self.check_reachable(target)
        return layout

    def check_reachable(self, target: HandoffTarget) -> None:
        """Raise UNAVAILABLE naming the target unless this stage can move bytes into it: a write its path decision
        sends to the engine needs an engine at both ends."""
        if handoff_path(target, self.host_name, self.engine_only) is BytePath.MEMORY:
            return
        if self.runner.engine is None:
            raise Unavailable(f"target.host: decode on host {target.host or '(not declared)'}"
                              f"{'' if target.shared else ', offering no shared memory,'} needs the transfer "
                              f"engine, and stage {self.stage} on {self.host_name} runs without one "
                              f"(--no-transfer-engine)", field="target")
        if not target.endpoint:
            raise Unavailable(f"target.endpoint: decode on host {target.host or '(not declared)'} runs without a "
                              f"transfer engine, and stage {self.stage} on {self.host_name} writes by the engine"
                              f"{' (--handoff-path engine)' if self.engine_only else ''}", field="target")

    def begin(self, request_id: str, block_table: list[int], target: HandoffTarget) -> RequestWrites:
        """A request's writes from this stage; checked like stage 0 checked them."""
        layout = target.layout
        check_target(target, layout, self.settings.layer_split, self.entry_bytes, now_unix_ms())
        self.check_reachable(target)
        if len(self._requests) >= MAX_FINISHED:
            for done in [r for r, w in self._requests.items() if all(t.done() for t in w.tasks)]:
                del self._requests[done]
        writes = RequestWrites(self, request_id, block_table, target, layout)
        self._requests[request_id] = writes
        return writes

    async def done(self, request_id: str) -> StageHandoffFigures:
        """Wait for a request's writes from this stage (at once if it had none) and forget them."""
        writes = self._requests.pop(request_id, None)
        if writes is None:
            return StageHandoffFigures(stage=self.stage)
        figures = await asyncio.shield(writes.finish())
        self.metrics.transfers.inc(figures.transfers)
        self.metrics.bytes.inc(figures.bytes)
        log.info("handoff_stage_written", request_id=request_id, stage=self.stage,
                 region_id=writes.target.region_id, ranges=figures.ranges, transfers=figures.transfers,
                 bytes=figures.bytes, gather_ms=round(figures.gather_seconds * 1e3, 2),
                 write_ms=round(figures.write_seconds * 1e3, 2), scatter_ms=round(figures.scatter_seconds * 1e3, 2))
        return figures

    async def write_range(self, writes: RequestWrites, token_start: int, token_end: int, trailer: bytes) -> None:
        """Gather, write and announce one range (see the module doc); raises what failed."""
        layout, target, totals = writes.layout, writes.target, writes.totals
        if trailer and len(trailer) != layout.trailer_bytes:
            raise InvalidArgument(f"target.layout.trailer_bytes: {layout.trailer_bytes}, the logits are {len(trailer)}")
        plan = range_transfers(layout, self.stage, token_start, token_end) if token_start < token_end else []
        kv_nbytes = sum(t.length for t in plan)
        nbytes = kv_nbytes + len(trailer)
        path = handoff_path(target, self.host_name, self.engine_only)
        told = False  # decode was told through the region's control record (no Landed call)
        if path is BytePath.MEMORY:  # the gather is the move: its time counts as gather, no write follows
            started = time.perf_counter()
            try:
                told = await self.copy_range(writes, token_start, token_end, trailer)
                transfers, gather_s, write_s = 0, time.perf_counter() - started, 0.0
            except ArenaOutOfReach as exc:  # same host, but not this process's to map (another container)
                log.info("handoff_arena_out_of_reach", region_id=target.region_id, reason=str(exc))
                path = BytePath.ENGINE
        if path is BytePath.ENGINE:
            transfers, gather_s, write_s = await self.write_by_engine(writes, plan, token_start, token_end, trailer)
        totals.transfers += transfers
        totals.nbytes += nbytes
        totals.ranges += 1
        totals.gather_s += gather_s
        totals.write_s += write_s
        totals.last_write_end_unix_ms = max(totals.last_write_end_unix_ms, time.time() * 1e3)
        self.metrics.path_bytes.labels(path.value).inc(nbytes)
        if not told:
            totals.scatter_s += await self.decode.landed(target, token_start, token_end, bool(trailer))

    async def copy_range(self, writes: RequestWrites, token_start: int, token_end: int, trailer: bytes) -> bool:
        """Gather one range straight into decode's region, mapped from its shared arena (same host); True when
        decode was told through the region's control record and its doorbell, so no Landed call is needed."""
        layout, target = writes.layout, writes.target
        shared = target.shared
        assert shared is not None  # handoff_path chose memory
        try:  # first: a restarted decode fails here at once, not at the end of an RPC's deadline
            mapped = await self.maps.map(shared.socket_path, shared.name, shared.token, doorbell=True)
        except OutOfReach as exc:  # no socket here: the engine may still reach decode
            raise ArenaOutOfReach(str(exc)) from None
        except SharedMemoryUnavailable as exc:  # decode died or restarted
            raise Unavailable(f"stage {self.stage}: mapping decode's arena at {shared.socket_path} failed: {exc}",
                              field="target") from None
        offset = target.shared_offset
        if not 0 <= offset <= mapped.size - layout.nbytes:
            raise InvalidArgument(f"target.address: the region [{offset}, {offset + layout.nbytes}) is outside "
                                  f"decode's shared arena of {mapped.size} bytes")
        region_id = control_region_id(target, mapped.size, offset)
        if region_id is None:  # an older decode: ask it (Landed), right before the copy
            await self.check_reserved(target)
        elif target.deadline_unix_ms and target.deadline_unix_ms <= now_unix_ms():
            raise FailedPrecondition("target.deadline_unix_ms: the reservation expired before the write")

        def copy_in() -> None:
            with mapped.using():  # pinned: the arena stays mapped while this writes it, even if decode dies
                if region_id is not None:
                    with control_record(mapped, target.control_offset) as record:
                        if not record.fence_up(region_id):  # given back, expired or claimed: not ours any more
                            raise RegionClosed
                region = memory_tensor(mapped.address + offset, layout.nbytes)
                if token_start < token_end:
                    gather_range_into(self.runner.kv_cache, writes.block_table, token_start, token_end,
                                      region_range(region, layout, self.stage, token_start, token_end))
                if trailer:
                    region[layout.trailer_offset: layout.trailer_offset + len(trailer)].copy_(
                        torch.frombuffer(bytearray(trailer), dtype=torch.uint8))

        try:
            nbytes = (token_end - token_start) * layout.stage_nbytes(self.stage) // layout.num_tokens + len(trailer)
            if nbytes <= INLINE_COPY_BYTES:
                copy_in()  # a few tokens (and the logits): less than a thread's wake-ups
            else:
                await asyncio.to_thread(copy_in)
        except SharedMemoryUnavailable as exc:  # forgotten before the copy began: decode went away
            raise Unavailable(f"stage {self.stage}: decode's arena at {shared.socket_path} went away: {exc}",
                              field="target") from None
        except RegionClosed:
            raise FailedPrecondition(f"target.region_id: decode no longer holds region {region_id} for writes "
                                     "(given back, expired or already decoding)") from None
        if region_id is None:
            return False
        frontier = writes.frontier.land(token_start, token_end)
        try:
            with mapped.using(), control_record(mapped, target.control_offset) as record:
                if not writes.nonce:  # this attempt's first publish: a nonce decode has not seen for this stage
                    writes.nonce = fresh_nonce(record.progress(region_id, self.stage), secrets.randbits(32))
                record.publish(region_id, self.stage, writes.nonce, frontier, bool(trailer))
                return mapped.ring()
        except SharedMemoryUnavailable as exc:
            raise Unavailable(f"stage {self.stage}: decode's arena at {shared.socket_path} went away: {exc}",
                              field="target") from None

    async def check_reserved(self, target: HandoffTarget) -> None:
        """Raise unless decode still holds the region for this write (its deadline, then decode's word)."""
        if target.deadline_unix_ms and target.deadline_unix_ms <= now_unix_ms():
            raise FailedPrecondition("target.deadline_unix_ms: the reservation expired before the write")
        # still reserved? (given back, its bytes stay decode's a moment longer than this write takes)
        await self.decode.landed(target, 0, 0, False)

    async def write_by_engine(self, writes: RequestWrites, plan: list[RangeTransfer], token_start: int,
                              token_end: int, trailer: bytes) -> tuple[int, float, float]:
        """Gather one range into a slab of the arena and write it in ``plan``'s transfers (and the trailer's)
        with the transfer engine; the transfers, the gather's seconds and the write's."""
        layout, target = writes.layout, writes.target
        engine, arena = self.runner.engine, self.arena
        if engine is None or arena is None or not target.endpoint:  # decode's arena was out of this process's reach
            where = target.shared.socket_path if target.shared else "(none)"
            lacking = f"stage {self.stage} runs" if engine is None else "decode runs"
            raise Unavailable(f"target.shared_memory: decode's arena at {where} is out of stage {self.stage}'s "
                              f"reach, and {lacking} without a transfer engine", field="target")
        kv_nbytes = sum(t.length for t in plan)
        nbytes = kv_nbytes + len(trailer)
        try:
            slab = await arena.allocate_wait(nbytes, ARENA_WAIT_S)
        except TimeoutError:
            raise ResourceExhausted(f"stage {self.stage}: no room for a {nbytes}-byte handoff slab "
                                    f"in {ARENA_WAIT_S}s") from None
        except ValueError as exc:
            raise InvalidArgument(f"target.layout.num_tokens: {exc}") from None
        try:
            t0 = time.perf_counter()
            slab_tensor = arena.tensor(slab, 0, nbytes)
            if plan:
                await asyncio.to_thread(gather_range, self.runner.kv_cache, writes.block_table, token_start,
                                        token_end, slab_tensor[:kv_nbytes])
            if trailer:  # the final logits go right after the range, from the same slab
                slab_tensor[kv_nbytes:].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
            t1 = time.perf_counter()
            await self.check_reserved(target)
            local = [slab.address + t.slab_offset for t in plan]
            remote = [target.address + t.region_offset for t in plan]
            sizes = [t.length for t in plan]
            if trailer:
                for t in transfer_plan(len(trailer)):
                    local.append(slab.address + kv_nbytes + t.offset)
                    remote.append(target.address + layout.trailer_offset + t.offset)
                    sizes.append(t.length)
            # polled, never spinning: this write overlaps the stage's own and the next stages' compute
            done = await asyncio.to_thread(engine.move, target.endpoint, local, remote, sizes, True,
                                           None, True)
            if not all(done):
                # field "target": the decode shard failed, not this pipeline (the router moves the request)
                raise Unavailable(f"stage {self.stage}: writing to decode at {target.endpoint} failed: "
                                  f"{done.count(False)} of {len(sizes)} transfers", field="target")
            t2 = time.perf_counter()
        finally:
            arena.free(slab)
        return len(sizes), t1 - t0, t2 - t1
