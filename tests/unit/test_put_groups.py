"""A put of whole groups (``PutStartRequest.groups``) and a commit as two flat arrays (``PutEndRequest.keys``,
``.checksums``) or as whole groups (``PutEndRequest.groups``), exactly: the items a put stands for in either
layout, the same answer and the same index as those items sent one message each (evicting, with existing keys,
over two segments), what a client sends which way and falls back on, and every bad field refused by name."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kvpool import service
from kvpool.core.chunk_hash import save_objects
from kvpool.core.errors import FailedPrecondition, InvalidArgument
from kvpool.core.pool.put_groups import as_commit_groups, as_groups, group_items, group_keys, in_item_order
from kvpool.pool.client import OLD_EMPTY_PUT, PoolClient, put_end_request, put_start_request
from kvpool.pool.objects import ObjectLocation
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool.services.master.metrics import MasterMetrics
from kvpool.services.master.servicer import MAX_BATCH, MAX_KEY_BYTES, PoolMasterServicer, commit_keys
from tests.core.fixtures import KB, make_index


def test_the_items_of_whole_groups_in_either_layout() -> None:
    assert group_items(["a", "b"], [3, 5], by_member=True) == (["a/0", "b/0", "a/1", "b/1"], ["a", "b", "a", "b"],
                                                             [3, 3, 5, 5])
    assert group_items(["a", "b"], [3, 5], by_member=False) == (["a/0", "a/1", "b/0", "b/1"], ["a", "a", "b", "b"],
                                                              [3, 5, 3, 5])


@pytest.mark.parametrize("by_member", [True, False])
def test_values_listed_group_by_group_come_in_the_items_order(by_member: bool) -> None:
    by_group = group_items(["a", "b", "c"], [3, 5], by_member=False)[0]
    assert in_item_order(by_group, 2, by_member) == group_items(["a", "b", "c"], [3, 5], by_member)[0]


def test_a_save_s_items_are_whole_groups_member_by_member() -> None:
    items = save_objects("ns", [b"\x01" * 16, b"\x02" * 16, b"\x03" * 16], [100, 200, 200, 200])  # type: ignore
    group_ids, member_sizes, by_member = as_groups(items)  # type: ignore[misc]
    assert by_member and member_sizes == [100, 200, 200, 200] and len(group_ids) == 3
    assert list(zip(*group_items(group_ids, member_sizes, True))) == [(k, g, s) for k, g, _, s in items]
    by_group = [(f"{g}/{m}", g, 2, 7) for g in ("x", "y") for m in range(2)]
    assert as_groups(by_group) == (["x", "y"], [7, 7], False)


@pytest.mark.parametrize("items", [
    [],
    [("a/0", "a", 2, 1)],  # a member missing
    [("a/0", "a", 2, 1), ("a/1", "a", 2, 1), ("b/0", "b", 2, 2), ("b/1", "b", 2, 1)],  # member 0 of two sizes
    [("a/1", "a", 2, 1), ("a/0", "a", 2, 1)],  # out of place
    [("a/x", "a", 1, 1)],  # a key not keyed by place
    [("a/0", "a", 1, 1), ("a/0", "a", 1, 1)],  # one group twice
    [("a/0", "a", 2, 1), ("a/1", "a", 3, 1)],  # group sizes disagree
    [("k", "a", 1, 1)],  # a key kept whole
])
def test_items_that_are_not_whole_groups_go_one_message_each(items: list[tuple[str, str, int, int]]) -> None:
    assert as_groups(items) is None
    request = put_start_request(items, packed=True)
    assert not request.HasField("groups") and [i.key for i in request.items] == [k for k, _, _, _ in items]


def servicer(segments: int = 1) -> PoolMasterServicer:
    index, _ = make_index(100 * KB // segments, segments=segments, stripe_min_bytes=8 * KB)
    return PoolMasterServicer(index, "test", 1.0, MasterMetrics(CollectorRegistry()))


def one_each(items: list[tuple[str, str, int, int]], **fields: object) -> pool_pb2.PutStartRequest:
    return pool_pb2.PutStartRequest(items=[pool_pb2.PutItem(key=k, group_id=g, group_size=n, size=s)
                                           for k, g, n, s in items], **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("segments", [1, 2])
def test_whole_groups_get_the_answer_and_index_their_items_get(packed: bool, segments: int) -> None:
    grouped, single = servicer(segments), servicer(segments)
    batches = [
        save_objects("ns", [bytes([i]) * 16 for i in range(10)], [1000, 1500, 1500, 1500]),  # member by member
        [(f"g{i}/{m}", f"g{i}", 3, 900) for i in range(12) for m in range(3)],  # group by group
        save_objects("ns", [bytes([i]) * 16 for i in range(5, 25)], [1000, 1500, 1500, 1500]),  # existing; evicts
    ]
    for items in batches:
        request = put_start_request(items, client_host="host0", packed=packed)
        assert request.HasField("groups") and not request.items
        got = grouped.put_start(request)
        want = single.put_start(one_each(items, client_host="host0", packed=packed))
        assert got.SerializeToString() == want.SerializeToString()
        a, b = grouped.index, single.index
        assert list(a.groups) == list(b.groups) and a.used_bytes == b.used_bytes
        assert a.puts.in_flight == b.puts.in_flight and a.counters == b.counters
        commits = pool_pb2.PutEndRequest(items=[pool_pb2.PutCommit(key=key, checksum=7) for key in a.puts.in_flight])
        grouped.put_end(commits)
        single.put_end(commits)
    statuses = list(got.packed.status) if packed else [r.status for r in got.results]
    assert pool_pb2.PUT_STATUS_ALREADY_EXISTS in statuses and grouped.index.counters.evicted_groups > 0


def bad(**fields: object) -> pool_pb2.PutStartRequest:
    groups = {"group_ids": ["a", "b"], "member_sizes": [10, 20], "by_member": True}
    items = fields.pop("items", [])
    groups.update(fields)
    return pool_pb2.PutStartRequest(groups=pool_pb2.PutGroups(**groups), items=items)  # type: ignore[arg-type]


@pytest.mark.parametrize(("request_", "message"), [
    (bad(group_ids=[]), r"^groups\.group_ids: must not be empty$"),
    (bad(member_sizes=[]), r"^groups\.member_sizes: 0 members is outside 1\.\.64$"),
    (bad(member_sizes=[1] * 65), r"^groups\.member_sizes: 65 members is outside 1\.\.64$"),
    (bad(member_sizes=[10, -1]), r"^groups\.member_sizes\[1\]: must be positive, got -1$"),
    (bad(member_sizes=[0, 1]), r"^groups\.member_sizes\[0\]: must be positive, got 0$"),
    (bad(group_ids=["a", ""]), r"^groups\.group_ids\[1\]: must not be empty$"),
    (bad(group_ids=["a", "x" * (MAX_KEY_BYTES - 1)]),
     rf"^groups\.group_ids\[1\]: its keys would be longer than {MAX_KEY_BYTES} bytes$"),
    (bad(group_ids=["a", "b", "a"]), r"^groups\.group_ids\[2\]: 'a' named twice$"),
    (bad(group_ids=[f"g{i}" for i in range(MAX_BATCH // 2 + 1)]),
     rf"^groups: {MAX_BATCH + 2} entries is more than {MAX_BATCH} in one call$"),
    (bad(items=[pool_pb2.PutItem(key="c/0", group_id="c", group_size=1, size=1)]),
     r"^groups: given with items \(a put sends one or the other\)$"),
])
def test_a_bad_put_of_whole_groups_is_refused_naming_the_field(request_: pool_pb2.PutStartRequest,
                                                               message: str) -> None:
    service = servicer()
    with pytest.raises(InvalidArgument, match=message):
        service.put_start(request_)
    assert service.index.num_objects == 0 and not service.index.puts.in_flight
    assert service.put_start(bad()).results[0].status == pool_pb2.PUT_STATUS_RESERVED  # and it serves on


def test_a_commit_as_two_flat_arrays_commits_what_its_items_would() -> None:
    flat, single = servicer(), servicer()
    items = save_objects("ns", [bytes([i]) * 16 for i in range(6)], [1000, 1500, 1500, 1500])
    for service in (flat, single):
        service.put_start(put_start_request(items, client_host="host0", packed=True))
    pairs = [(key, 0xFFFF_FFFF_FFFF_FF00 + i) for i, (key, _, _, _) in enumerate(items)]
    request = put_end_request(pairs)
    assert not request.items and list(request.keys) == [k for k, _ in pairs]
    assert flat.put_end(request).num_committed == single.put_end(put_end_request(pairs, compact=False)).num_committed
    a, b = flat.index, single.index
    assert not a.puts.in_flight and a.num_objects == b.num_objects == 24
    assert [g.checksums for g in a.groups.values()] == [g.checksums for g in b.groups.values()]
    assert a.heartbeat("seg0", 0) == b.heartbeat("seg0", 0)


@pytest.mark.parametrize(("request_", "error", "message"), [
    (pool_pb2.PutEndRequest(keys=["a/0"], checksums=[1], items=[pool_pb2.PutCommit(key="a/1", checksum=1)]),
     InvalidArgument, r"^keys: given with items \(a commit sends one or the other\)$"),
    (pool_pb2.PutEndRequest(keys=["a/0", "a/1"], checksums=[1]), InvalidArgument,
     r"^checksums: 1 entries, but keys has 2$"),
    (pool_pb2.PutEndRequest(checksums=[1]), InvalidArgument, r"^keys: must not be empty$"),
    (pool_pb2.PutEndRequest(keys=["a/0", ""], checksums=[1, 2]), InvalidArgument, r"^keys\[1\]: must not be empty$"),
    (pool_pb2.PutEndRequest(keys=["a/0", "a/0"], checksums=[1, 2]), InvalidArgument,
     r"^keys\[1\]: duplicate key 'a/0' in one batch$"),
    (pool_pb2.PutEndRequest(keys=["a/0", "z/0"], checksums=[1, 2]), FailedPrecondition,
     r"^keys\[1\]: no put in flight for 'z/0' \(never started, revoked or timed out\)$"),
])
def test_a_bad_flat_commit_is_refused_naming_the_field(request_: pool_pb2.PutEndRequest, error: type[Exception],
                                                       message: str) -> None:
    service = servicer()
    service.put_start(bad())
    with pytest.raises(error, match=message):
        service.put_end(request_)
    assert len(service.index.puts.in_flight) == 4  # nothing committed: all or none
    assert service.put_end(put_end_request([("a/0", 1), ("b/0", 1)])).num_committed == 2  # and it serves on


def test_what_a_master_that_predates_whole_groups_answers_them_is_what_the_client_falls_back_on() -> None:
    # such a master reads no items in a put of whole groups: the answer this master gives a put of neither
    with pytest.raises(InvalidArgument) as refused:
        servicer().put_start(pool_pb2.PutStartRequest(client_host="host0", packed=True))
    assert str(refused.value) == OLD_EMPTY_PUT
    assert not put_start_request([("a/0", "a", 1, 1)], compact=False).HasField("groups")
    assert put_end_request([("a/0", 1)], compact=False).items[0].key == "a/0"


class Heard(PoolMasterServicer):
    """This master, noting the form of each commit it is sent."""

    forms: list[str]

    def put_end(self, request: pool_pb2.PutEndRequest) -> pool_pb2.PutEndResponse:
        self.forms = getattr(self, "forms", [])
        self.forms.append("groups" if request.HasField("groups") else "keys" if request.keys else "items")
        return super().put_end(request)


class PredatesCommitGroups(Heard):
    """This master as one that takes whole groups' puts and flat commits but predates commits of whole groups
    reads and answers: protobuf drops fields a reader does not know, so it never says it takes them and never
    sees them (the rest of it is this master, over real gRPC)."""

    def put_start(self, request: pool_pb2.PutStartRequest) -> pool_pb2.PutStartResponse:
        response = super().put_start(request)
        response.ClearField("commits_groups")
        return response

    def put_end(self, request: pool_pb2.PutEndRequest) -> pool_pb2.PutEndResponse:
        request.ClearField("groups")
        return super().put_end(request)


class PredatesCompactPuts(PredatesCommitGroups):
    """This master as one that predates whole groups and flat commits reads them: it sees neither."""

    def put_start(self, request: pool_pb2.PutStartRequest) -> pool_pb2.PutStartResponse:
        request.ClearField("groups")
        return super().put_start(request)

    def put_end(self, request: pool_pb2.PutEndRequest) -> pool_pb2.PutEndResponse:
        request.ClearField("keys")
        request.ClearField("checksums")
        return super().put_end(request)


@pytest.mark.parametrize(("master_class", "form"), [(Heard, "groups"), (PredatesCommitGroups, "keys"),
                                                    (PredatesCompactPuts, "items")])
def test_a_client_sends_whole_groups_and_flat_commits_and_falls_back_for_a_master_that_predates_them(
        master_class: type[Heard], form: str) -> None:
    old = master_class is PredatesCompactPuts

    async def body() -> None:
        index, _ = make_index(100 * KB)
        master = master_class(index, "test", 1.0, MasterMetrics(CollectorRegistry()))
        handle = await service.create_server("127.0.0.1", 0,
                                             lambda s: pool_pb2_grpc.add_PoolMasterServicer_to_server(master, s),
                                             service_names=["kvpool.rpc.PoolMaster"])
        client = PoolClient(f"127.0.0.1:{handle.port}", None, host_name="host0")
        try:
            for turn in range(2):
                items = save_objects("ns", [bytes([turn, i]) * 8 for i in range(3)], [1000, 1500])
                reserved = await client.reserve(items)
                assert all(isinstance(r, ObjectLocation) for r in reserved)
                assert await client.commit([(key, 9) for key, _, _, _ in items])
                assert client.compact_puts is not old
            assert index.num_objects == 12 and not index.puts.in_flight
            assert master.forms == [form, form]  # each commit in the newest form this master takes
        finally:
            await client.close()
            await handle.server.stop(None)

    asyncio.run(body())


def test_the_keys_of_whole_groups_and_back() -> None:
    assert group_keys(["a", "b"], 2, by_member=True) == ["a/0", "b/0", "a/1", "b/1"] == \
        group_items(["a", "b"], [3, 5], True)[0]
    assert group_keys(["a", "b"], 2, by_member=False) == ["a/0", "a/1", "b/0", "b/1"]
    for by_member in (True, False):
        for ids, members in ((["a", "b", "c"], 4), (["x/y"], 1), (["g"], 3), (["a/0", "a"], 2)):
            assert as_commit_groups(group_keys(ids, members, by_member)) in \
                ((ids, members, by_member), (ids, members, not by_member))  # one group, or one member: either
    keys = group_keys(["a", "b"], 2, True)
    for wrong in ([], ["a/0", "a/1", "b/0"], keys[:-1] + ["b/2"], [keys[1], keys[0], *keys[2:]], ["a/0", "a/0"],
                  ["k"], ["a/1"], ["/0", "/0"]):
        assert as_commit_groups(wrong) is None, wrong


def test_a_commit_of_whole_groups_commits_what_its_keys_would() -> None:
    whole, flat = servicer(2), servicer(2)
    items = save_objects("ns", [bytes([i]) * 16 for i in range(9)], [1000, 1500, 1500, 1500])
    for service in (whole, flat):
        started = service.put_start(put_start_request(items, client_host="host0", packed=True))
        assert started.commits_groups  # this master takes them
    pairs = [(key, 0xFFFF_FFFF_FFFF_FF00 + i) for i, (key, _, _, _) in enumerate(items)]
    request = put_end_request(pairs, groups=True)
    assert request.HasField("groups") and not request.keys and request.groups.members == 4
    assert request.groups.by_member and list(commit_keys(request)) == [k for k, _ in pairs]
    assert whole.put_end(request).num_committed == flat.put_end(put_end_request(pairs)).num_committed == 36
    a, b = whole.index, flat.index
    assert not a.puts.in_flight and a.num_objects == b.num_objects == 36
    assert [(g.group_id, g.checksums, g.ready, g.pending) for g in a.groups.values()] == \
        [(g.group_id, g.checksums, g.ready, g.pending) for g in b.groups.values()]
    assert a.heartbeat("seg0", 0) == b.heartbeat("seg0", 0) and a.heartbeat("seg1", 0) == b.heartbeat("seg1", 0)
    assert put_end_request(pairs[:-1], groups=True).keys  # not whole groups: flat arrays


def commit_groups(ids: list[str], members: int = 2, checksums: int | None = None, **fields: object
                  ) -> pool_pb2.PutEndRequest:
    count = len(ids) * members if checksums is None else checksums
    return pool_pb2.PutEndRequest(groups=pool_pb2.CommitGroups(group_ids=ids, members=members, by_member=True),
                                  checksums=list(range(count)), **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("request_", "error", "message"), [
    (commit_groups(["a"], keys=["a/0"]), InvalidArgument,
     r"^groups: given with items or keys \(a commit sends one form\)$"),
    (commit_groups([]), InvalidArgument, r"^groups\.group_ids: must not be empty$"),
    (commit_groups(["a"], members=0), InvalidArgument, r"^groups\.members: 0 is outside 1\.\.64$"),
    (commit_groups(["a"], members=65), InvalidArgument, r"^groups\.members: 65 is outside 1\.\.64$"),
    (commit_groups(["a", "b"], checksums=3), InvalidArgument,
     r"^checksums: 3 entries, but groups stand for 4 keys$"),
    (commit_groups(["a", "a"]), InvalidArgument, r"^groups\.group_ids\[1\]: 'a' named twice$"),
    (commit_groups(["a", ""]), InvalidArgument, r"^groups\.group_ids\[1\]: must not be empty$"),
    (commit_groups(["a", "x" * MAX_KEY_BYTES]), InvalidArgument, r"^groups\.group_ids\[1\]: "),
    (commit_groups([f"g{i}" for i in range(MAX_BATCH)]), InvalidArgument, r"^groups: "),
    (commit_groups(["a", "z"]), FailedPrecondition,
     r"^groups \(key 1\): no put in flight for 'z/0' \(never started, revoked or timed out\)$"),
    (commit_groups(["a"], members=3), FailedPrecondition, r"^groups \(key 2\): no put in flight for 'a/2' "),
])
def test_a_bad_commit_of_whole_groups_is_refused_naming_the_field(request_: pool_pb2.PutEndRequest,
                                                                  error: type[Exception], message: str) -> None:
    service = servicer()
    service.put_start(bad())
    with pytest.raises(error, match=message):
        service.put_end(request_)
    assert len(service.index.puts.in_flight) == 4  # nothing committed: all or none
    assert service.put_end(commit_groups(["a", "b"])).num_committed == 4  # and it serves on
    groups = service.index.groups
    assert groups["a"].checksums == [0, 2] and groups["b"].checksums == [1, 3] and groups["a"].ready
