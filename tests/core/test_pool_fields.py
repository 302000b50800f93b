"""Passes over group records' fields (kvpool/core/pool/fields.py): the C passes and the Python ones give one
answer, and the C ones refuse what is not a record's slot field, changing nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.pool import fields, lru
from kvpool.core.pool.records import Group


def _native() -> Any:
    module = lru.native_module()
    assert module is not None, "kvpool/native/lru.c is not built: scripts/setup.sh builds it"
    return module


def _groups(flags: list[bool | None]) -> list[Group | None]:
    out: list[Group | None] = []
    for i, flag in enumerate(flags):
        if flag is None:
            out.append(None)
        else:
            group = Group(f"g{i}", 4, slot=i)
            group.ready = flag
            out.append(group)
    return out


def test_setup_built_the_c_passes_and_the_index_runs_them() -> None:
    _native()
    assert fields.native()


@pytest.mark.parametrize("which", ["c", "python"])
def test_each_pass_on_a_small_history(which: str) -> None:
    impl = _native() if which == "c" else fields.PyFields()
    groups = _groups([True, True, False, True, None, True])
    assert impl.leading(groups, Group, "ready") == 2
    assert impl.leading(groups[3:], Group, "ready") == 1  # None ends the run
    assert impl.leading([], Group, "ready") == 0
    whole = [g for g in groups if g is not None and g.ready]
    assert impl.leading(whole, Group, "ready") == len(whole) == 4
    assert impl.leading(tuple(whole), Group, "ready") == 4  # a tuple as well as a list
    present = [g for g in groups if g is not None]
    assert impl.count(present, Group, "ready") == 4 and impl.count(present, Group, "dropped") == 0
    assert impl.values(present, Group, "slot") == [0, 1, 2, 3, 5]
    assert impl.values(present, Group, "group_id") == ["g0", "g1", "g2", "g3", "g5"]
    impl.add(present + present[:1], Group, "num_leases", 1)  # the first named twice: counted twice
    assert [g.num_leases for g in present] == [2, 1, 1, 1, 1]
    impl.add(present, Group, "num_leases", -1)
    assert [g.num_leases for g in present] == [1, 0, 0, 0, 0]
    joined, named = impl.join_pairs([(b"ab", ("s1",)), (b"", ("s1",)), (b"cd", ("s2", "s1"))])
    assert joined == b"abcd" and named == {"s1", "s2"}
    assert impl.join_pairs([]) == (b"", set())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.none(), st.booleans()), max_size=40), st.lists(st.integers(-3, 3), max_size=40),
       st.integers(-5, 5))
def test_the_c_passes_answer_as_the_python_ones(flags: list[bool | None], leases: list[int], delta: int) -> None:
    c, py = _native(), fields.PyFields()
    groups = _groups(flags)
    present = [g for g in groups if g is not None]
    for group, n in zip(present, leases):
        group.num_leases = n
    assert c.leading(groups, Group, "ready") == py.leading(groups, Group, "ready")
    assert c.count(present, Group, "ready") == py.count(present, Group, "ready") == sum(g.ready for g in present)
    assert c.values(present, Group, "num_leases") == py.values(present, Group, "num_leases")
    before = [g.num_leases for g in present]
    c.add(present, Group, "num_leases", delta)
    py.add(present, Group, "num_leases", delta)
    assert [g.num_leases for g in present] == [n + 2 * delta for n in before]
    pairs = [(bytes([i % 256]) * (i % 3), (f"s{i % 4}",) * (i % 2)) for i in range(len(flags))]
    assert c.join_pairs(pairs) == py.join_pairs(pairs)


@dataclass(frozen=True, slots=True)
class Frozen:
    n: int = 0


@dataclass(slots=True)
class Other:
    ready: bool = True
    n: int = 0


class Guarded(Group):
    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:  # (one a C write would go around)
        if name == "num_leases" and isinstance(value, int) and value < 0:
            raise ValueError("no fewer than no leases")
        object.__setattr__(self, name, value)


def test_the_c_passes_refuse_what_is_not_a_records_slot_field_and_change_nothing() -> None:
    c = _native()
    group = Group("g", 4)
    group.ready = True
    with pytest.raises(TypeError, match=r"items\[1\] is a Other, not a Group"):
        c.leading([group, Other()], Group, "ready")
    with pytest.raises(TypeError, match=r"items\[1\] is a Other, not a Group"):
        c.add([group, Other()], Group, "num_leases", 1)
    assert group.num_leases == 0  # checked whole before any write
    with pytest.raises(TypeError, match="not a writable __slots__ field"):
        c.count([group], Group, "complete")  # a property, not a slot
    with pytest.raises(AttributeError):
        c.values([group], Group, "no_such_field")
    with pytest.raises(TypeError, match="cls must be a class"):
        c.values([group], "Group", "slot")
    with pytest.raises(TypeError, match=r"items\[0\].group_id is not an int"):
        c.add([group], Group, "group_id", 1)
    with pytest.raises(TypeError, match="sets its attributes its own way"):
        c.add([Frozen()], Frozen, "n", 1)
    guarded = Guarded("h", 4)
    with pytest.raises(TypeError, match="sets its attributes its own way"):
        c.add([group, guarded], Group, "num_leases", 1)
    assert group.num_leases == 0 and guarded.num_leases == 0
    with pytest.raises(OverflowError):
        c.add([group], Group, "num_leases", 1 << 40)
    assert group.num_leases == 0
    with pytest.raises(TypeError, match="items must be a list or a tuple"):
        c.count(3, Group, "ready")
    unset = object.__new__(Group)  # no field set yet
    with pytest.raises(AttributeError, match=r"items\[0\] has no ready"):
        c.leading([unset], Group, "ready")
    for bad in ([b"x"], [(b"x",)], [("x", ())], [(b"x", ["s"])]):
        with pytest.raises(TypeError, match=r"pairs\[0\] is not a \(bytes, tuple\) pair"):
            c.join_pairs(bad)
    assert c.leading([Guarded("i", 4)], Group, "ready") == 0  # a subclass reads as its class


def test_join_pairs_reads_its_own_copy_when_hashing_changes_the_list_it_was_given() -> None:
    c = _native()
    pairs: list[tuple[bytes, tuple[object, ...]]] = []

    class Meddling(str):
        def __hash__(self) -> int:
            pairs.clear()  # Python code run by the set's add, mid-pass
            return str.__hash__(self)

    pairs.extend([(b"ab", (Meddling("s1"),)), (b"cd", ("s2",))])
    joined, named = c.join_pairs(pairs)
    assert joined == b"abcd" and named == {"s1", "s2"} and pairs == []
    with pytest.raises(TypeError, match="pairs must be a list or a tuple"):
        c.join_pairs({(b"x", ())})
