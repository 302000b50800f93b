"""The pool client's values: an object to put, where a stored object lies, a lookup's leased groups, and
what became of each put and read; and the xxh3-64 checksum every stored object carries (a put computes it
over the caller's bytes, a read verifies the bytes that land against it)."""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash


class ReadStatus(enum.Enum):
    VERIFIED = "verified"
    # the bytes arrived and do not hash to the object's checksum: the pool's copy is bad
    CORRUPT = "corrupt"
    # the transfer failed (store gone, unreachable): says nothing of the copy
    NOT_READ = "not_read"


class PutResult(enum.Enum):
    STORED = "stored"
    # first writer wins: somebody stored (or is storing) this key already
    EXISTS = "exists"
    NOT_STORED = "not_stored"


@dataclass(slots=True, frozen=True)
class PutObject:
    """One object to store, read from ``size`` bytes at ``address`` (registered memory)."""

    key: str
    group_id: str
    group_size: int
    address: int
    size: int


@dataclass(slots=True, frozen=True)
class ObjectLocation:
    key: str
    endpoint: str
    address: int
    size: int
    checksum: int
    segment_id: str = ""  # how the client reaches it: the lookup's SegmentAccess of this segment


@dataclass(slots=True, frozen=True)
class GroupLocation:
    group_id: str
    members: dict[str, ObjectLocation]


@dataclass(slots=True, frozen=True)
class LookupResult:
    """The leading complete groups of those asked: ``groups`` are the located ones, from the ``first``th
    (the caller's held prefix, counted but not located), protected from eviction until the lease ends."""

    groups: list[GroupLocation]
    lease_id: int
    lease_ms: int
    first: int = 0
    found: int = -1  # leading complete groups from the first asked; -1: ``first + len(groups)``

    @property
    def num_complete(self) -> int:
        return self.found if self.found >= 0 else self.first + len(self.groups)

    def group(self, index: int) -> GroupLocation:
        """The located group of the ``index``th id asked (at least ``first``)."""
        if index < self.first:
            raise IndexError(f"group {index} is in the held prefix ({self.first}): not located")
        return self.groups[index - self.first]


def checksum(address: int, size: int) -> int:
    """xxh3-64 of ``size`` bytes at ``address``, read in place."""
    return xxhash.xxh3_64_intdigest((ctypes.c_char * size).from_address(address))


def checksums(objects: Sequence[PutObject]) -> list[int]:
    return [checksum(o.address, o.size) for o in objects]
