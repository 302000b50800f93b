"""A commit of whole groups (``PoolIndex.put_end_groups``) decides exactly what ``put_end`` of the commits it
stands for decides, whatever came before: the same count or the same refusal (its message naming the commit's
place), and the same index after (groups and their records, puts in flight and incomplete groups in order,
counters, every segment's journal). Groups the fast path takes (a save's: every member in flight, keyed by place)
and groups it must hand to ``put_end`` (a member revoked or committed already, a group keeping its keys whole, an
unknown or failed group, one named twice) come mixed."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from kvpool.core.errors import KvpoolError
from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.put_groups import group_keys
from kvpool.core.pool.records import PutRequestItem
from tests.core.test_put_groups_at_once import items_of, pool, state

FIELD = "groups (key {})"


def commit_both(fast: PoolIndex, slow: PoolIndex, ids: list[str], members: int, by_member: bool,
                checksums: list[int]) -> object:
    """The commit of whole groups on one, of its keys on the other: the same answer, or the same refusal."""
    pairs = list(zip(group_keys(ids, members, by_member), checksums))
    try:
        want: object = slow.put_end(pairs, FIELD)
    except KvpoolError as error:
        with pytest.raises(type(error)) as again:
            fast.put_end_groups(ids, members, by_member, checksums, FIELD)
        assert str(again.value) == str(error)
        return error
    assert fast.put_end_groups(ids, members, by_member, checksums, FIELD) == want
    return want


@pytest.mark.parametrize("roomy", [False, True])
@settings(max_examples=60, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_a_commit_of_whole_groups_decides_what_its_keys_decide(roomy: bool, rng: random.Random) -> None:
    (fast, fast_clock), (slow, slow_clock) = pool(roomy), pool(roomy)
    put: list[tuple[list[str], int]] = []  # each put's groups and their members
    for step in range(40):
        op = rng.random()
        if op < 0.4:  # a save's put of whole groups (placed at once where it can be, else by item)
            members = rng.choice([1, 2, 4, 4])
            ids = [f"g{step}-{i}" for i in range(rng.randint(1, 5))]
            sizes = [rng.choice([64, 100, 256]) for _ in range(members)]
            by_member = rng.random() < 0.5
            for index in (fast, slow):
                if index.put_groups("host0", ids, sizes, by_member) is None:
                    index.put_start("host0", items_of(ids, sizes, by_member, "default"))
            put.append((ids, members))
        elif op < 0.45:  # a group keeping its keys whole ("<another id>/<m>"), and one whose keys are not by place
            items = [PutRequestItem(f"x{step}/{m}", f"w{step}", 2, 128) for m in range(2)] + \
                [PutRequestItem(f"v{step}/{m}", f"v{step}", 2, 128) for m in "ab"]
            for index in (fast, slow):
                index.put_start("host0", items)
            put.append(([f"x{step}", f"v{step}"], 2))
        elif op < 0.8 and put:  # a commit of whole groups: mostly a put's own, sometimes mixed or wrong
            ids, members = rng.choice(put)
            ids = list(ids)
            roll = rng.random()
            if roll < 0.15:
                ids.append(rng.choice(["nobody", ids[0]]))  # unknown, or named twice
            elif roll < 0.3 and len(put) > 1:
                other, other_members = rng.choice(put)
                if other_members == members:
                    ids = list(dict.fromkeys(ids + list(other)))
            elif roll < 0.4:
                members = max(1, members + rng.choice([-1, 1]))
            by_member = rng.random() < 0.5
            checksums = [rng.getrandbits(64) for _ in range(len(ids) * members)]
            commit_both(fast, slow, ids, members, by_member, checksums)
        elif op < 0.88:  # some keys committed, or revoked, alone first
            keys = list(slow.puts.in_flight)
            mine = rng.sample(keys, min(len(keys), rng.randint(0, 3)))
            if rng.random() < 0.5:
                pairs = [(key, 5) for key in mine]
                assert fast.put_end(pairs) == slow.put_end(pairs)
            else:
                assert fast.put_revoke(mine) == slow.put_revoke(mine)
        else:  # time passes: puts time out, incomplete groups go
            fast_clock.now += rng.choice([0.5, 5.0, 40.0])
            slow_clock.now = fast_clock.now
            assert fast.revoke_expired_puts() == slow.revoke_expired_puts()
            assert fast.drop_incomplete_groups() == slow.drop_incomplete_groups()
        assert state(fast) == state(slow), f"step {step}"


def test_a_save_s_commit_goes_a_group_at_a_time_and_its_groups_are_ready() -> None:
    (index, _), (twin, _) = pool(), pool()
    ids = ["a", "b", "c"]
    for each in (index, twin):
        assert each.put_groups("host0", ids, [100, 200], by_member=True) is not None
    checksums = [11, 12, 13, 21, 22, 23]  # member 0 of a, b, c, then member 1 of each
    assert commit_both(index, twin, ids, 2, True, checksums) == 6
    assert [index.groups[g].checksums for g in ids] == [[11, 21], [12, 22], [13, 23]]
    assert all(index.groups[g].ready for g in ids) and not index.puts.in_flight and not index.puts.incomplete
    assert state(index) == state(twin)
    error = commit_both(index, twin, ids, 2, True, checksums)  # again: nothing in flight
    assert isinstance(error, KvpoolError) and str(error).startswith("groups (key 0): no put in flight for 'a/0'")


def test_the_checksums_must_match_the_keys() -> None:
    index, _ = pool()
    with pytest.raises(ValueError, match="3 checksums for 4 keys"):
        index.put_end_groups(["a", "b"], 2, True, [1, 2, 3])
