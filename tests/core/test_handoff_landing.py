"""Which parts of a region have landed: exact ranges, completeness, bad notices by field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.errors import InvalidArgument
from kvpool.core.handoff.landing import LandedParts
from kvpool.core.handoff.layout import HandoffLayout

LAYOUT = HandoffLayout.of(num_tokens=600, layer_split=[(0, 2), (2, 4)], entry_bytes=8, trailer_bytes=16)


def test_ranges_merge_and_the_region_is_complete_only_with_every_stage_and_the_trailer() -> None:
    parts = LandedParts(LAYOUT)
    parts.land(0, 256, 512)
    parts.land(0, 0, 256)
    assert parts.ranges == [[(0, 512)], []]
    parts.land(0, 512, 600)
    assert parts.stage_complete(0) and not parts.complete
    parts.land(1, 0, 300)
    parts.land(1, 400, 600)
    assert parts.ranges[1] == [(0, 300), (400, 600)]
    parts.land(1, 300, 400)
    assert parts.ranges[1] == [(0, 600)] and not parts.complete  # the logits have not landed
    parts.land(1, 0, 0, trailer=True)
    assert parts.complete
    parts.land(1, 0, 600)  # a repeated notice changes nothing
    assert parts.ranges == [[(0, 600)], [(0, 600)]] and parts.complete


def test_without_a_trailer_the_kv_alone_completes() -> None:
    parts = LandedParts(HandoffLayout.of(10, [(0, 1)], 8))
    assert not parts.complete and not parts.any_landed
    parts.land(0, 0, 10)
    assert parts.complete and parts.any_landed


@pytest.mark.parametrize(("stage", "start", "end", "trailer", "field"), [
    (2, 0, 10, False, "stage"), (-1, 0, 10, False, "stage"), (0, 5, 5, False, "token_end"),
    (0, 10, 601, False, "token_end"), (0, 9, 3, False, "token_end"),
])
def test_a_bad_notice_names_its_field(stage: int, start: int, end: int, trailer: bool, field: str) -> None:
    parts = LandedParts(LAYOUT)
    with pytest.raises(InvalidArgument, match=f"^{field}"):
        parts.land(stage, start, end, trailer)
    assert parts.ranges == [[], []]


def test_a_trailer_notice_needs_a_trailer() -> None:
    with pytest.raises(InvalidArgument, match="^trailer"):
        LandedParts(HandoffLayout.of(10, [(0, 1)], 8)).land(0, 0, 0, trailer=True)


@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 599), st.integers(1, 600)), max_size=30))
def test_ranges_stay_disjoint_sorted_and_cover_exactly_what_landed(notices: list[tuple[int, int, int]]) -> None:
    parts = LandedParts(LAYOUT)
    covered: list[set[int]] = [set(), set()]
    for stage, a, length in notices:
        end = min(600, a + length)
        parts.land(stage, a, end)
        covered[stage] |= set(range(a, end))
        for k in (0, 1):
            ranges = parts.ranges[k]
            assert all(x[1] < y[0] for x, y in zip(ranges, ranges[1:]))  # disjoint, sorted, not touching
            assert {t for s, e in ranges for t in range(s, e)} == covered[k]
    assert not parts.complete  # the trailer never landed
