"""The router's backends: a client per prefill pipeline and decode shard, the health loop that tells
admission what each can ever hold, and each shard's word that room came back.

The calls a request makes (``Serve``, and ``Prefetch`` at a turn's end) take and give plain values:
the messages stay here. A failed call raises
``grpc.aio.AioRpcError`` as it came, for the router to read its status.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import service
from kvpool.core.admission.admission import Admission, Admitted, ShardShape
from kvpool.core.errors import Unavailable
from kvpool.core.supervision.health_checks import Check, HealthVerdicts
from kvpool.model.config import split_layers
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2, prefill_pb2, prefill_pb2_grpc
from kvpool.services.router.metrics import RouterMetrics

log = structlog.get_logger(__name__)

HEALTH_TIMEOUT_S = 2.0
STAGE_INFO_TIMEOUT_S = 15.0
WORK_SCALE_EVERY_ROUNDS = 10  # health rounds (1 s each by default) between asks for a pipeline's measured speed
# late health checks in a row that take a backend out of rotation by default (--health-late-checks,
# kvpool.core.supervision.health_checks): one late answer on a loaded host turned requests that would have queued into 503s
LATE_CHECKS_OUT = 2
# the health service name under which stage 0 answers for its whole pipeline
PIPELINE_HEALTH_SERVICE = "kvpool.rpc.Prefill"


def server_of(address: str, servers: dict[str, str]) -> str:
    """The server a backend runs on: named in ``servers``, else its address's host."""
    return servers.get(address) or address.rsplit(":", 1)[0]


@dataclass(frozen=True, slots=True)
class Prefilled:
    """What the router counts of a prefill: where the prompt's tokens came from, what the handoff moved."""

    device_tokens: int
    pool_tokens: int
    computed_tokens: int
    handoff_transfers: int
    handoff_bytes: int


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    seed: int


class ServeStream:
    """One ``Serve`` call (module doc of ``kvpool.services.router.router``): ``reserved`` (the shard holds the
    room) comes first, then ``prefilled`` (what the prefill counted) and the token ids — the first token may come
    before ``prefilled`` (``first_token_early``: the shard saw the whole region land before the answer came back
    along the stages) —; ``finish_reason`` ("stop" or "length") once it ended. ``cancel`` ends the call, and
    decode frees the request's region and pages."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.finish_reason = ""
        self._first: Any = None  # an older shard's first message (its prefill's answer), or an early token's
        self.on_prefilled: Callable[[Prefilled], None] | None = None  # a prefill's answer after tokens

    async def reserved(self) -> None:
        """Until the shard holds the request's room: its ``reserved`` message (an older shard sends none:
        its prefill's answer, kept for ``prefilled``). The call failing before it raises."""
        response = await self._call.read()
        if response is grpc.aio.EOF or not response.HasField("reserved"):
            self._first = response

    async def prefilled(self) -> Prefilled | None:
        """The prefill's figures: the message after ``reserved`` (the call failing before it raises); None
        when a token came first (kept for the iteration: the figures then go to ``on_prefilled``)."""
        response, self._first = (self._first if self._first is not None else await self._call.read()), None
        if response is not grpc.aio.EOF and response.WhichOneof("event") == "token_id":
            self._first = response
            return None
        if response is grpc.aio.EOF or not response.HasField("prefilled"):
            raise Unavailable("decode: Serve answered no prefill first")
        return prefilled_of(response)

    async def __aiter__(self) -> AsyncIterator[int]:
        kept, self._first = self._first, None
        while (response := kept if kept is not None else await self._call.read()) is not grpc.aio.EOF:
            kept = None
            event = response.WhichOneof("event")
            if event == "figures":
                self.finish_reason = "stop" if response.figures.finish_reason == "stop" else "length"
                return
            if event == "prefilled":
                if self.on_prefilled is not None:
                    self.on_prefilled(prefilled_of(response))
            else:
                yield response.token_id

    def cancel(self) -> None:
        self._call.cancel()


def prefilled_of(response: Any) -> Prefilled:
    figures, handoff = response.prefilled.figures, response.prefilled.handoff
    return Prefilled(figures.num_device_tokens, figures.num_pool_tokens, figures.num_computed_tokens,
                     handoff.transfers, handoff.bytes)


@dataclass(slots=True)
class PipelineClient:
    address: str
    channel: grpc.aio.Channel
    prefill: prefill_pb2_grpc.PrefillStub
    stages: prefill_pb2_grpc.PrefillStageStub
    health: health_pb2_grpc.HealthStub
    num_stages: int = 0
    # until StageInfo answers after the pipeline (re)entered rotation or its connection broke
    stage_info_due: bool = True
    stage_info_round: int = 0  # the health round of its last StageInfo
    num_reconnects: int = 0  # connections that broke (each may have been a restarted stage 0)

    async def prefetch(self, session_key: str, tenant: str, cache_salt: str, session_end: bool,
                       expected_next_s: float | None, timeout_s: float) -> None:
        """Stage the session's history for its next turn, ``expected_next_s`` ahead (or let it go)."""
        message = prefill_pb2.PrefetchRequest(session_key=session_key, tenant=tenant, cache_salt=cache_salt,
                                              session_end=session_end)
        if expected_next_s is not None:
            message.expected_next_s = expected_next_s
        await self.prefill.Prefetch(message, timeout=timeout_s)


@dataclass(slots=True)
class ShardClient:
    address: str
    channel: grpc.aio.Channel
    decode: decode_pb2_grpc.DecodeStub
    health: health_pb2_grpc.HealthStub
    kv_dtype: str = ""
    num_layers: int = 0
    entry_bytes: int = 0
    told_no_watch: bool = False  # logged once that it has no WatchRoom (an older shard)

    def serve(self, pipeline: str, layer_split: Sequence[tuple[int, int]], prompt_ids: Sequence[int],
              sampling: Sampling, max_tokens: int, stop_token_ids: Sequence[int], request_id: str, session_key: str,
              tenant: str, cache_salt: str, prefill_timeout_s: float, timeout_s: float) -> ServeStream:
        """The whole request at this shard: its room, its prefill at ``pipeline`` into it, every token."""
        return ServeStream(self.decode.Serve(
            decode_pb2.ServeRequest(
                prompt_token_ids=prompt_ids,
                sampling=decode_pb2.DecodeSampling(temperature=sampling.temperature, top_p=sampling.top_p,
                                                   top_k=sampling.top_k, seed=sampling.seed),
                max_tokens=max_tokens, stop_token_ids=stop_token_ids, request_id=request_id,
                prefill_address=pipeline, session_key=session_key, tenant=tenant, cache_salt=cache_salt,
                layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in layer_split],
                prefill_timeout_s=prefill_timeout_s, room_at_once=True, first_token_early=True,
            ),
            timeout=timeout_s,
        ))


class Backends:
    """Clients of every pipeline and shard; ``check_health`` feeds health and shapes to admission."""

    def __init__(self, pipelines: list[str], shards: list[str], admission: Admission, metrics: RouterMetrics,
                 late_checks_out: int = LATE_CHECKS_OUT,
                 on_admitted: Callable[[Admitted], None] = lambda admitted: None) -> None:
        self.admission = admission
        self.on_admitted = on_admitted  # what admission answers a shard's word on its room
        self.metrics = metrics
        metrics.work_scale.set_function(lambda: admission.work_scale)
        self.verdicts = HealthVerdicts(late_checks_out)
        self.pipelines = {a: self._pipeline_client(a) for a in pipelines}
        self.shards = {a: self._shard_client(a) for a in shards}
        self._watchers: list[asyncio.Task[None]] = []  # started by the first health round (a loop runs then)
        self._health_round = asyncio.Event()  # set (and replaced) after each health round
        self._refreshes: set[asyncio.Task[None]] = set()  # asks for pipelines' measured speed in flight

    @staticmethod
    def _pipeline_client(address: str) -> PipelineClient:
        channel = service.channel(address)
        return PipelineClient(address, channel, prefill_pb2_grpc.PrefillStub(channel),
                              prefill_pb2_grpc.PrefillStageStub(channel), health_pb2_grpc.HealthStub(channel))

    @staticmethod
    def _shard_client(address: str) -> ShardClient:
        channel = service.channel(address)
        return ShardClient(address, channel, decode_pb2_grpc.DecodeStub(channel), health_pb2_grpc.HealthStub(channel))

    async def close(self) -> None:
        for task in [*self._watchers, *self._refreshes]:
            task.cancel()
        await asyncio.gather(*self._watchers, *self._refreshes, return_exceptions=True)
        for client in [*self.pipelines.values(), *self.shards.values()]:
            await client.channel.close()

    @staticmethod
    async def _watch_connection(client: PipelineClient) -> None:
        """Ask StageInfo again whenever the connection to stage 0 breaks: a stage 0 restarted (with
        another device cache, say) between two health rounds answers the next one as serving, and
        a request's call may have reconnected to it before that round even looks."""
        ready = grpc.ChannelConnectivity.READY
        state = client.channel.get_state()
        while True:
            await client.channel.wait_for_state_change(state)
            new = client.channel.get_state()
            if state is ready and new is not ready:
                client.stage_info_due = True
                client.num_reconnects += 1
                log.info("pipeline_connection_broke", target=client.address, state=new.name)
            state = new

    def layer_split(self, pipeline: str, shard: str) -> list[tuple[int, int]]:
        return split_layers(self.shards[shard].num_layers, self.pipelines[pipeline].num_stages)

    async def check_health(self) -> dict[str, bool]:
        """One round of health checks; pipelines report their stages and device cache, shards their shape."""
        self.admission.begin_health_round()  # what this round finds is newer than any failure before it
        if not self._watchers:
            self._watchers = [asyncio.ensure_future(self._watch_connection(c)) for c in self.pipelines.values()]
            self._watchers += [asyncio.ensure_future(self._watch_room(c)) for c in self.shards.values()]
        checks = [self._check_pipeline(c) for c in self.pipelines.values()]
        checks += [self._check_shard(c) for c in self.shards.values()]
        results = await asyncio.gather(*checks)
        backends = {}
        for name, check in zip([*self.pipelines, *self.shards], results, strict=True):
            backends[name] = healthy = self.verdicts.record(name, check)
            if check is Check.LATE:
                log.info("health_check_late", target=name, late_in_a_row=self.verdicts.late_in_a_row(name),
                         healthy=healthy)
            changed = self.admission.set_health(name, healthy)
            self.metrics.healthy.labels(name).set(1 if healthy else 0)
            if changed:
                log.warning("target_health_changed", target=name, healthy=healthy)
        self._health_round.set()
        self._health_round = asyncio.Event()
        return backends

    async def _watch_room(self, client: ShardClient) -> None:
        """The shard's word that room came back after it refused a Serve (``WatchRoom``), for admission: a
        full shard takes tickets again. While the stream is not open (the shard is down, restarting, or
        older and has no such call) admission asks it again at each health round instead; the stream is
        opened again after the next round."""
        loop = asyncio.get_running_loop()
        while True:
            call = client.decode.WatchRoom(decode_pb2.WatchRoomRequest())
            first = True
            try:
                async for event in call:
                    if first:  # a new stream: its count starts the shard's anew (a restart counts from 0)
                        self.admission.set_watched(client.address, True, event.epoch)
                        self.metrics.room_watch.labels(client.address).set(1)
                        first = False
                    self.on_admitted(self.admission.room_again(client.address, event.epoch, loop.time()))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and not client.told_no_watch:
                    client.told_no_watch = True
                    log.info("room_watch_unimplemented", target=client.address)
            finally:
                call.cancel()
            self.admission.set_watched(client.address, False)
            self.metrics.room_watch.labels(client.address).set(0)
            self.on_admitted(self.admission.poll(loop.time()))
            await self._health_round.wait()

    async def _serving(self, stub: health_pb2_grpc.HealthStub, service_name: str = "") -> Check:
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service_name),
                                        timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return _failed(exc)
        return Check.SERVING if response.status == health_pb2.HealthCheckResponse.SERVING else Check.DOWN

    async def _check_pipeline(self, client: PipelineClient) -> Check:
        # stage 0 answers for the pipeline's service by asking every later stage
        check = await self._serving(client.health, PIPELINE_HEALTH_SERVICE)
        if check is Check.DOWN:
            # what comes back may be a restarted stage 0 with another device cache: ask it again then
            # (num_stages stays: a request admitted just before still splits its layers by it)
            client.stage_info_due = True
        if check is not Check.SERVING:
            return check
        if client.stage_info_due:
            try:
                # asked once each time it comes into rotation: a loaded host gets longer than a health check's 2 s
                info = await client.stages.StageInfo(prefill_pb2.StageInfoRequest(), timeout=STAGE_INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                return _failed(exc)
            client.num_stages, client.stage_info_due = info.num_stages, False
            client.stage_info_round = self.admission.health_round
            self.admission.set_pipeline_shape(client.address, info.num_blocks, info.block_size, info.work_scale)
        elif self.admission.health_round - client.stage_info_round >= WORK_SCALE_EVERY_ROUNDS:
            # its measured speed moves with its load: asked again now and then, beside the rounds
            client.stage_info_round = self.admission.health_round
            task = asyncio.ensure_future(self._refresh_work_scale(client))
            self._refreshes.add(task)
            task.add_done_callback(self._refreshes.discard)
        return Check.SERVING

    async def _refresh_work_scale(self, client: PipelineClient) -> None:
        """The pipeline's measured speed again; a late or failed answer changes nothing (the health check
        decides rotation), and one from a stage 0 that restarted meanwhile is left to the full ask."""
        try:
            info = await client.stages.StageInfo(prefill_pb2.StageInfoRequest(), timeout=STAGE_INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return
        if not client.stage_info_due:
            self.admission.set_pipeline_shape(client.address, info.num_blocks, info.block_size, info.work_scale)

    async def _check_shard(self, client: ShardClient) -> Check:
        check = await self._serving(client.health)
        if check is not Check.SERVING:
            return check
        try:
            stats = await client.decode.Stats(decode_pb2.DecodeStatsRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return _failed(exc)
        client.kv_dtype, client.num_layers, client.entry_bytes = stats.kv_dtype, stats.num_layers, stats.entry_bytes
        self.admission.set_shard_shape(client.address, ShardShape(
            num_pages=stats.num_pages, page_size=stats.page_size, arena_bytes=stats.region_arena_bytes,
            region_bytes_per_token=stats.num_layers * stats.entry_bytes,
            region_trailer_bytes=stats.region_trailer_bytes, max_context=stats.max_context,
        ))
        return Check.SERVING


def _failed(exc: grpc.aio.AioRpcError) -> Check:
    """A check that raised: late when its deadline passed (a busy host), down otherwise (refused, gone)."""
    return Check.LATE if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else Check.DOWN
