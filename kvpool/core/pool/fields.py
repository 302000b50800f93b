"""Passes over a list of records reading or writing one ``__slots__`` field of each (the index's groups).

A lookup reads one field of every group of a whole history several times (``ready``, ``slot``, the kept encoding)
and its lease counts each group up, its release down: each a Python step per group, together most of a long
lookup's cost. The C passes (``kvpool/native/lru.c``, in the order's extension module) do each in one loop at the
field's offset; ``PyFields`` does the same in Python where that module is not built or is switched off (the
order's switch, ``KVPOOL_NATIVE_ORDER=off``). The tests hold the two to one behaviour.

Every record must be an instance of ``cls``; the C passes raise TypeError otherwise, and for a field that is not a
writable ``__slots__`` member of ``cls``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, Protocol

from kvpool.core.pool import lru


class Passes(Protocol):
    def leading(self, items: Sequence[Any], cls: type, name: str) -> int:
        """How many leading items have the field True (``None``, a missing record, or any other value ends the
        run)."""
        ...

    def count(self, items: Sequence[Any], cls: type, name: str) -> int:
        """How many items have the field True."""
        ...

    def values(self, items: Sequence[Any], cls: type, name: str) -> list[Any]:
        """The items' fields."""
        ...

    def add(self, items: Sequence[Any], cls: type, name: str, delta: int) -> None:
        """Each item's int field grows by ``delta`` (an item named twice, twice)."""
        ...

    def join_pairs(self, pairs: Sequence[tuple[bytes, tuple[Any, ...]]]) -> tuple[bytes, set[Any]]:
        """The pairs' bytes joined, and the set of what their tuples hold."""
        ...


class PyFields:
    """The passes in Python (module doc)."""

    @staticmethod
    def leading(items: Sequence[Any], cls: type, name: str) -> int:
        n = 0
        for item in items:
            if item is None or getattr(item, name) is not True:
                break
            n += 1
        return n

    @staticmethod
    def count(items: Sequence[Any], cls: type, name: str) -> int:
        return sum(value is True for value in map(attrgetter(name), items))

    @staticmethod
    def values(items: Sequence[Any], cls: type, name: str) -> list[Any]:
        return list(map(attrgetter(name), items))

    @staticmethod
    def add(items: Sequence[Any], cls: type, name: str, delta: int) -> None:
        for item in items:
            setattr(item, name, getattr(item, name) + delta)

    @staticmethod
    def join_pairs(pairs: Sequence[tuple[bytes, tuple[Any, ...]]]) -> tuple[bytes, set[Any]]:
        return b"".join(map(_FIRST, pairs)), set(chain.from_iterable(map(_SECOND, pairs)))


_FIRST = itemgetter(0)
_SECOND = itemgetter(1)
_IMPL: Passes | None = None


def passes() -> Passes:
    """The C passes where the order's module is built and on (``lru.native_module``), else ``PyFields``; chosen
    at the first call in a process."""
    global _IMPL
    if _IMPL is None:
        module: Any = lru.native_module()
        _IMPL = module if module is not None and hasattr(module, "join_pairs") else PyFields()
    return _IMPL


def native() -> bool:
    return not isinstance(passes(), PyFields)


def leading(items: Sequence[Any], cls: type, name: str) -> int:
    return passes().leading(items, cls, name)


def count(items: Sequence[Any], cls: type, name: str) -> int:
    return passes().count(items, cls, name)


def values(items: Sequence[Any], cls: type, name: str) -> list[Any]:
    return passes().values(items, cls, name)


def add(items: Sequence[Any], cls: type, name: str, delta: int) -> None:
    passes().add(items, cls, name, delta)


def join_pairs(pairs: Sequence[tuple[bytes, tuple[Any, ...]]]) -> tuple[bytes, set[Any]]:
    return passes().join_pairs(pairs)
