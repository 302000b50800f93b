"""Which path a stage's handoff writes take (``kvpool.core.handoff.target.handoff_path``): decode's declared host
decides, as a pool segment's does; and a target's shared arena is checked by field."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.core.handoff.layout import HandoffLayout
from kvpool.core.handoff.target import HandoffTarget, check_target, handoff_path
from kvpool.core.pool.paths import BytePath, SharedMemoryRef

SHARED = SharedMemoryRef("/run/kvpool/decode-0.sock", "decode-arena", "0123abcd")
SPLIT = ((0, 2), (2, 4))
LAYOUT = HandoffLayout.of(10, SPLIT, 64)
BASE = 1 << 30


def target(**change: object) -> HandoffTarget:
    t = HandoffTarget(region_id="7", endpoint="127.0.0.1:9", address=BASE + 4096, size=LAYOUT.nbytes,
                      deadline_unix_ms=0, layout=LAYOUT, host="node-a", shared=SHARED, shared_base_address=BASE)
    return dataclasses.replace(t, **change)


def test_a_stage_on_decodes_declared_host_copies_into_its_shared_arena() -> None:
    assert handoff_path(target(), "node-a") is BytePath.MEMORY


def test_a_stage_on_another_host_writes_by_engine_even_with_the_arena_offered() -> None:
    assert handoff_path(target(), "node-b") is BytePath.ENGINE


def test_engine_only_no_shared_arena_or_no_declared_host_write_by_engine() -> None:
    assert handoff_path(target(), "node-a", engine_only=True) is BytePath.ENGINE
    assert handoff_path(target(shared=None), "node-a") is BytePath.ENGINE
    assert handoff_path(target(host=""), "") is BytePath.ENGINE  # an old decode: no host, no arena
    assert handoff_path(target(host="", shared=None, shared_base_address=0), "node-a") is BytePath.ENGINE


def test_the_region_starts_at_its_address_less_the_arenas_base() -> None:
    assert target().shared_offset == 4096


def test_a_target_with_a_shared_arena_passes_its_checks() -> None:
    check_target(target(), LAYOUT, SPLIT, 64, 0)
    check_target(target(shared=None, shared_base_address=0), LAYOUT, SPLIT, 64, 0)


@pytest.mark.parametrize("change, message", [
    ({"shared": SharedMemoryRef("relative.sock", "a", "b")}, "^target.shared_memory.socket_path: "),
    ({"shared": SharedMemoryRef("/s.sock", "a", "")}, "^target.shared_memory.token: "),
    ({"shared_base_address": 0}, "^target.shared_base_address: "),
    ({"shared_base_address": BASE + 4097}, "^target.shared_base_address: "),
])
def test_a_bad_shared_arena_names_its_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        check_target(target(**change), LAYOUT, SPLIT, 64, 0)
