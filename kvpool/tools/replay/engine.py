"""The replay engine: trace sessions as agents drive them, against a router's OpenAI-compatible HTTP API.

Use it against any router::

    from kvpool.tools.replay import ReplayOptions, load_workload, run_replay
    workload = load_workload("../shared/traces/agentx-weka", scale=16, vocab_size=1024, context=32768,
                             max_tokens=64, sessions=4)
    result = asyncio.run(run_replay("http://127.0.0.1:8000", workload, ReplayOptions(concurrency=4)))
    result.summary["reuse_ratio"], result.records[0].ttft_s

Load: a closed loop of ``concurrency`` sessions (a free slot takes the next
session; a Mooncake arrival also waits for its scaled timestamp). Inside a
session every agent timeline runs on its own (``kvpool.tools.replay.schedule``), so
a subagent's requests overlap its parent's. Each request is a streaming
``/v1/completions`` with the prompt as token ids, ``prompt_cache_key`` = the
session id, ``max_tokens`` = the turn's, temperature 0 and
``stream_options.include_usage``; TTFT is the first streamed choice, the
inter-token latency the gaps between later text chunks (the router holds back
the bytes of an unfinished UTF-8 character, so a chunk can carry more than one
token), both as this client saw them. A request that fails (HTTP error, error event, no usage) is a record
with ``error`` set; its timeline goes on. ``duration_s`` stops issuing new
requests once passed; what is in flight finishes.

``ReplayResult.summary`` is ``kvpool.tools.replay.report.summarize`` of the run: a
flat dict of plain values (the CLI's JSON line); ``records`` are per request
in issue order, the order the reuse bound is computed in.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool.tools.api_key import auth_headers
from kvpool.tools.replay.probes import ClusterProbes, DecodeSampler, pool_stats, snapshot
from kvpool.tools.replay.records import ReplayOptions, ReplayResult, TurnRecord
from kvpool.tools.replay.report import summarize
from kvpool.tools.replay.schedule import PlannedTurn, SessionSchedule, TurnRef
from kvpool.tools.replay.workload import ReplaySession, ReplayTurn, ReplayWorkload
from kvpool.tools.sse import StreamError, served_model, stream_events


async def stream_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any], record: TurnRecord,
                      clock: Callable[[], float] = time.perf_counter) -> None:
    """POST one streaming completion; fill ``record`` (timings, usage) or its ``error``."""
    started = clock()
    last = 0.0
    usage: dict[str, Any] = {}
    try:
        async for event in stream_events(client, url, "/v1/completions", body):
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices"):
                record.text += event["choices"][0].get("text") or ""
                now = clock()
                if not record.ttft_s:
                    record.ttft_s = now - started
                elif event["choices"][0].get("text"):  # the closing finish event carries no token
                    record.itl_s.append(now - last)
                last = now
    except StreamError as exc:
        record.error = str(exc)
        record.status = exc.status or 0
        record.lost = exc.silent
        return
    record.latency_s = clock() - started
    if not usage:
        record.error = "no usage in the stream"
        record.lost = True  # it ended as if done, yet it is not
        return
    ext = usage.get("kvpool", {})
    record.completion_tokens = int(usage.get("completion_tokens", 0))
    for name in ("device_tokens", "pool_tokens", "computed_tokens", "handoff_transfers", "handoff_bytes"):
        setattr(record, name, int(ext.get(name, 0)))
    record.server_ttft_s = float(ext.get("ttft_seconds", 0.0))
    record.pipeline, record.shard = str(ext.get("pipeline", "")), str(ext.get("shard", ""))


@dataclass(slots=True)
class _Run:
    """The state of one replay: who is issued, what came back."""

    client: httpx.AsyncClient
    url: str
    model: str
    workload: ReplayWorkload
    options: ReplayOptions
    started: float
    records: list[TurnRecord] = field(default_factory=list)
    on_record: Callable[[TurnRecord], None] | None = None

    def expired(self, now: float) -> bool:
        return self.options.duration_s is not None and now - self.started >= self.options.duration_s

    async def send(self, session: ReplaySession, turn: ReplayTurn) -> TurnRecord:
        record = TurnRecord(session.id, turn.index, turn.agent_id, len(self.records), turn.prompt_tokens,
                            turn.max_tokens, issued_at=time.perf_counter() - self.started)
        self.records.append(record)
        prompt = session.token_ids(turn, self.workload.scale, self.workload.vocab_size)
        body = {"model": self.model, "prompt": prompt, "max_tokens": turn.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "prompt_cache_key": session.id}
        if self.options.session_hints:
            body.update(session_hints(session, turn, self.options.think_scale))
        try:
            await stream_turn(self.client, self.url, body, record)
        except Exception as exc:  # noqa: BLE001 - any failure is this request's error; the replay goes on
            record.error = f"{type(exc).__name__}: {exc}"
        if self.on_record is not None:
            self.on_record(record)
        return record

    async def session(self, session: ReplaySession) -> None:
        """Every timeline of ``session`` on its own schedule, until all are answered (or the run expires)."""
        planned = [PlannedTurn(t.t, t.think_time) for t in session.turns]
        schedule = SessionSchedule(planned, session.timelines, time.perf_counter(), self.options.think_scale)
        running: dict[asyncio.Task[TurnRecord], TurnRef] = {}
        while not schedule.done:
            now = time.perf_counter()
            if not self.expired(now):
                for ref in schedule.pop_due(now):
                    running[asyncio.ensure_future(self.send(session, session.turns[ref.turn]))] = ref
            elif not running:
                return
            due = schedule.next_due()
            timeout = None if due is None or self.expired(now) else max(0.0, due - time.perf_counter())
            if not running:
                if timeout is None:
                    raise RuntimeError(f"session {session.id}: nothing running and nothing due")
                await asyncio.sleep(timeout)
                continue
            finished, _ = await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                schedule.complete(running.pop(task), time.perf_counter())

    async def worker(self, pending: deque[ReplaySession]) -> None:
        while pending and not self.expired(time.perf_counter()):
            session = pending.popleft()
            arrival = self.started + session.arrival_s * self.options.think_scale
            if arrival > time.perf_counter():
                await asyncio.sleep(arrival - time.perf_counter())
            await self.session(session)


def session_hints(session: ReplaySession, turn: ReplayTurn, think_scale: float) -> dict[str, Any]:
    """kvpool's session hints for one turn: ``session_end`` on the session's last turn, else
    ``expected_next_s``, the next turn's think time as this replay plays it."""
    if turn.index + 1 >= len(session.turns):
        return {"session_end": True}
    return {"expected_next_s": min(86_400.0, session.turns[turn.index + 1].think_time * think_scale)}


async def run_replay(url: str, workload: ReplayWorkload, options: ReplayOptions,
                     probes: ClusterProbes | None = None) -> ReplayResult:
    """Replay ``workload`` against the router at ``url``; figures from ``probes`` when given (see module doc)."""
    url = url.rstrip("/")
    probes = probes or ClusterProbes(router=url)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(options.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=auth_headers()) as client:
        model = options.model or (await served_model(client, url))[0]
        before = await snapshot(client, probes)
        progress = _Progress(workload.num_turns) if options.progress else None
        run = _Run(client, url, model, workload, options, time.perf_counter(),
                   on_record=progress.update if progress else None)
        sampler = DecodeSampler(client, probes.decode)
        sampling = asyncio.ensure_future(sampler.run()) if probes.decode else None
        pending = deque(workload.sessions)
        try:
            await asyncio.gather(*(run.worker(pending) for _ in range(min(options.concurrency, len(pending)))))
        finally:
            if sampling is not None:
                sampling.cancel()
            if progress is not None:
                progress.close()
        wall_s = time.perf_counter() - run.started
        after = await snapshot(client, probes)
    result = ReplayResult(options.concurrency, wall_s, run.records, before, after, await pool_stats(probes.master),
                          sampler.samples, started_at=run.started)
    result.summary = summarize(result, workload, options)
    return result


class _Progress:
    """A tqdm bar over the turns with live prompt throughput and reuse (to stderr)."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="turn", dynamic_ncols=True, leave=False)
        self.started = time.perf_counter()
        self.prompt = self.cached = self.errors = 0

    def update(self, record: TurnRecord) -> None:
        self.prompt += record.prompt_tokens
        self.cached += record.device_tokens + record.pool_tokens
        self.errors += record.error is not None
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.prompt / elapsed:,.0f} prompt tok/s, reuse "
                                 f"{self.cached / max(self.prompt, 1):.1%}, errors {self.errors}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
