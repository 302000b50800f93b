"""Which path a pool move takes (``kvpool.core.pool.paths``): the declared host decides."""

from __future__ import annotations

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.core.pool.paths import BytePath, SegmentAccess, SharedMemoryRef, byte_path

SHARED = SharedMemoryRef("/run/kvpool/store-0.sock", "store-0", "0123abcd")


def test_the_same_declared_host_with_shared_memory_moves_by_memory() -> None:
    assert byte_path(SegmentAccess("s0", "node-a", 4096, SHARED), "node-a") is BytePath.MEMORY


def test_another_host_moves_by_engine_even_with_shared_memory_offered() -> None:
    # an emulated host in a network namespace shares the kernel and could reach the socket: the host decides
    assert byte_path(SegmentAccess("s0", "node-b", 4096, SHARED), "node-a") is BytePath.ENGINE


def test_no_shared_memory_no_access_or_engine_only_moves_by_engine() -> None:
    assert byte_path(SegmentAccess("s0", "node-a", 4096), "node-a") is BytePath.ENGINE
    assert byte_path(None, "node-a") is BytePath.ENGINE
    assert byte_path(SegmentAccess("s0", "node-a", 4096, SHARED), "node-a", engine_only=True) is BytePath.ENGINE
    assert byte_path(SegmentAccess("s0", "", 4096, SHARED), "") is BytePath.ENGINE  # no host declared


def test_an_offset_is_the_address_within_the_segment() -> None:
    assert SegmentAccess("s0", "node-a", 1 << 30, SHARED).offset((1 << 30) + 8192) == 8192


@pytest.mark.parametrize("ref, field", [
    (SharedMemoryRef("relative.sock", "a", "b"), "shared_memory.socket_path"),
    (SharedMemoryRef("/" + "x" * 107, "a", "b"), "shared_memory.socket_path"),
    (SharedMemoryRef("/s.sock", "", "b"), "shared_memory.name"),
    (SharedMemoryRef("/s.sock", "a b", "b"), "shared_memory.name"),
    (SharedMemoryRef("/s.sock", "a", "x" * 129), "shared_memory.token"),
    (SharedMemoryRef("/s.sock", "a", "line\n"), "shared_memory.token"),
])
def test_a_bad_reference_is_refused_naming_its_part(ref: SharedMemoryRef, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        ref.check("shared_memory")
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")
    SharedMemoryRef("/s.sock", "a", "b").check("shared_memory")
