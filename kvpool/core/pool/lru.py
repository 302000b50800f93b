"""An order of slots, least recently used first, for the group table (``kvpool.core.pool.groups``).

Each group the table holds has a slot, a small int it keeps while held; an order is a doubly linked list over
slots. ``NativeOrder`` keeps the links in C (``kvpool/native/lru.c``): a lookup's touch of a whole history (450
groups) is one call and a few stores a group, where an ordered dict moved one entry at a time, each a hash lookup
and a relink in memory spread over the whole table. ``PyOrder`` is the same list in Python lists, used where the
library is not built or is switched off (``native()`` says which one runs); the tests hold the two to one
behaviour.

Calls that break the rules (a slot out of range, one added twice, one removed that is not there, iterating on
past a change of order) raise ``ValueError``/``RuntimeError``; neither implementation writes out of bounds.
"""

from __future__ import annotations

import ctypes
import os
from array import array
from collections.abc import Iterable, Iterator
from typing import Protocol

from kvpool import native_build

SOURCE = native_build.NATIVE / "lru.c"
SWITCH_ENV = "KVPOOL_NATIVE_ORDER"  # "off": the Python order even where the library is built
READ_BATCH = 64  # slots read per call while iterating


class Order(Protocol):
    def __len__(self) -> int: ...

    def __contains__(self, slot: int) -> bool: ...

    def grow(self, capacity: int) -> None: ...

    def push_back(self, slot: int) -> None: ...

    def remove(self, slot: int) -> None: ...

    def touch(self, slots: array[int]) -> int:
        """Each slot of ``slots`` in the order, last to first, moved to the back (the first named ends the most
        recently used); the others are skipped. Returns how many moved."""
        ...

    def demote(self, slots: array[int]) -> int:
        """Each slot of ``slots`` in the order, first to last, moved to the front (the last named ends the least
        recently used). Returns how many moved."""
        ...

    def __iter__(self) -> Iterator[int]:
        """The slots, least recently used first. The order must not change until the iteration ends."""
        ...

    def copy_into(self, other: Order) -> None:
        """``other`` (empty) gets this order's slots in this order."""
        ...


def slots_array(slots: Iterable[int]) -> array[int]:
    """Slots as the C arrays take them."""
    return array("i", slots)


class _Lib:
    """The loaded library's functions, with their C types."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        p, i64, ptr = ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p
        for name, restype, argtypes in (
            ("kvpool_lru_new", p, [i64]), ("kvpool_lru_free", None, [p]), ("kvpool_lru_grow", ctypes.c_int, [p, i64]),
            ("kvpool_lru_count", i64, [p]), ("kvpool_lru_contains", ctypes.c_int, [p, i64]),
            ("kvpool_lru_push_back", ctypes.c_int, [p, i64]), ("kvpool_lru_remove", ctypes.c_int, [p, i64]),
            ("kvpool_lru_touch", i64, [p, ptr, i64]), ("kvpool_lru_demote", i64, [p, ptr, i64]),
            ("kvpool_lru_read", i64, [p, i64, ptr, i64]), ("kvpool_lru_copy", i64, [p, p]),
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name.removeprefix("kvpool_lru_"), fn)


def _address(slots: array[int]) -> int:
    return slots.buffer_info()[0]


class NativeOrder:
    """The order in C (module doc)."""

    __slots__ = ("_lib", "_o", "_free")

    def __init__(self, lib: _Lib, capacity: int = 1024) -> None:
        self._lib = lib
        self._o = lib.new(capacity)
        if not self._o:
            raise MemoryError("kvpool_lru_new")
        self._free = lib.free  # kept: at interpreter exit the module's globals may be gone before this object

    def __del__(self) -> None:
        if getattr(self, "_o", None):
            self._free(self._o)
            self._o = None

    def __len__(self) -> int:
        return int(self._lib.count(self._o))

    def __contains__(self, slot: int) -> bool:
        return bool(self._lib.contains(self._o, slot))

    def grow(self, capacity: int) -> None:
        if self._lib.grow(self._o, capacity) != 0:
            raise MemoryError(f"growing an order to {capacity} slots")

    def push_back(self, slot: int) -> None:
        if self._lib.push_back(self._o, slot) != 0:
            raise ValueError(f"slot {slot} is out of range or already in the order")

    def remove(self, slot: int) -> None:
        if self._lib.remove(self._o, slot) != 0:
            raise ValueError(f"slot {slot} is not in the order")

    def touch(self, slots: array[int]) -> int:
        return int(self._lib.touch(self._o, _address(slots), len(slots))) if slots else 0

    def demote(self, slots: array[int]) -> int:
        return int(self._lib.demote(self._o, _address(slots), len(slots))) if slots else 0

    def __iter__(self) -> Iterator[int]:
        out = array("i", bytes(4 * READ_BATCH))
        after = -1
        while True:
            n = self._lib.read(self._o, after, _address(out), READ_BATCH)
            if n < 0:
                raise RuntimeError("the order changed during an iteration over it")
            if n == 0:
                return
            yield from out[:n]
            after = out[n - 1]

    def copy_into(self, other: Order) -> None:
        if not isinstance(other, NativeOrder) or self._lib.copy(other._o, self._o) < 0:
            raise ValueError("an order is copied into an empty native order at least as large")


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

    def touch(self, slots: array[int]) -> int:
        moved = 0
        for s in reversed(slots):
            if s in self:
                moved += 1
                if self.tail != s:
                    self._unlink(s)
                    self._link_back(s)
        return moved

    def demote(self, slots: array[int]) -> int:
        moved = 0
        for s in slots:
            if s in self:
                moved += 1
                if self.head != s:
                    self._unlink(s)
                    self._link_front(s)
        return moved

    def __iter__(self) -> Iterator[int]:
        s = self.head
        while s != END:
            yield s
            if self.prev[s] == OUT:  # taken out while the caller held it: where it led is unknown now
                raise RuntimeError("the order changed during an iteration over it")
            s = self.next[s]

    def copy_into(self, other: Order) -> None:
        if not isinstance(other, PyOrder) or other.count or len(other.prev) < len(self.prev):
            raise ValueError("an order is copied into an empty Python order at least as large")
        for s in self:
            other._link_back(s)
        other.count = self.count


_LIB: _Lib | None | bool = False  # False: not looked for yet


def library() -> _Lib | None:
    """The built library, loaded at the first call; None where it is not built (``scripts/setup.sh`` and the
    master at its start build it: ``kvpool.native_build``; this module only looks) or switched off."""
    global _LIB
    if _LIB is False:
        path = None if os.environ.get(SWITCH_ENV, "on") == "off" else native_build.find(SOURCE)
        try:
            _LIB = _Lib(str(path)) if path is not None else None
        except OSError:
            _LIB = None
    return _LIB  # type: ignore[return-value]


def native() -> bool:
    """Whether new orders are the C ones."""
    return library() is not None


def new_order(capacity: int = 1024, native: bool | None = None) -> Order:
    """An empty order for slots below ``capacity`` (``grow`` raises it): the C one where its library is built,
    unless ``native`` says which."""
    lib = library()
    if native is None:
        native = lib is not None
    if native:
        if lib is None:
            raise native_build.NativeUnavailable(f"{SOURCE.name}'s library is not built here (scripts/setup.sh)")
        return NativeOrder(lib, capacity)
    return PyOrder(capacity)
