"""The handoff's edge checks: every bad target is refused with the field named, before anything moves."""

from __future__ import annotations

import pytest

from kvpool.core.errors import FailedPrecondition, InvalidArgument
from kvpool.rpc import handoff_pb2
from kvpool.core.handoff.target import check_target
from kvpool.handoff_messages import target_from_message, target_layout

SPLIT = [(0, 4), (4, 8)]
ENTRY = 384
NOW_MS = 1_800_000_000_000


def target(num_tokens: int = 100, split: list[tuple[int, int]] = SPLIT, entry: int = ENTRY,
           **fields: object) -> handoff_pb2.HandoffTarget:
    layout = handoff_pb2.HandoffLayout(num_tokens=num_tokens, entry_bytes=entry,
                                       layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in split])
    values: dict[str, object] = {"region_id": "r", "endpoint": "127.0.0.1:9", "address": 1 << 20,
                                 "size": 8 * num_tokens * ENTRY, "deadline_unix_ms": NOW_MS + 1, "layout": layout}
    values.update(fields)
    return handoff_pb2.HandoffTarget(**values)  # type: ignore[arg-type]


def check(t: handoff_pb2.HandoffTarget) -> None:
    check_target(target_from_message(t), target_layout(t), SPLIT, ENTRY, NOW_MS)


def test_a_target_that_fits_passes() -> None:
    t = target()
    check(t)
    assert target_layout(t).nbytes == 8 * 100 * ENTRY
    check(target(deadline_unix_ms=0))  # no deadline


@pytest.mark.parametrize(
    ("t", "error", "message"),
    [
        (handoff_pb2.HandoffTarget(endpoint="e", address=1, size=1), InvalidArgument, "target.layout: missing"),
        (target(num_tokens=0), InvalidArgument, "target.layout.num_tokens"),
        (target(entry=0), InvalidArgument, "target.layout.entry_bytes"),
        (target(split=[]), InvalidArgument, "target.layout.layer_split"),
        (target(split=[(0, 4), (5, 8)]), InvalidArgument, "target.layout.layer_split[1]"),
        (target(split=[(0, 3), (3, 8)]), InvalidArgument, "is not the pipeline's [(0, 4), (4, 8)]"),
        (target(split=[(0, 8)]), InvalidArgument, "target.layout.layer_split"),
        (target(entry=ENTRY * 2), InvalidArgument, "target.layout.entry_bytes: 768, the pipeline's entries are 384"),
        (target(endpoint=""), InvalidArgument, "target.endpoint"),
        (target(address=0), InvalidArgument, "target.address"),
        (target(size=8 * 100 * ENTRY - 1), InvalidArgument, "target.size: 307199 bytes, the layout needs 307200"),
        (target(deadline_unix_ms=NOW_MS), FailedPrecondition, "target.deadline_unix_ms: the reservation expired 0 ms"),
        (target(deadline_unix_ms=NOW_MS - 250), FailedPrecondition, "expired 250 ms ago"),
    ],
)
def test_a_bad_target_names_its_field(t: handoff_pb2.HandoffTarget, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        check(t)
    assert message in str(info.value)
