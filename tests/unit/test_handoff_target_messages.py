"""A ``HandoffTarget`` through its message and back keeps decode's host and shared arena; an old target (none)
converts to one that every stage writes by engine."""

from __future__ import annotations

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.core.handoff.layout import HandoffLayout
from kvpool.core.handoff.target import HandoffTarget
from kvpool.core.pool.paths import SharedMemoryRef
from kvpool.handoff_messages import target_from_message, target_message

LAYOUT = HandoffLayout.of(10, ((0, 2), (2, 4)), 64, 16)
SHARED = SharedMemoryRef("/tmp/kvpool-1/decode-0.sock", "decode-arena", "0123abcd")


def test_host_and_shared_arena_round_trip() -> None:
    t = HandoffTarget(region_id="7", endpoint="127.0.0.1:9", address=(1 << 30) + 64, size=LAYOUT.nbytes,
                      deadline_unix_ms=5, layout=LAYOUT, notify_address="127.0.0.1:7800", host="node-a",
                      shared=SHARED, shared_base_address=1 << 30)
    assert target_from_message(target_message(t)) == t


def test_a_target_without_them_has_no_host_and_no_arena() -> None:
    t = HandoffTarget(region_id="7", endpoint="127.0.0.1:9", address=64, size=LAYOUT.nbytes, deadline_unix_ms=0,
                      layout=LAYOUT)
    message = target_message(t)
    assert not message.HasField("shared_memory")
    back = target_from_message(message)
    assert (back.host, back.shared, back.shared_base_address) == ("", None, 0)


def test_a_malformed_shared_arena_is_refused_by_field() -> None:
    message = target_message(HandoffTarget(region_id="7", endpoint="e", address=64, size=LAYOUT.nbytes,
                                           deadline_unix_ms=0, layout=LAYOUT))
    message.shared_memory.socket_path = "relative.sock"
    with pytest.raises(InvalidArgument, match="^target.shared_memory.socket_path: "):
        target_from_message(message)
