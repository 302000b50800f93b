"""A client's ``PoolMaster.Session``: the hot calls (lookup, release, put start/end/revoke) as messages on one
long-lived stream, instead of one unary call each.

Why: a unary call costs the master about 0.3–0.4 ms of CPU in gRPC alone (the
call's setup, metadata, interceptors, teardown), more than most of what the
call does; a message on an open stream costs a third of that (``kvpool bench
master``: ``call_floor_cpu_ms``, ``session_floor_cpu_ms``).

How:
- The stream opens on the first call and again on the first call after it
  broke. It opens outside any request's context, so it is nobody's call: each
  message carries its own request id, parent span, send time and whether
  nobody waits for it, as a unary call's metadata would (the master binds the
  id while it answers, and the RPC trace writes one line per message).
- Calls are numbered; a reader task hands each answer to its caller's future.
  One writer task writes the messages in order: a caller that times out leaves
  its message to be written and its answer to be dropped, because cancelling
  a write would cancel the whole stream (grpc.aio does).
- An answer with a status code raises ``grpc.aio.AioRpcError`` with that code,
  message and field (trailing metadata ``kvpool-field``), as the unary method
  would have; a broken stream fails every call waiting on it with the stream's
  status. So callers handle both forms alike.
- A master that does not know ``Session`` (UNIMPLEMENTED) is called by its unary
  methods from then on.
- Rides: a call nobody waits for (a clean release, a commit: ``ride``) rides on
  the client's next message (``SessionRequest.rides``, applied before its
  body), or on a message of its own once it has waited ``RIDE_WAIT_S``. Each
  message costs the master a floor of gRPC and thread wake-ups (0.09-0.23 ms
  in ``kvpool bench master``), and a busy client sends one every few
  milliseconds: a turn's release rides on its save, its commit on the next
  lookup. ``on_done`` hears each ride's
  outcome: None once applied, else the error its unary call would have
  raised (or the broken stream's: then whether it was applied is unknown).
  A master that predates rides answers without ``rides_taken``: its rides go
  again as calls, and every later one too. ``close`` sends the rides waiting
  and waits for those already sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

from kvpool import tracing
from kvpool.core.admission.retry import session_attempts, session_backoff_s
from kvpool.ha.master_link import epoch_of
from kvpool.request_id import current_request_id
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool.service import stream_metadata
from kvpool.status import FIELD_KEY

log = structlog.get_logger(__name__)

Unary = Callable[..., Awaitable[Any]]


def session_error(code: grpc.StatusCode, details: str, field: str = "") -> grpc.aio.AioRpcError:
    """What a unary call ending with this status raises."""
    trailing = grpc.aio.Metadata((FIELD_KEY, field)) if field else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}

# how long a ride waits for a call to carry it before it goes in a message of its own: a busy client sends one
# sooner, and an idle one loses nothing by 2 ms (nobody waits for a ride; the turn after reads it in order)
RIDE_WAIT_S = 0.002
MAX_RIDES = 64  # on one message (the master takes up to 256)
MAX_RIDE_ITEMS = 4096  # commits and corrupt group ids of one message's rides in all (the master's batch limit)


def ride_items(ride: pool_pb2.SessionRide) -> int:
    """What a ride counts toward ``MAX_RIDE_ITEMS``, as the master counts it: its commits in any form (a commit of
    whole groups has a checksum per key, no key) and its corrupt group ids."""
    end = ride.put_end
    return len(end.items) + max(len(end.keys), len(end.checksums)) + len(ride.release_lease.corrupt_group_ids)
RIDE_TIMEOUT_S = 10.0  # for a message carrying only rides
CLOSE_FLUSH_S = 2.0  # ``close`` waits this long for the rides waiting to be taken
_RIDE_METHODS = {"release_lease": "ReleaseLease", "put_end": "PutEnd"}

RideDone = Callable[[grpc.aio.AioRpcError | None], None]


class MasterSession:
    """One ``Session`` stream to a master, shared by every caller of one client (see the module doc)."""

    def __init__(self, channel: grpc.aio.Channel, stub: pool_pb2_grpc.PoolMasterStub,
                 admit_epoch: Callable[[int], bool] | None = None) -> None:
        self._channel = channel
        # a master with standbys names its epoch in the stream's headers: an older one than seen is refused
        self._admit_epoch = admit_epoch
        self._stub = stub
        self._call: Any = None  # the open stream (grpc.aio.StreamStreamCall), None until opened or once broken
        self._outbox: asyncio.Queue[pool_pb2.SessionRequest | None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ending: set[asyncio.Task[None]] = set()  # ended streams' write sides being closed (``_break``)
        self._pending: dict[int, asyncio.Future[pool_pb2.SessionResponse]] = {}
        self._numbers = itertools.count(1)
        self.unsupported = False  # the master has no Session: unary calls for good
        self.opened = 0  # streams opened (1 while the master stays up)
        self._tracing = tracing.tracing()
        self._rides: list[tuple[pool_pb2.SessionRide, RideDone | None]] = []  # waiting for a message
        self._ride_timer: asyncio.TimerHandle | None = None
        self._ride_tasks: set[asyncio.Task[None]] = set()  # rides' own messages, and rides gone as calls
        self.rides_unsupported = False  # the master predates rides: they go as calls for good

    async def close(self) -> None:
        if self._ride_timer is not None:
            self._ride_timer.cancel()
            self._ride_timer = None
        # the rides waiting, and those already on a message of their own (their wait ran out just before): a
        # cancelled one may never reach the master (no stream: the master is away, and nobody waits)
        if (self._rides or self._ride_tasks) and self._call is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.flush(), CLOSE_FLUSH_S)
        self._break(session_error(grpc.StatusCode.CANCELLED, "the pool client closed"))
        for task in list(self._ride_tasks):
            task.cancel()
        rides, self._rides = self._rides, []
        _rides_failed(rides, session_error(grpc.StatusCode.CANCELLED, "the pool client closed"))

    async def flush(self) -> None:
        """Send the rides waiting now, and wait until every ride sent on a message of its own (or as a call) is
        answered."""
        while self._rides:
            await self._carry_rides()
        while self._ride_tasks:
            await asyncio.gather(*self._ride_tasks, return_exceptions=True)

    def ride(self, kind: str, body: Any, on_done: RideDone | None = None) -> None:
        """``body`` (a ``SessionRide.body`` field named ``kind``: ``release_lease`` or ``put_end``) on this
        client's next message, or on one of its own within ``RIDE_WAIT_S``; nobody waits for it. ``on_done``:
        see the module doc (called on the event loop; it must not raise)."""
        if self.unsupported or self.rides_unsupported:
            self._as_call(kind, body, on_done)
            return
        ride = pool_pb2.SessionRide(request_id=current_request_id(), **{kind: body})
        if self._tracing:
            ride.traceparent = tracing.current_traceparent()
            ride.sent = time.time()
            ride.detached = True  # nobody waits for it
        self._rides.append((ride, on_done))
        if self._ride_timer is None:
            delay = 0.0 if len(self._rides) >= MAX_RIDES else RIDE_WAIT_S
            self._ride_timer = asyncio.get_running_loop().call_later(delay, self._flush_rides)

    def _flush_rides(self) -> None:
        self._ride_timer = None
        if self._rides:  # (no call took them meanwhile) in a message of their own, outside any request's context
            task = contextvars.Context().run(asyncio.get_running_loop().create_task, self._carry_rides())
            self._ride_tasks.add(task)
            task.add_done_callback(self._ride_tasks.discard)

    async def _carry_rides(self) -> None:
        """Send the rides waiting in a message with no body."""
        message = pool_pb2.SessionRequest()
        rides = self._take_rides(message)
        if not rides:
            return
        try:
            response = await self._send(message, time.monotonic() + RIDE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self._rides_lost(rides, exc)
            return
        except asyncio.CancelledError:
            _rides_failed(rides, session_error(grpc.StatusCode.CANCELLED, "the pool client closed"))
            raise
        self._rides_answered(rides, response)

    def _take_rides(self, message: pool_pb2.SessionRequest) -> list[tuple[pool_pb2.SessionRide, RideDone | None]]:
        """Move the rides waiting onto ``message``: up to ``MAX_RIDES``, and (after the first) up to
        ``MAX_RIDE_ITEMS`` items in all, as the master takes them."""
        if not self._rides:
            return []
        count = items = 0
        for ride, _ in self._rides[:MAX_RIDES]:
            items += ride_items(ride)
            if count and items > MAX_RIDE_ITEMS:
                break
            count += 1
        rides, self._rides = self._rides[:count], self._rides[count:]
        if self._rides and self._ride_timer is None:  # more than one message takes: the rest go next
            self._ride_timer = asyncio.get_running_loop().call_later(0.0, self._flush_rides)
        elif not self._rides and self._ride_timer is not None:
            self._ride_timer.cancel()
            self._ride_timer = None
        message.rides.extend([ride for ride, _ in rides])
        return rides

    def _rides_answered(self, rides: list[tuple[pool_pb2.SessionRide, RideDone | None]],
                        response: pool_pb2.SessionResponse) -> None:
        if response.rides_taken != len(rides):  # a master that predates rides: it dropped them unread
            if not self.rides_unsupported:
                log.info("pool_master_without_rides")
            self.rides_unsupported = True
            self._as_calls(rides)
            return
        failures = {f.index: f for f in response.ride_failures}
        for index, (_, on_done) in enumerate(rides):
            failure = failures.get(index)
            error = None if failure is None else session_error(
                _CODES.get(failure.code, grpc.StatusCode.UNKNOWN), failure.message, failure.field)
            _done(on_done, error)

    def _rides_lost(self, rides: list[tuple[pool_pb2.SessionRide, RideDone | None]],
                    error: grpc.aio.AioRpcError) -> None:
        """The message carrying ``rides`` got no answer: a master without ``Session`` takes them as calls; else
        their fate is unknown, and each hears ``error``."""
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._as_calls(rides)
            return
        _rides_failed(rides, error)

    def _as_calls(self, rides: list[tuple[pool_pb2.SessionRide, RideDone | None]]) -> None:
        """Rides a master did not take, each again as a call of its own."""
        for ride, on_done in rides:
            kind = ride.WhichOneof("body")
            self._as_call(kind, getattr(ride, kind), on_done)

    def _as_call(self, kind: str, body: Any, on_done: RideDone | None) -> None:
        """A ride as a call of its own, nobody waiting for it."""
        async def go() -> None:
            try:
                await self.call(kind, body, getattr(self._stub, _RIDE_METHODS[kind]), RIDE_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                _done(on_done, exc)
                return
            _done(on_done, None)
        task = asyncio.get_running_loop().create_task(go())
        self._ride_tasks.add(task)
        task.add_done_callback(self._ride_tasks.discard)

    async def call(self, kind: str, body: Any, unary: Unary, timeout: float, wait_for_ready: bool = False) -> Any:
        """``body`` (a ``SessionRequest.body`` field named ``kind``) answered: its response, or the error the
        unary call would raise. ``unary``: the stub's method, for a master without ``Session``.
        ``wait_for_ready``: with no stream open, wait for the channel (at most ``timeout``) rather than fail
        at once while it reconnects."""
        if self.unsupported:
            return await unary(body, timeout=timeout, wait_for_ready=wait_for_ready)
        deadline = time.monotonic() + timeout
        if self._call is None and wait_for_ready and \
                self._channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            try:
                await asyncio.wait_for(self._channel.channel_ready(), timeout)
            except asyncio.TimeoutError:
                raise session_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the master was not reachable in time")
        message = pool_pb2.SessionRequest(request_id=current_request_id(), **{kind: body})
        if self._tracing:
            message.traceparent = tracing.current_traceparent()
            message.sent = time.time()
            message.detached = tracing.DETACHED.get()
        rides = self._take_rides(message)
        attempts = session_attempts(kind)
        for attempt in range(1, attempts + 1):
            try:
                response = await self._send(message, deadline)
                break
            except grpc.aio.AioRpcError as exc:
                if rides:  # unanswered: they do not go again with the call
                    message.ClearField("rides")
                    self._rides_lost(rides, exc)
                    rides = []
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.unsupported = True  # an older master
                    log.info("pool_master_without_session", details=exc.details())
                    return await unary(body, timeout=max(0.0, deadline - time.monotonic()),
                                       wait_for_ready=wait_for_ready)
                # the stream broke before this call's answer: an idempotent call goes again, as gRPC would, but
                # only over a connection that is up (a master that is down is a miss now, not after the backoff)
                wait = session_backoff_s(attempt + 1)
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == attempts or \
                        time.monotonic() + wait >= deadline or \
                        self._channel.get_state() != grpc.ChannelConnectivity.READY:
                    raise
                await asyncio.sleep(wait)
            except asyncio.CancelledError:
                if rides:  # the caller went away: the message may still go, but its answer will not be read
                    _rides_failed(rides, session_error(grpc.StatusCode.CANCELLED, "the call carrying it was cancelled"))
                raise
        if rides:
            self._rides_answered(rides, response)
        if response.code:
            raise session_error(_CODES.get(response.code, grpc.StatusCode.UNKNOWN), response.message, response.field)
        return getattr(response, kind)

    async def _send(self, message: pool_pb2.SessionRequest, deadline: float) -> pool_pb2.SessionResponse:
        number = message.call = next(self._numbers)
        answer: asyncio.Future[pool_pb2.SessionResponse] = asyncio.get_running_loop().create_future()
        self._pending[number] = answer
        try:
            self._open().put_nowait(message)
            return await asyncio.wait_for(answer, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise session_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            self._pending.pop(number, None)

    # ---- the stream -------------------------------------------------------

    def _open(self) -> asyncio.Queue[pool_pb2.SessionRequest | None]:
        if self._call is not None and self._outbox is not None:
            return self._outbox
        # opened in an empty context: the stream carries no request's id or span (its messages do)
        return contextvars.Context().run(self._start)

    def _start(self) -> asyncio.Queue[pool_pb2.SessionRequest | None]:
        outbox: asyncio.Queue[pool_pb2.SessionRequest | None] = asyncio.Queue()
        call = self._stub.Session(metadata=stream_metadata())
        self._call, self._outbox = call, outbox
        self.opened += 1
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write(call, outbox)), loop.create_task(self._read(call))]
        return outbox

    async def _write(self, call: Any, outbox: asyncio.Queue[pool_pb2.SessionRequest | None]) -> None:
        try:
            # the master's headers first: a stream refused as it opens ends with its own status (a write racing
            # the refusal would fail with a client-side send error that hides it)
            headers = await call.initial_metadata()
            if call.done():
                self._break(await self._status(call, None), call)
                return
            if self._admit_epoch is not None and not self._admit_epoch(epoch_of(headers)):
                self._break(session_error(grpc.StatusCode.UNAVAILABLE, "a deposed master answered (older epoch)"),
                            call)
                return
            while True:
                message = await outbox.get()
                if message is None:
                    return
                await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self._break(await self._status(call, exc), call)
        except asyncio.CancelledError:
            pass

    async def _read(self, call: Any) -> None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                answer = self._pending.get(response.call)
                if answer is not None and not answer.done():
                    answer.set_result(response)
            error = await self._status(call, None)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            return
        self._break(error, call)

    async def _status(self, call: Any, exc: BaseException | None) -> grpc.aio.AioRpcError:
        """The stream's own status when it has ended (a write to a stream the master already refused fails
        with an INTERNAL send error that hides it), else ``exc``'s."""
        failed_send = isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INTERNAL
        if call.done() or failed_send:
            try:  # a failed send ends the call at once: its status is on its way
                code = await asyncio.wait_for(call.code(), 1.0)
                details = await call.details()
            except (grpc.aio.AioRpcError, asyncio.CancelledError, asyncio.TimeoutError):
                code, details = grpc.StatusCode.OK, ""
            if code != grpc.StatusCode.OK:
                return session_error(code, details or code.name)
        if isinstance(exc, grpc.aio.AioRpcError):
            return exc
        try:
            code, details = await call.code(), await call.details()
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            code, details = grpc.StatusCode.UNAVAILABLE, "the session stream ended"
        if code == grpc.StatusCode.OK:  # the master closed the stream: it is going away
            code, details = grpc.StatusCode.UNAVAILABLE, "the master ended the session stream"
        return session_error(code, details or code.name)

    def _break(self, error: grpc.aio.AioRpcError, call: Any = None) -> None:
        """The stream is gone (``call``: this one, if still current): every caller waiting on it gets
        ``error``; the next call opens a new one."""
        if call is not None and call is not self._call:
            return
        if self._call is not None and not self._call.cancel():
            # it ended by itself (the master went away): with interceptors on the channel, grpc.aio feeds our
            # writes to the call through a task of its own, which a cancel of an ended call leaves waiting for
            # the next write; destroyed pending, it spills "aclose(): asynchronous generator is already
            # running" errors into the log. Closing the write side ends it.
            ending = asyncio.get_running_loop().create_task(_end_writes(self._call))
            self._ending.add(ending)
            ending.add_done_callback(self._ending.discard)
        self._call = self._outbox = None
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = []
        pending, self._pending = self._pending, {}
        for answer in pending.values():
            if not answer.done():
                answer.set_exception(error)
        if error.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNIMPLEMENTED):
            log.info("pool_session_broken", code=error.code().name, details=error.details(), waiting=len(pending))


def _done(on_done: RideDone | None, error: grpc.aio.AioRpcError | None) -> None:
    if on_done is None:
        return
    try:
        on_done(error)
    except Exception:  # a bug in the callback: the session goes on
        log.exception("pool_ride_callback_failed")


def _rides_failed(rides: list[tuple[pool_pb2.SessionRide, RideDone | None]], error: grpc.aio.AioRpcError) -> None:
    for _, on_done in rides:
        _done(on_done, error)


async def _end_writes(call: Any) -> None:
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await call.done_writing()
