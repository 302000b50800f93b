"""An order of slots, least recently used first, for the group table (``kvpool.core.pool.groups``).

Each group the table holds has a slot, a small int it keeps while held; an order is a doubly linked list over
slots. The native order keeps the links in C (``kvpool/native/lru.c``, an extension module's type): a lookup's
touch of a whole history (450 groups) is one call and a few stores a group, where an ordered dict moved one entry
at a time, each a hash lookup and a relink in memory spread over the whole table. ``PyOrder`` is the same list in
Python lists, used where the module is not built or is switched off (``native()`` says which one runs); the tests
hold the two to one behaviour.

Calls that break the rules (a slot out of range, one added twice, one removed that is not there, iterating on
past a change of order) raise ``ValueError``/``RuntimeError``; neither implementation writes out of bounds.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Protocol

from kvpool import native_build

SOURCE = native_build.NATIVE / "lru.c"
SWITCH_ENV = "KVPOOL_NATIVE_ORDER"  # "off": the Python order even where the module is built


class Order(Protocol):
    def __len__(self) -> int: ...

    def __contains__(self, slot: int) -> bool: ...

    def grow(self, capacity: int) -> None: ...

    def push_back(self, slot: int) -> None: ...

    def remove(self, slot: int) -> None: ...

    def touch(self, slots: Sequence[int]) -> int:
        """Each slot of ``slots`` (a list, a tuple or an ``array('i')`` of ints) in the order, last to first, moved
        to the back (the first named ends the most recently used); the others are skipped. Returns how many
        moved."""
        ...

    def demote(self, slots: Sequence[int]) -> int:
        """Each slot of ``slots`` in the order, first to last, moved to the front (the last named ends the least
        recently used). Returns how many moved."""
        ...

    def __iter__(self) -> Iterator[int]:
        """The slots, least recently used first. The order must not change until the iteration ends."""
        ...

    def first(self) -> int:
        """The first slot, or -1 when the order is empty."""
        ...

    def after(self, slot: int) -> int:
        """The slot after ``slot``, or -1 after the last; RuntimeError when ``slot`` is not in the order (it left
        since the caller read it: the order changed under an iteration)."""
        ...

    def copy_into(self, other: Order) -> None:
        """``other`` (empty) gets this order's slots in this order."""
        ...


def slots_of(order: Order) -> Iterator[int]:
    """An order's slots, first to last (``after`` raises when the order changed meanwhile)."""
    s = order.first()
    after = order.after
    while s >= 0:
        yield s
        s = after(s)


def _load_module(path: Path) -> ModuleType | None:
    """The extension module, loaded from ``path``; None when it does not load."""
    spec = importlib.util.spec_from_file_location("kvpool_lru", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_type(path: Path) -> type | None:
    """The extension module's ``Order`` type, loaded from ``path``; None when it does not load."""
    module = _load_module(path)
    return None if module is None else module.Order  # type: ignore[no-any-return]


def _native_class(base: type) -> type:
    class NativeOrder(base):  # type: ignore[valid-type,misc]
        """The order in C (module doc): the extension's type, iterated here."""

        __slots__ = ()

        def __iter__(self) -> Iterator[int]:
            return slots_of(self)

    return NativeOrder


OUT, END = -2, -1


class PyOrder:
    """The order in Python lists (module doc): the same links as the C one."""

    __slots__ = ("prev", "next", "head", "tail", "count")

    def __init__(self, capacity: int = 1024) -> None:
        self.prev = [OUT] * max(capacity, 1)
        self.next = [OUT] * max(capacity, 1)
        self.head = self.tail = END
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < len(self.prev) and self.prev[slot] != OUT

    def grow(self, capacity: int) -> None:
        more = capacity - len(self.prev)
        if more > 0:
            self.prev += [OUT] * more
            self.next += [OUT] * more

    def _unlink(self, s: int) -> None:
        p, n = self.prev[s], self.next[s]
        if p == END:
            self.head = n
        else:
            self.next[p] = n
        if n == END:
            self.tail = p
        else:
            self.prev[n] = p

    def _link_back(self, s: int) -> None:
        self.prev[s], self.next[s] = self.tail, END
        if self.tail == END:
            self.head = s
        else:
            self.next[self.tail] = s
        self.tail = s

    def _link_front(self, s: int) -> None:
        self.next[s], self.prev[s] = self.head, END
        if self.head == END:
            self.tail = s
        else:
            self.prev[self.head] = s
        self.head = s

    def push_back(self, slot: int) -> None:
        if not 0 <= slot < len(self.prev) or slot in self:
            raise ValueError(f"slot {slot} is out of range or already in the order")
        self._link_back(slot)
        self.count += 1

    def remove(self, slot: int) -> None:
        if slot not in self:
            raise ValueError(f"slot {slot} is not in the order")
        self._unlink(slot)
        self.prev[slot] = self.next[slot] = OUT
        self.count -= 1

    def touch(self, slots: Sequence[int]) -> int:
        return self._move(reversed(slots), self._link_back, back=True)

    def demote(self, slots: Sequence[int]) -> int:
        return self._move(slots, self._link_front, back=False)

    def _move(self, slots: Iterable[int], link: Callable[[int], None], back: bool) -> int:
        moved = 0
        for s in slots:
            if s in self:
                moved += 1
                if (self.tail if back else self.head) != s:
                    self._unlink(s)
                    link(s)
        return moved

    def __iter__(self) -> Iterator[int]:
        return slots_of(self)

    def first(self) -> int:
        return self.head

    def after(self, slot: int) -> int:
        if slot not in self:  # taken out while the caller held it: where it led is unknown now
            raise RuntimeError("the order changed during an iteration over it")
        return self.next[slot]

    def copy_into(self, other: Order) -> None:
        if not isinstance(other, PyOrder) or other.count or len(other.prev) < len(self.prev):
            raise ValueError("an order is copied into an empty Python order at least as large")
        for s in self:
            other._link_back(s)
        other.count = self.count


_NATIVE: type | None | bool = False  # False: not looked for yet
_MODULE: ModuleType | None = None


def native_class() -> type | None:
    """The C order's class, loaded at the first call; None where it is not built (``scripts/setup.sh`` and the
    master at its start build it: ``kvpool.native_build``; this module only looks) or switched off."""
    global _NATIVE, _MODULE
    if _NATIVE is False:
        path = None if os.environ.get(SWITCH_ENV, "on") == "off" else native_build.find(SOURCE, extension=True)
        try:
            _MODULE = _load_module(path) if path is not None else None
            _NATIVE = _native_class(_MODULE.Order) if _MODULE is not None else None
        except (ImportError, OSError, AttributeError, TypeError):
            _NATIVE = _MODULE = None
    return _NATIVE  # type: ignore[return-value]


def native_module() -> ModuleType | None:
    """The loaded extension module (its order and its passes over records, ``kvpool.core.pool.fields``), or None
    where the order is not native (``native_class``)."""
    native_class()
    return _MODULE


def native() -> bool:
    """Whether new orders are the C ones."""
    return native_class() is not None


def new_order(capacity: int = 1024, native: bool | None = None) -> Order:
    """An empty order for slots below ``capacity`` (``grow`` raises it): the C one where its module is built,
    unless ``native`` says which."""
    cls = native_class()
    if native is None:
        native = cls is not None
    if native:
        if cls is None:
            raise native_build.NativeUnavailable(f"{SOURCE.name}'s module is not built here (scripts/setup.sh)")
        return cls(capacity)  # type: ignore[no-any-return]
    return PyOrder(capacity)
