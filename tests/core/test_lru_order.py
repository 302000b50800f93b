"""The group table's order of slots (kvpool/core/pool/lru.py): the C list and the Python one behave as one
ordered dict moved one entry at a time, refuse what breaks the rules, and never write out of bounds."""

from __future__ import annotations

from array import array
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.pool import lru
from kvpool.core.pool.groups import GroupTable
from kvpool.core.pool.lru import PyOrder

SLOTS = 12


def _c_ints(slots: list[int]) -> array[int]:
    """Slots as an array of C ints, the other form an order takes."""
    return array("i", slots)

ops = st.lists(st.one_of(
    st.tuples(st.just("push_back"), st.integers(-2, SLOTS + 2)),
    st.tuples(st.just("remove"), st.integers(-2, SLOTS + 2)),
    # slots as a list, or as an array of C ints
    st.tuples(st.just("touch"), st.lists(st.integers(-3, SLOTS + 3), max_size=8), st.booleans()),
    st.tuples(st.just("demote"), st.lists(st.integers(-3, SLOTS + 3), max_size=8), st.booleans()),
    st.tuples(st.just("grow"), st.integers(0, 8)),
), max_size=60)


class Reference:
    """The order as an ordered dict of slots, moved one at a time."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[int, None] = OrderedDict()

    def push_back(self, slot: int) -> None:
        if not 0 <= slot < self.capacity or slot in self.order:
            raise ValueError(slot)
        self.order[slot] = None

    def remove(self, slot: int) -> None:
        if slot not in self.order:
            raise ValueError(slot)
        del self.order[slot]

    def touch(self, slots: list[int]) -> int:
        found = [s for s in reversed(slots) if s in self.order]
        for s in found:
            self.order.move_to_end(s)
        return len(found)

    def demote(self, slots: list[int]) -> int:
        found = [s for s in slots if s in self.order]
        for s in found:
            self.order.move_to_end(s, last=False)
        return len(found)

    def grow(self, more: int) -> None:
        self.capacity += more


def both(capacity: int) -> list[lru.Order]:
    return [lru.new_order(capacity, native=True), lru.new_order(capacity, native=False)]


def test_setup_built_the_c_order_and_new_tables_use_it() -> None:
    assert lru.native(), "kvpool/native/lru.c is not built: scripts/setup.sh builds it"
    assert isinstance(lru.new_order(), lru.native_class()) and GroupTable().native


@settings(max_examples=200, deadline=None)
@given(ops)
def test_both_orders_move_exactly_as_an_ordered_dict(steps: list[tuple]) -> None:
    ref, orders = Reference(SLOTS), both(SLOTS)
    for kind, arg, *as_array in steps:
        if kind in ("push_back", "remove"):
            try:
                getattr(ref, kind)(arg)
                expected = None
            except ValueError:
                expected = ValueError
            for order in orders:
                if expected is None:
                    getattr(order, kind)(arg)
                else:
                    with pytest.raises(ValueError):
                        getattr(order, kind)(arg)
        elif kind in ("touch", "demote"):
            moved = getattr(ref, kind)(arg)
            for order in orders:
                assert getattr(order, kind)(_c_ints(arg) if as_array[0] else list(arg)) == moved
        else:
            ref.grow(arg)
            for order in orders:
                order.grow(ref.capacity)
        for order in orders:
            assert list(order) == list(ref.order)
            assert len(order) == len(ref.order)
            assert [s in order for s in range(-2, ref.capacity + 2)] == \
                [s in ref.order for s in range(-2, ref.capacity + 2)]


@pytest.mark.parametrize("native", [True, False])
def test_an_iteration_on_past_a_slot_taken_out_is_refused(native: bool) -> None:
    order = lru.new_order(256, native)
    for s in range(200):
        order.push_back(s)
    it = iter(order)
    taken = [next(it) for _ in range(70)]
    order.remove(taken[-1])
    with pytest.raises(RuntimeError, match="changed during an iteration"):
        list(it)


@pytest.mark.parametrize("native", [True, False])
def test_a_copy_keeps_the_order_and_only_goes_into_an_empty_order_as_large(native: bool) -> None:
    order = lru.new_order(8, native)
    for s in (5, 1, 7, 0):
        order.push_back(s)
    order.touch(_c_ints([1]))
    copy = lru.new_order(8, native)
    order.copy_into(copy)
    assert list(copy) == list(order) == [5, 7, 0, 1] and len(copy) == 4
    with pytest.raises(ValueError):
        order.copy_into(copy)  # not empty
    with pytest.raises(ValueError):
        order.copy_into(lru.new_order(4, native))  # too small
    with pytest.raises(ValueError):
        order.copy_into(lru.new_order(8, not native))  # the other kind


def test_the_c_order_skips_slots_out_of_range_refuses_bad_arguments_and_grows_its_arrays() -> None:
    order = lru.new_order(4, native=True)
    order.push_back(3)
    huge = _c_ints([2**31 - 1, -(2**31), -1, 4, 3])
    assert order.touch(huge) == 1 and order.demote(huge) == 1
    with pytest.raises(ValueError):
        order.push_back(4)
    with pytest.raises(ValueError):
        order.push_back(-1)
    assert order.touch([2**63, -(2**63) - 1, 10**30, 3]) == 1  # ints no slot can be: in no order
    assert order.touch((3,)) == 1
    with pytest.raises(TypeError, match=r"slots\[1\] is not an int"):
        order.touch([3, "4"])
    with pytest.raises(TypeError, match=r"slots\[0\] is not an int"):
        order.demote([3.0])
    assert list(order) == [3]  # a refused list moved nothing
    with pytest.raises(TypeError, match="array"):
        order.touch(array("q", [3]))  # 8-byte ints
    with pytest.raises(TypeError):
        order.touch({3})  # neither a list, a tuple nor a buffer
    with pytest.raises(OverflowError):
        order.grow(2**31)
    with pytest.raises(RuntimeError, match="changed during an iteration"):
        order.after(2)  # not in the order
    assert order.first() == 3 and order.after(3) == -1
    order.grow(1 << 16)
    order.push_back((1 << 16) - 1)
    assert list(order) == [3, (1 << 16) - 1]
    order.grow(2)  # never shrinks
    assert (1 << 16) - 1 in order


def test_the_python_order_is_the_fallback_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lru, "_NATIVE", False)
    monkeypatch.setattr(lru, "_MODULE", None)
    monkeypatch.setenv(lru.SWITCH_ENV, "off")
    assert not lru.native() and isinstance(lru.new_order(), PyOrder) and not GroupTable().native
    assert lru.native_module() is None
    with pytest.raises(lru.native_build.NativeUnavailable):
        lru.new_order(native=True)


@pytest.mark.parametrize("native", [True, False])
def test_a_table_past_its_first_slots_grows_every_order_and_keeps_them_exact(native: bool) -> None:
    import random

    from kvpool.core.pool.records import Group
    from tests.core.test_group_order import Reference as TableReference

    rng = random.Random(7)
    table, ref = GroupTable(native), TableReference()
    for i in range(2500):  # past 1024 and 2048 slots, with two tenants' orders to grow too
        group = Group(f"g{i}", 1, tenant="ab"[i % 3 == 0])
        table.add(group)
        ref.add(group)
        if i % 97 == 0:
            ids = rng.sample(list(ref.groups), min(40, len(ref.groups)))
            table.touch(ids)
            ref.touch(ids)
        if i % 131 == 0:
            ids = rng.sample(list(ref.groups), min(5, len(ref.groups)))
            table.demote(ids)
            ref.demote(ids)
        if i % 5 == 0:
            victim = rng.choice(list(ref.groups))
            table.remove(ref.groups[victim])
            ref.remove(victim)
    assert list(table.groups) == list(ref.groups)
    assert {t: list(g) for t, g in table.by_tenant.items()} == {t: list(g) for t, g in ref.by_tenant.items()}
    slots = [g.slot for g in ref.groups.values()]
    assert len(set(slots)) == len(slots) and max(slots) < 4096
