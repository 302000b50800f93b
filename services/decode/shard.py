"""A decode shard's engine: the core's decisions with the model and the bytes between them.

The policy (admission, pages, batch, stop rules, regions) is
``kvpool.core.decode.scheduler`` / ``decode.regions``, the room they hold is
counted by the core's ``ShardRoom`` (as the simulator's shards count it), and
runs on the event loop only; the model (scatter, step, sampling) runs on the shard's one
compute thread. Every token is sampled here, the first included: a region
reserved ``with_logits`` carries the final position's logits after the KV,
and the first token is drawn from them with the request's own generator. Each loop turn is schedule → run → postprocess, as
nano-vllm's ``LLMEngine.step``.

Freeing is immediate: a finished or cancelled sequence's pages go back to the
scheduler at once, even while a step that still writes them is running.
That is safe because the compute thread is serial: whoever gets those pages
next is scattered and stepped only in a later compute call, and every slot a
sequence reads was written by that sequence first.

The receive arena is a sealed memfd (``--shared-memory``, the default) that the
server offers to this host's prefill stages over a Unix socket
(``kvpool.shared_memory``): a stage on this declared host copies into it, any
other writes with the transfer engine, with which the arena stays registered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import structlog
import torch

from kvpool.core.decode.regions import ReceiveRegion, RegionTable
from kvpool.core.decode.scheduler import DecodeScheduler, DecodeSequence
from kvpool.core.decode.shard_room import ShardRoom
from kvpool.core.errors import FailedPrecondition, InvalidArgument, NoRoomNow, ResourceExhausted
from kvpool.core.handoff.control import ControlRecords
from kvpool.core.handoff.layout import HandoffLayout
from kvpool.handoff import scatter_range, scatter_region
from kvpool.model import kv_dtype as kv_dtype_of
from kvpool.model.decode import DecodeInput, DecodeModel
from kvpool.model.sampling import SamplingParams, output_logits, sample
from kvpool.core.pool.paths import SharedMemoryRef
from kvpool.shared_memory import SharedSegment
from kvpool.transfer import HostBuffer, TransferEngine, local_host_name
from kvpool.services.decode.metrics import DecodeMetrics
from kvpool.services.decode.room_bell import RoomBell
from kvpool.services.decode.settings import DecodeSettings

log = structlog.get_logger(__name__)

EXPIRE_INTERVAL_S = 0.25
# a region given back keeps its bytes this long: a prefill write that checked the region just
# before it went lands in bytes nobody else holds (kvpool.core.decode.regions)
WRITER_GRACE_S = 0.5
INLINE_SCATTER_TOKENS = 64  # a landed part of at most this many tokens is scattered on the event loop
ARENA_NAME = "decode-arena"  # the receive arena's segment name on its shared-memory socket
MAX_CONTROL_SLOTS = 4096  # regions open at once, at most, with control records (1 MiB of them)


def control_slots(arena_size: int) -> int:
    """Control records for an arena: one per region it could hold (4 KiB each at least), within bounds."""
    return max(64, min(MAX_CONTROL_SLOTS, arena_size // 4096))


@dataclass(frozen=True, slots=True)
class Figures:
    num_tokens: int
    finish_reason: str
    decode_seconds: float
    queue_seconds: float
    scatter_seconds: float
    first_token_unix_ms: float = 0.0


@dataclass(slots=True)
class LiveSequence:
    """The shell's side of one sequence: its region, sampler and output stream."""

    seq: DecodeSequence
    region: ReceiveRegion
    params: SamplingParams
    last_token: int
    events: asyncio.Queue[int | Figures | BaseException] = field(default_factory=asyncio.Queue)
    ready: bool = False  # the first token is known: the sequence joins the steps
    region_freed: bool = False
    scatter_seconds: float = 0.0
    first_token_unix_ms: float = 0.0


def is_landed_whole(region: ReceiveRegion) -> bool:
    """Every stage's part of the region and its logits landed, by one writing of each stage."""
    return region.landed is not None and region.landed.complete and not region.rewritten


class DecodeShard:
    """Pages, regions and the running batch of one shard; ``run`` is its step loop."""

    def __init__(self, settings: DecodeSettings, engine: TransferEngine | None, metrics: DecodeMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.config = settings.model_config()
        self.engine = engine
        self.metrics = metrics
        self.clock = clock
        torch.set_num_threads(settings.torch_threads)
        self.model = DecodeModel(self.config, settings.num_pages, settings.page_size,
                                 kv_dtype_of(settings.kv_dtype), settings.weights or settings.model_dir or None)
        self.scheduler = DecodeScheduler(settings.num_pages, settings.page_size, settings.max_batch_size,
                                         self.config.max_position_embeddings, clock)
        # the receive arena: registered once, regions are carved from it; shared memory for stages on this host,
        # with the regions' control records after it and a doorbell (kvpool.core.handoff.control)
        size = self.arena_size = int(settings.region_arena_bytes)
        self.control: ControlRecords | None = None
        self.doorbell = -1
        if settings.shared_memory:
            slots = control_slots(size)
            self.arena: HostBuffer | SharedSegment = SharedSegment(size + ControlRecords.nbytes(slots), ARENA_NAME)
            self._control_view = self.arena.view(size)
            self.control = ControlRecords(self._control_view.cast("Q"), slots)
            self.doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            self.arena = HostBuffer(size)
        self.arena.touch()
        self.regions = RegionTable(size, settings.region_deadline_s, clock, WRITER_GRACE_S, self.control)
        if engine is not None:  # None: stages reach the arena by shared memory only
            engine.register(self.arena.address, size)
        self.host_name = local_host_name()  # the host this shard declares in its targets
        self.shared: SharedMemoryRef | None = None  # where this host's stages map the arena (the server sets it)
        self.endpoint = engine.endpoint if engine is not None else ""  # "": no engine, shared memory only
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode-compute")
        self._live: dict[str, LiveSequence] = {}
        self.notify_address = ""  # this shard's gRPC address, for Landed (the server sets it)
        self._rung = False
        self._scan: asyncio.Future[None] | None = None
        self._whole: dict[int, asyncio.Future[None]] = {}  # region id -> resolved once all of it landed
        self._room_changed = asyncio.Event()  # set (and replaced) whenever room may have come back
        self.room = RoomBell()  # tells routers whose Serve found no room when some comes back
        # the room's one ledger (pages and regions, both or neither; the give-back count), the core's
        self.ledger = ShardRoom(self.scheduler, regions=self.regions, room=self.room)
        self._wake = asyncio.Event()
        self.num_steps = 0

    # -- regions -------------------------------------------------------------------------

    @property
    def trailer_bytes(self) -> int:
        """A ``with_logits`` region's bytes after the KV: float32 logits of the final position."""
        return self.config.vocab_size * 4

    def reserve(self, layout: HandoffLayout, kv_dtype: str, max_tokens: int = 0, hold_s: float | None = None,
                ) -> ReceiveRegion:
        """A receive region, after checking the layout against this shard's model; with
        ``max_tokens`` the sequence's pages too (both or neither)."""
        if layout.num_layers != self.config.num_hidden_layers:
            raise InvalidArgument(f"layer_split: covers {layout.num_layers} layers, the shard's model has "
                                  f"{self.config.num_hidden_layers}")
        if kv_dtype != self.settings.kv_dtype:
            raise InvalidArgument(f"kv_dtype: {kv_dtype!r}, the shard stores {self.settings.kv_dtype!r}")
        if layout.entry_bytes != self.model.entry_bytes:
            raise InvalidArgument(f"entry_bytes: {layout.entry_bytes}, the shard's entries are "
                                  f"{self.model.entry_bytes} bytes")
        if layout.num_tokens >= self.config.max_position_embeddings:
            raise InvalidArgument(f"num_tokens: {layout.num_tokens} leaves no room in the model's context of "
                                  f"{self.config.max_position_embeddings}")
        if max_tokens:
            self.scheduler.check(layout.num_tokens, max_tokens)
        region = self.ledger.hold(layout.num_tokens, max_tokens, layout=layout, hold_s=hold_s)
        assert region is not None  # the shard has an arena
        self._publish()
        return region

    def region_address(self, region: ReceiveRegion) -> int:
        return self.arena.address + region.offset

    def control_offset(self, region: ReceiveRegion) -> int:
        """Where the region's control record lies in the shared arena; 0: none (stages call Landed)."""
        if self.control is None:
            return 0
        return self.arena_size + self.control.record_offset(region.region_id)

    def region_tensor(self, region: ReceiveRegion) -> torch.Tensor:
        return torch.frombuffer(self.arena.view(region.offset, region.size), dtype=torch.uint8)

    def release_region(self, region_id: int) -> bool:
        """Give back an unclaimed region and the pages reserved with it, at once."""
        if any(live.region.region_id == region_id for live in self._live.values()):
            raise InvalidArgument(f"region_id: {region_id} is in use by a Generate")
        region = self.regions.get(region_id)
        if region is not None:
            self.ledger.release(region, grace_s=WRITER_GRACE_S)
        self._publish()
        return region is not None

    async def landed(self, region_id: int, stage: int, token_start: int, token_end: int,
                     trailer: bool) -> tuple[float, bool]:
        """A part of a region landed: scatter it into the reserved pages now (on the compute
        thread, between steps); the scatter's seconds and whether every part has landed."""
        region = self.regions.get(region_id)
        if region is None:
            raise FailedPrecondition(f"region_id: {region_id} is not reserved on this shard (used, released or "
                                     "expired)")
        if region.claimed:
            raise FailedPrecondition(f"region_id: {region_id} is already decoding")
        assert region.landed is not None
        region.landed.check(stage, token_start, token_end, trailer)
        return await self._land(region, stage, token_start, token_end, trailer, "call")

    def landed_whole(self, region_id: int) -> asyncio.Future[None]:
        """Resolved once every stage's part of a reserved region and its logits have landed and been
        scattered into its pages, by one writing of each stage (a region written again, by a retried
        prefill, resolves it never: its Generate scatters it whole). ``forget_whole`` when done with it."""
        whole = self._whole.get(region_id)
        if whole is None:
            whole = self._whole[region_id] = asyncio.get_running_loop().create_future()
            region = self.regions.get(region_id)
            if region is not None and is_landed_whole(region):
                whole.set_result(None)
        return whole

    def forget_whole(self, region_id: int) -> None:
        whole = self._whole.pop(region_id, None)
        if whole is not None and not whole.done():
            whole.cancel()

    def on_doorbell(self) -> None:
        """A stage on this host published progress in a control record: scatter what landed (one scan at a
        time; a ring during a scan makes it look again)."""
        try:
            os.eventfd_read(self.doorbell)
        except BlockingIOError:
            pass
        self._rung = True
        if self._scan is None or self._scan.done():
            self._scan = asyncio.ensure_future(self._scan_landed())

    async def _scan_landed(self) -> None:
        try:
            await self._scan_rung()
        except Exception:  # a bug, not a writer's doing: log it; Generate scatters whatever is left
            log.exception("decode_landed_scan_failed")

    async def _scan_rung(self) -> None:
        while self._rung:
            self._rung = False
            assert self.control is not None
            for region in self.regions.open_regions():
                if not region.seq_id or region.claimed or not self.control.fence_up(region.region_id):
                    continue
                assert region.landed is not None
                layout = region.layout
                progress, trailer = self.control.landed(region.region_id, layout.num_stages)
                for stage, landed in enumerate(progress):
                    if landed is None:
                        continue
                    if region.seen_writer(stage, landed.nonce):
                        log.info("decode_region_rewritten", region_id=region.region_id, stage=stage)
                    have = region.landed.frontier(stage)
                    if have < landed.count <= layout.num_tokens:
                        await self._land(region, stage, have, landed.count, False, "doorbell")
                if trailer and layout.trailer_bytes and not region.landed.trailer_landed:
                    await self._land(region, 0, 0, 0, True, "doorbell")

    async def _land(self, region: ReceiveRegion, stage: int, token_start: int, token_end: int,
                    trailer: bool, by: str) -> tuple[float, bool]:
        region_id = region.region_id
        assert region.landed is not None
        seconds = 0.0
        seq = self.scheduler.get(region.seq_id) if region.seq_id else None
        if seq is not None and token_start < token_end:
            started = time.perf_counter()
            scatter = (scatter_range, self.region_tensor(region), region.layout, self.model.pages,
                       list(seq.page_ids), stage, token_start, token_end)
            if token_end - token_start <= INLINE_SCATTER_TOKENS:
                # a few tokens (the last piece of a cached prompt): the copy costs less than the compute thread's
                # wake-ups; the pages are this sequence's own, which no step reads before it is admitted
                scatter[0](*scatter[1:])
            else:
                await asyncio.get_running_loop().run_in_executor(self._compute, *scatter)
            seconds = time.perf_counter() - started
        if self.regions.get(region_id) is region and (seq is not None or token_start == token_end):
            region.landed.land(stage, token_start, token_end, trailer)  # scattered (or nothing to scatter)
            self.metrics.landed.labels(by).inc()
            whole = self._whole.get(region_id)
            if whole is not None and not whole.done() and is_landed_whole(region):
                whole.set_result(None)
        return seconds, region.landed.complete

    async def expire_regions_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)  # a periodic sweep, not standing in for work
            draining = self.regions.num_draining
            expired = self.regions.expire()
            if draining != self.regions.num_draining:
                self._publish()  # drained bytes show at once
            for region in expired:
                self.ledger.release(region)  # its pages too (the region is gone already)
                self.metrics.regions_expired.inc()
                log.info("decode_region_expired", region_id=region.region_id)
                self._publish()

    # -- sequences -----------------------------------------------------------------------

    async def generate(self, region_id: int, prompt_token_ids: list[int], first_token: int,
                       params: SamplingParams, max_tokens: int, stop_token_ids: list[int],
                       request_id: str = "") -> AsyncIterator[int | Figures]:
        """Tokens as they are made, then the Figures; pages and region freed however it ends."""
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidArgument(f"prompt_token_ids: every id must be in [0, {vocab})")
        self.scheduler.check(len(prompt_token_ids), max_tokens)
        region = self.regions.get(region_id)
        if (region is None or not region.layout.trailer_bytes) and not 0 <= first_token < vocab:
            raise InvalidArgument(f"first_token: {first_token} is not in [0, {vocab})")
        region = self.regions.claim(region_id)
        seq_id = region.seq_id or request_id or uuid.uuid4().hex
        live: LiveSequence | None = None
        try:
            if region.layout.num_tokens != len(prompt_token_ids):
                raise InvalidArgument(f"prompt_token_ids: {len(prompt_token_ids)} tokens, region {region_id} holds "
                                      f"{region.layout.num_tokens}")
            if seq_id in self._live:
                raise InvalidArgument(f"request_id: {seq_id!r} is already decoding here")
            seq = self.scheduler.submit(seq_id, len(prompt_token_ids), max_tokens, stop_token_ids)
            live = LiveSequence(seq, region, params, first_token, ready=not region.layout.trailer_bytes)
            self._live[seq_id] = live
            self._publish()
            self._wake.set()
            while True:
                event = await live.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, Figures):
                    return
        finally:
            if live is not None:
                self._end(live)
            else:
                self.ledger.release(region)
                self._publish()

    def _end(self, live: LiveSequence) -> None:
        """Free a sequence's pages and region now (idempotent)."""
        if self._live.get(live.seq.seq_id) is live:
            del self._live[live.seq.seq_id]
        self.ledger.release(None if live.region_freed else live.region, live.seq.seq_id)
        live.region_freed = True
        self._publish()
        self._wake.set()

    def _finish(self, live: LiveSequence, reason: str) -> None:
        seq = live.seq
        now = self.clock()
        admitted = seq.admitted_at if seq.admitted_at is not None else now
        figures = Figures(seq.num_output_tokens, reason, now - admitted, admitted - seq.submitted_at,
                          live.scatter_seconds, live.first_token_unix_ms)
        self.metrics.requests.labels(reason).inc()
        self.metrics.queue_seconds.observe(figures.queue_seconds)
        live.events.put_nowait(figures)
        self._end(live)

    def _emit(self, live: LiveSequence, token_id: int) -> None:
        live.last_token = token_id
        self.metrics.tokens.inc()
        live.events.put_nowait(token_id)
        reason = self.scheduler.on_token(live.seq.seq_id, token_id)
        if reason is not None:
            self._finish(live, reason)

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise InvalidArgument naming the field unless such a request could ever run here."""
        self.scheduler.check(len(prompt_token_ids), max_tokens)
        vocab = self.config.vocab_size
        bad = next((i for i, t in enumerate(prompt_token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"prompt_token_ids[{bad}]: {prompt_token_ids[bad]} is not in [0, {vocab})")

    async def reserve_waiting(self, layout: HandoffLayout, kv_dtype: str, max_tokens: int, hold_s: float | None,
                              wait_s: float) -> ReceiveRegion:
        """``reserve``, waiting up to ``wait_s`` for room another request is giving back (woken by each
        give-back, never polling); RESOURCE_EXHAUSTED once that passed. A request that can never fit fails at
        once."""
        deadline = self.clock() + wait_s
        while True:
            changed = self._room_changed
            try:
                return self.reserve(layout, kv_dtype, max_tokens, hold_s)
            except ResourceExhausted:
                left = deadline - self.clock()
                if left <= 0:
                    raise
            self.metrics.room_waits.inc()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    def reserve_now(self, layout: HandoffLayout, kv_dtype: str, max_tokens: int, hold_s: float | None
                    ) -> ReceiveRegion:
        """``reserve``, or ``NoRoomNow`` at once naming the give-backs so far: the room bell then rings at the
        next give-back, for the router to ask again."""
        try:
            return self.reserve(layout, kv_dtype, max_tokens, hold_s)
        except ResourceExhausted as exc:
            self.metrics.room_refusals.inc()
            raise NoRoomNow(f"decode_room: {exc}", room_epoch=self.room.refused()) from None

    def _publish(self) -> None:
        # whatever changed may have freed room: wake those waiting for it (they try again)
        self._room_changed.set()
        self._room_changed = asyncio.Event()
        self.ledger.observe()
        self.metrics.pages_used.set(self.scheduler.num_pages_used)
        self.metrics.pages_reserved.set(self.scheduler.num_reserved)
        self.metrics.queue_length.set(self.scheduler.num_waiting)
        self.metrics.running.set(self.scheduler.num_running)
        self.metrics.regions.set(self.regions.num_regions)
        self.metrics.region_bytes_used.set(self.regions.used_bytes)

    # -- the step loop -------------------------------------------------------------------

    async def run(self) -> None:
        """Forever: admit → (scatter the admitted, one step for every running sequence) → stream."""
        loop = asyncio.get_running_loop()
        while True:
            admitted = [self._live[s.seq_id] for s in self.scheduler.admit()]
            for live in admitted:
                if live.ready:
                    self._emit(live, live.last_token)  # a given first token; it may end the sequence
            admitted = [live for live in admitted if self._live.get(live.seq.seq_id) is live]
            to_scatter = [(live, self.region_tensor(live.region), live.region.layout, list(live.seq.page_ids),
                           live.params, bool(live.region.landed and live.region.landed.complete
                                             and not live.region.rewritten))
                          for live in admitted]
            # sequences whose first token is drawn in this call join the next step
            batch = [live for live in self._live.values() if live.seq.admitted_at is not None and live.ready]
            if not batch and not to_scatter:
                self._publish()
                self._wake.clear()
                await self._wake.wait()
                continue
            inputs = [DecodeInput(live.last_token, live.seq.position, list(live.seq.page_ids)) for live in batch]
            params = [live.params for live in batch]
            try:
                if not inputs and all(entry[-1] and entry[-2].temperature == 0 for entry in to_scatter):
                    # only greedy first tokens to draw from landed logits (an argmax: a sampled draw may sort the
                    # vocabulary): less work than the compute thread's wake-ups
                    tokens, firsts, scatter_seconds, step_seconds = self._compute_step(to_scatter, inputs, params)
                else:
                    tokens, firsts, scatter_seconds, step_seconds = await loop.run_in_executor(
                        self._compute, self._compute_step, to_scatter, inputs, params)
            except Exception as exc:  # a bug, not bad input: fail these sequences, keep serving
                log.exception("decode_step_failed", batch=len(batch))
                for live in {id(x): x for x in batch + admitted}.values():
                    live.events.put_nowait(exc)
                    self._end(live)
                continue
            for live, seconds in zip(admitted, scatter_seconds):
                live.scatter_seconds = seconds
                if not (live.region.landed and live.region.landed.complete) or live.region.rewritten:
                    self.metrics.landed.labels("generate").inc()
                if not live.region_freed:  # the region's bytes are in the pages now
                    self.regions.free(live.region.region_id)
                    live.region_freed = True
            if inputs:
                self.num_steps += 1
                self.metrics.step_seconds.observe(step_seconds)
                self.metrics.batch_size.observe(len(inputs))
            for live, token in zip(batch, tokens):
                if self._live.get(live.seq.seq_id) is not live:
                    continue  # cancelled during the step
                self.scheduler.on_step(live.seq.seq_id)
                self._emit(live, token)
            for live, first in zip(admitted, firsts):
                if first is not None and self._live.get(live.seq.seq_id) is live:
                    live.ready = True
                    live.first_token_unix_ms = time.time() * 1e3
                    self._emit(live, first)  # the first token; it may end the sequence
            self._publish()

    def _compute_step(self, to_scatter, inputs: list[DecodeInput], params: list[SamplingParams]):
        """On the compute thread: scatter new sequences' regions, one batched step, sampling."""
        scatter_seconds: list[float] = []
        firsts: list[int | None] = []
        for _live, region, layout, page_ids, first_params, scattered in to_scatter:
            started = time.perf_counter()
            if not scattered:  # parts landed without notice (an older prefill): all of it now
                scatter_region(region, layout, self.model.pages, page_ids)
            first = None
            if layout.trailer_bytes:
                trailer = region[layout.trailer_offset: layout.nbytes].clone().view(torch.float32)
                first = sample(output_logits(trailer, self.config), first_params)  # the same sampler
            firsts.append(first)
            scatter_seconds.append(time.perf_counter() - started)
        if not inputs:
            return [], firsts, scatter_seconds, 0.0
        started = time.perf_counter()
        logits = output_logits(self.model.step(inputs), self.config)  # the model's sampler: its output ids only
        tokens = [sample(row, p) for row, p in zip(logits, params)]
        return tokens, firsts, scatter_seconds, time.perf_counter() - started

    def close(self) -> None:
        self._compute.shutdown(wait=True)
        if self.engine is not None:
            self.engine.unregister(self.arena.address)
        if self.control is not None:
            self.control.words.release()
            self._control_view.release()  # the arena can unmap now
        if self.doorbell >= 0:
            os.close(self.doorbell)
            self.doorbell = -1
