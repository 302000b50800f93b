"""The master's ``Session`` stream, through a real gRPC server (the master's servicer, every interceptor a
service has) and the pool client: the same answers as the unary calls, one stream for many calls, an error
ending only its own call, the request id and trace carried per message, a master without ``Session``, a
stream that breaks and one that does not answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvpool import service
from kvpool.core.pool.records import PutRequestItem
from kvpool.pool.client import PoolClient
from kvpool.request_id import bound_request_id
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool.tracing import TRACE_ENV
from kvpool.services.master.metrics import MasterMetrics
from kvpool.services.master.servicer import PoolMasterServicer
from tests.core.fixtures import KB, make_index


def filled(groups: int = 6) -> PoolMasterServicer:
    index, _ = make_index(segment_bytes=1024 * KB, segments=2)
    for g in range(groups):
        items = [PutRequestItem(f"g{g}/{stage}", f"g{g}", 4, KB) for stage in range(4)]
        index.put_start("host0", items)
        index.put_end([(item.key, 100 * g + i + 1) for i, item in enumerate(items)])
    return PoolMasterServicer(index, "test", 1.0, MasterMetrics(CollectorRegistry()))


async def serving(servicer: PoolMasterServicer, port: int = 0) -> service.ServerHandle:
    return await service.create_server("127.0.0.1", port,
                                       lambda s: pool_pb2_grpc.add_PoolMasterServicer_to_server(servicer, s),
                                       service_names=["kvpool.rpc.PoolMaster"])


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


@contextlib.asynccontextmanager
async def client_of(servicer: PoolMasterServicer) -> AsyncIterator[PoolClient]:
    """A pool client of ``servicer`` served over real gRPC; both closed at the end."""
    handle = await serving(servicer)
    client = PoolClient(f"127.0.0.1:{handle.port}", None, host_name="host0")
    try:
        yield client
    finally:
        await client.close()
        await handle.server.stop(None)


def test_session_answers_as_the_unary_calls_do_on_one_stream() -> None:
    async def body() -> None:
        servicer = filled()
        handle = await serving(servicer)
        client = PoolClient(f"127.0.0.1:{handle.port}", None, host_name="host0")
        stub = pool_pb2_grpc.PoolMasterStub(client._channel)
        try:
            ids = [f"g{g}" for g in range(6)] + ["missing"]
            found = await client.lookup(ids, lease_ms=5000, held_prefix=2)
            unary = await stub.Lookup(pool_pb2.LookupRequest(group_ids=ids, lease_ms=5000, held_prefix=2,
                                                             packed=True))
            assert (found.num_complete, found.first) == (6, 2) == (unary.num_complete, 2)
            assert [g.group_id for g in found.groups] == list(unary.packed.group_id) == ["g2", "g3", "g4", "g5"]
            assert found.groups[0].members["g2/1"].checksum == 202
            assert found.lease_id and found.lease_id != unary.lease_id
            await client.release(found.lease_id)  # a ride: on the next message, or on its own within 2 ms
            assert servicer.index.num_leases == 2
            await client.session.flush()
            released = await stub.ReleaseLease(pool_pb2.ReleaseLeaseRequest(lease_id=found.lease_id))
            assert not released.released  # the session's release ended it already
            assert servicer.index.num_leases == 1  # the unary lookup's lease alone

            # a put: reserve, commit, and a revoke of what was not written
            reserved = await client.reserve([("n/0", "n", 1, KB), ("r/0", "r", 1, KB), ("g0/0", "g0", 4, KB)])
            assert [type(r).__name__ for r in reserved] == ["ObjectLocation", "ObjectLocation", "PutResult"]
            assert await client.commit([("n/0", 7)])
            await client.revoke(["r/0"])
            assert servicer.index.objects["n/0"].committed and "r/0" not in servicer.index.objects

            # calls at once share the stream, each answered its own
            many = await asyncio.gather(*(client.lookup([f"g{g}"], lease_ms=5000) for g in range(6)))
            assert [r.groups[0].group_id for r in many] == [f"g{g}" for g in range(6)]
            assert len({r.lease_id for r in many}) == 6
            await asyncio.gather(*(client.release(r.lease_id) for r in many))
            assert client.session.opened == 1 and not client.session.unsupported
        finally:
            await client.close()
            await handle.server.stop(None)
    run(body)


def test_an_error_answers_only_its_own_call_and_names_the_field() -> None:
    async def body() -> None:
        handle = await serving(filled())
        client = PoolClient(f"127.0.0.1:{handle.port}", None, host_name="host0")
        try:
            with pytest.raises(ValueError, match=r"group_ids\[1\]"):
                await client.lookup(["g0", ""], lease_ms=5000)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.session.call("put_end", pool_pb2.PutEndRequest(), client._stub.PutEnd, timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "items" in refused.value.details()
            assert (await client.lookup(["g0"])).num_complete == 1  # the stream went on
            assert client.session.opened == 1
        finally:
            await client.close()
            await handle.server.stop(None)
    run(body)


def test_a_message_without_a_call_or_that_does_not_parse_is_refused() -> None:
    async def body() -> None:
        handle = await serving(filled())
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
        try:
            session = pool_pb2_grpc.PoolMasterStub(channel).Session()
            await session.write(pool_pb2.SessionRequest(call=5))
            answer = await session.read()
            assert (answer.call, answer.code, answer.field) == (5, grpc.StatusCode.INVALID_ARGUMENT.value[0], "body")
            await session.write(pool_pb2.SessionRequest(call=6, lookup=pool_pb2.LookupRequest(group_ids=["g1"])))
            assert (await session.read()).lookup.num_complete == 1
            await session.done_writing()
            assert await session.read() is grpc.aio.EOF

            raw = channel.stream_stream("/kvpool.rpc.PoolMaster/Session", request_serializer=lambda b: b,
                                        response_deserializer=pool_pb2.SessionResponse.FromString)()
            await raw.write(b"\xff\xff\xff")  # not a SessionRequest
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await raw.read()
            assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request: not a kvpool.rpc.SessionRequest" in ended.value.details()
        finally:
            await channel.close()
            await handle.server.stop(None)
    run(body)


def test_each_message_carries_its_request_id_into_the_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))

    async def body() -> None:
        servicer = filled()
        handle = await serving(servicer)
        client = PoolClient(f"127.0.0.1:{handle.port}", None, host_name="host0")
        try:
            with bound_request_id("req-one"):
                found = await client.lookup(["g0", "g1"], lease_ms=5000)
            with bound_request_id("req-two"):
                await client.release(found.lease_id)
        finally:
            await client.close()
            await handle.server.stop(None)
    run(body)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(x["request_id"], x["method"], x["kind"]) for x in lines] == [
        ("req-one", "/kvpool.rpc.PoolMaster/Lookup", "session"),
        ("req-two", "/kvpool.rpc.PoolMaster/ReleaseLease", "session")]
    assert all(x["messages_in"] == x["messages_out"] == 1 and len(x["answers"]) == 1 for x in lines)
    assert all(x["sent"] <= x["start"] <= x["end"] for x in lines)


class OldMaster(PoolMasterServicer):
    """A master from before ``Session``: the generated base answers UNIMPLEMENTED."""

    Session = pool_pb2_grpc.PoolMasterServicer.Session  # type: ignore[assignment]


def test_a_master_without_session_is_called_by_its_unary_methods() -> None:
    async def body() -> None:
        old = filled()
        old.__class__ = OldMaster
        handle = await serving(old)
        client = PoolClient(f"127.0.0.1:{handle.port}", None, host_name="host0")
        try:
            found = await client.lookup(["g0", "g1", "g2"], lease_ms=5000)
            assert found.num_complete == 3 and client.session.unsupported
            await client.release(found.lease_id)  # (nobody waits for a release: it goes as a call of its own)
            await client.session.flush()
            assert old.index.num_leases == 0 and not client.session._ride_tasks
            assert [type(r).__name__ for r in await client.reserve([("m/0", "m", 1, KB)])] == ["ObjectLocation"]
            assert await client.commit([("m/0", 3)])
        finally:
            await client.close()
            await handle.server.stop(None)
    run(body)


def test_a_broken_stream_fails_its_calls_and_the_next_call_opens_another() -> None:
    async def body() -> None:
        handle = await serving(filled())
        port = handle.port
        client = PoolClient(f"127.0.0.1:{port}", None, host_name="host0")
        try:
            assert (await client.lookup(["g0"])).num_complete == 1
            await handle.server.stop(None)  # the master goes away: a lookup misses at once, no hang
            missed = await asyncio.wait_for(client.lookup(["g0"]), 10)
            assert missed.num_complete == 0
            handle = await serving(filled(), port)  # back on the same port
            for _ in range(100):  # the channel reconnects within its capped backoff
                if (await client.lookup(["g0"])).num_complete == 1:
                    break
                await asyncio.sleep(0.05)
            assert (await client.lookup(["g1"])).num_complete == 1
            assert client.session.opened >= 2
        finally:
            await client.close()
            await handle.server.stop(None)
    run(body)


class SilentMaster(PoolMasterServicer):
    """Reads its session's messages and answers none of them."""

    async def Session(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        async for _ in requests:
            pass
        if False:  # an async generator that yields nothing
            yield None


def test_a_call_not_answered_in_time_times_out_alone() -> None:
    async def body() -> None:
        silent = filled()
        silent.__class__ = SilentMaster
        handle = await serving(silent)
        client = PoolClient(f"127.0.0.1:{handle.port}", None, host_name="host0")
        try:
            request = pool_pb2.LookupRequest(group_ids=["g0"])
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await client.session.call("lookup", request, client._stub.Lookup, timeout=0.3)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert client.session.opened == 1 and client.session._call is not None  # the stream lives on
            assert not client.session._pending
        finally:
            await client.close()
            await handle.server.stop(None)
    run(body)


# ---- rides: calls nobody waits for, on the next message ---------------------------------------------------------


class CountingMaster(PoolMasterServicer):
    """Counts the Session messages it answers, and what each carried."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.messages: list[tuple[str | None, list[str]]] = []

    def session_answer(self, message: pool_pb2.SessionRequest) -> pool_pb2.SessionResponse:
        self.messages.append((message.WhichOneof("body"), [r.WhichOneof("body") for r in message.rides]))
        return super().session_answer(message)


def counting() -> CountingMaster:
    master = filled()
    master.__class__ = CountingMaster
    master.messages = []  # type: ignore[attr-defined]
    return master  # type: ignore[return-value]


def test_a_release_and_a_commit_ride_on_the_next_call_and_are_applied_before_it() -> None:
    async def body() -> None:
        master = counting()
        done: list[bool] = []
        async with client_of(master) as client:
            found = await client.lookup(["g0", "g1"], lease_ms=5000)
            reserved = await client.reserve([("n/0", "n", 1, KB)])
            assert type(reserved[0]).__name__ == "ObjectLocation"
            await client.release(found.lease_id)
            client.commit_soon([("n/0", 9)], done.append)
            assert master.index.num_leases == 1 and not master.index.objects["n/0"].committed  # not sent yet
            # the next call carries both, and the master applied them first: the lookup finds the new group
            again = await client.lookup(["n"], lease_ms=5000)
            assert again.num_complete == 1 and done == [True]
            assert master.messages[-1] == ("lookup", ["release_lease", "put_end"])
            assert master.index.num_leases == 1  # the new lookup's own
            assert master.index.objects["n/0"].committed and master.index.objects["n/0"].checksum == 9
            assert len(master.messages) == 3  # lookup, put_start, lookup: no message of their own
    run(body)


def test_a_ride_with_no_call_to_carry_it_goes_alone_within_its_wait_and_close_sends_those_waiting() -> None:
    async def body() -> None:
        master = counting()
        handle = await serving(master)
        client = PoolClient(f"127.0.0.1:{handle.port}", None, host_name="host0")
        try:
            found = await client.lookup(["g0"], lease_ms=5000)
            await client.release(found.lease_id)
            for _ in range(200):  # RIDE_WAIT_S is 2 ms
                if master.index.num_leases == 0:
                    break
                await asyncio.sleep(0.01)
            assert master.index.num_leases == 0
            assert master.messages == [("lookup", []), (None, ["release_lease"])]
            # one more, and the client closes before its wait is over: close sends it
            found = await client.lookup(["g1"], lease_ms=5000)
            await client.release(found.lease_id)
        finally:
            await client.close()
        assert master.index.num_leases == 0 and master.messages[-1] == (None, ["release_lease"])
        await handle.server.stop(None)
    run(body)


def test_close_waits_for_a_ride_already_on_a_message_of_its_own() -> None:
    """A release whose wait ran out just before the client closed is on its way in a message of its own: close
    waits for its answer (cancelling it lost the release: the lease held until it expired)."""
    async def body() -> None:
        master = counting()
        handle = await serving(master)
        client = PoolClient(f"127.0.0.1:{handle.port}", None, host_name="host0")
        told: list[object] = []
        try:
            found = await client.lookup(["g0"], lease_ms=60_000)
            client.session.ride("release_lease", pool_pb2.ReleaseLeaseRequest(lease_id=found.lease_id), told.append)
            client.session._flush_rides()  # its wait ran out: a message of its own, which nobody waits for,
            await asyncio.sleep(0)  # takes it and goes
            assert not client.session._rides and client.session._ride_tasks
        finally:
            await client.close()
        assert told == [None]  # applied, not cancelled
        assert master.index.num_leases == 0 and master.messages[-1] == (None, ["release_lease"])
        await handle.server.stop(None)
    run(body)


def test_a_ride_that_fails_is_told_to_its_caller_and_fails_neither_the_others_nor_the_call() -> None:
    async def body() -> None:
        master = counting()
        outcomes: list[tuple[str, bool]] = []
        async with client_of(master) as client:
            await client.reserve([("a/0", "a", 1, KB), ("b/0", "b", 1, KB)])
            client.commit_soon([("a/0", 1)], lambda ok: outcomes.append(("a", ok)))
            client.commit_soon([("never/0", 2)], lambda ok: outcomes.append(("never", ok)))  # never reserved
            client.commit_soon([("b/0", 3)], lambda ok: outcomes.append(("b", ok)))
            assert (await client.lookup(["g0"])).num_complete == 1  # the carrier is answered as ever
            assert outcomes == [("a", True), ("never", False), ("b", True)]
            assert master.index.objects["a/0"].committed and master.index.objects["b/0"].committed
    run(body)


def test_the_master_answers_each_ride_in_order_and_names_a_bad_ones_field() -> None:
    servicer = filled()
    index = servicer.index
    found = index.lookup(["g0"], 5.0)
    index.put_start("host0", [PutRequestItem("c/0", "c", 1, KB)])
    ride = pool_pb2.SessionRide
    message = pool_pb2.SessionRequest(call=3, rides=[
        ride(request_id="req-1", release_lease=pool_pb2.ReleaseLeaseRequest(lease_id=found.lease_id)),
        ride(put_end=pool_pb2.PutEndRequest()),  # no items
        ride(),  # no call
        ride(put_end=pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key="c/0", checksum=4)])),
    ], lookup=pool_pb2.LookupRequest(group_ids=["c"]))
    answer = servicer.session_answer(message)
    assert answer.code == 0 and answer.lookup.num_complete == 1  # the commit came first
    assert answer.rides_taken == 4 and not index.release_lease(found.lease_id)  # the first ride ended it
    assert [(f.index, grpc.StatusCode.INVALID_ARGUMENT.value[0] == f.code, f.field) for f in answer.ride_failures] == [
        (1, True, "rides[1].items"), (2, True, "rides[2].body")]
    assert "rides[1]: items: must not be empty" in answer.ride_failures[0].message
    # rides alone (a client flushing them), and more than a call takes: each fails, nothing applied
    alone = servicer.session_answer(pool_pb2.SessionRequest(call=4, rides=[
        ride(release_lease=pool_pb2.ReleaseLeaseRequest(lease_id=12345))]))
    assert (alone.code, alone.rides_taken, len(alone.ride_failures), alone.WhichOneof("body")) == (0, 1, 0, None)
    many = servicer.session_answer(pool_pb2.SessionRequest(call=5, rides=[ride(
        release_lease=pool_pb2.ReleaseLeaseRequest(lease_id=1))] * 257))
    assert many.rides_taken == 257 and len(many.ride_failures) == 257 and many.ride_failures[0].field == "rides"
    assert "257 rides of 0 items in all is more than 256 rides" in many.ride_failures[0].message
    commit = pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key="c/0", checksum=4)] * 2049)
    heavy = servicer.session_answer(pool_pb2.SessionRequest(call=6, rides=[ride(put_end=commit)] * 2))
    assert len(heavy.ride_failures) == 2 and "4098 items in all" in heavy.ride_failures[0].message


class MasterBeforeRides(PoolMasterServicer):
    """A master with ``Session`` from before rides: it never reads them, and its answers do not count them."""

    def session_answer(self, message: pool_pb2.SessionRequest) -> pool_pb2.SessionResponse:
        message.ClearField("rides")
        if message.WhichOneof("body") is None:
            return pool_pb2.SessionResponse(call=message.call, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                            message="body: names no call", field="body")
        return super().session_answer(message)


def test_a_master_that_predates_rides_gets_them_again_as_calls() -> None:
    async def body() -> None:
        old = filled()
        old.__class__ = MasterBeforeRides
        done: list[bool] = []
        async with client_of(old) as client:
            found = await client.lookup(["g0"], lease_ms=5000)
            await client.reserve([("m/0", "m", 1, KB)])
            await client.release(found.lease_id)
            client.commit_soon([("m/0", 5)], done.append)
            await client.lookup(["g1"])  # carries them; the master drops them unread, and the client sees it
            await client.session.flush()
            assert client.session.rides_unsupported and done == [True]
            assert old.index.objects["m/0"].committed
            assert not old.index.release_lease(found.lease_id)  # released already
            found = await client.lookup(["g2"], lease_ms=5000)
            await client.release(found.lease_id)  # from now on a call of its own at once
            await client.session.flush()
            assert not old.index.release_lease(found.lease_id)
    run(body)


class DowngradedMaster(PoolMasterServicer):
    """A master whose build goes back to one from before history handles (``old``): it never reads a lookup's
    handle fields (unknown to it) and never answers one."""

    old = False

    def lookup(self, request: Any, response: Any = None) -> Any:
        if not self.old:
            return super().lookup(request, response)
        request.ClearField("history")
        request.ClearField("history_groups")
        answer = super().lookup(request, response)
        answer.ClearField("history")
        return answer


def test_a_handle_refused_by_a_master_that_predates_handles_asks_again_by_every_id() -> None:
    async def body() -> None:
        master = DowngradedMaster(filled().index, "test", 1.0, MasterMetrics(CollectorRegistry()))
        async with client_of(master) as client:
            first = await client.lookup(["g0", "g1", "g2"], lease_ms=5000)
            assert first.num_complete == 3 and len(client.histories) == 1  # a handle for g0..g2
            await client.release(first.lease_id)
            master.old = True
            # the handle stands for 3 ids and 3 more follow; the old master reads a history of 3 groups with a held
            # prefix of 4, and refuses it: the client asks again by every id
            again = await client.lookup([f"g{g}" for g in range(6)], lease_ms=5000, held_prefix=4)
            assert (again.num_complete, again.first) == (6, 4)
            assert [g.group_id for g in again.groups] == ["g4", "g5"] and len(client.histories) == 0
    run(body)


def test_rides_past_a_messages_item_limit_go_on_the_next_message() -> None:
    async def body() -> None:
        index, _ = make_index(segment_bytes=1024 * KB, segments=2)
        master = CountingMaster(index, "test", 1.0, MasterMetrics(CollectorRegistry()))
        done: list[bool] = []
        async with client_of(master) as client:
            batches = [[(f"b{b}-{i}/0", f"b{b}-{i}", 1, 64) for i in range(1500)] for b in range(3)]
            for batch in batches:
                assert all(type(r).__name__ == "ObjectLocation" for r in await client.reserve(batch))
            for batch in batches:  # 4,500 commits in all: more than one message takes (4,096)
                client.commit_soon([(key, 1) for key, _, _, _ in batch], done.append)
            await client.lookup(["b0-0"])
            await client.session.flush()
            assert done == [True, True, True]
            assert master.messages[-2:] == [("lookup", ["put_end", "put_end"]), (None, ["put_end"])]
            assert all(index.objects[key].committed for batch in batches for key, _, _, _ in batch)
    run(body)


def test_a_unary_call_right_after_a_riding_release_or_commit_sees_it() -> None:
    # a release or commit_soon rides (nobody waits); a unary call sent at once could overtake it, so the client
    # sends its rides first: Remove would find the group leased (busy), Exists the object not committed, Stats
    # count the lease; and a release touches its groups again when the order moved since its lookup (a demote
    # moved it), so applied after a Demote it would undo it
    async def body() -> None:
        servicer = filled()
        async with client_of(servicer) as client:

            async def released(group_id: str) -> None:
                found = await client.lookup([group_id], lease_ms=5000)
                await client.release(found.lease_id)
                assert servicer.index.num_leases == 1  # not sent yet

            await released("g0")
            assert await client.remove(["g0"]) == (1, [])
            reserved = await client.reserve([("n/0", "n", 1, KB)])
            assert type(reserved[0]).__name__ == "ObjectLocation"
            client.commit_soon([("n/0", 7)])
            assert await client.exists(["n/0"]) == [True]
            await released("g1")
            assert (await client.stats()).num_leases == 0
            await released("g2")
            assert await client.demote(["g2"]) == 1
            await client.session.flush()  # (without the demote's own flush, the release lands now)
            assert next(iter(servicer.index.group_table.groups)) == "g2"  # first to be evicted

    run(body)
