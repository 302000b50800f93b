"""Stop strings across streamed pieces: exact emitted text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.errors import InvalidArgument
from kvpool.core.decode.stop_strings import StopMatcher


def stream(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher.of(stops)
    out = "".join(matcher.push(p) for p in pieces)
    if not matcher.stopped:
        out += matcher.flush()
    return out, matcher.stopped


def test_stop_spanning_pieces_is_cut_and_never_emitted() -> None:
    matcher = StopMatcher.of(["END"])
    assert matcher.push("hello E") == "hello "  # "E" might start END
    assert matcher.push("N") == ""
    assert matcher.push("Dx") == "" and matcher.stopped
    assert matcher.push("more") == ""


def test_false_alarm_is_released() -> None:
    matcher = StopMatcher.of(["END"])
    assert matcher.push("an E") == "an "
    assert matcher.push("Nx") == "ENx"
    assert matcher.push("E") == ""
    assert matcher.flush() == "E"


def test_earliest_of_several_stops_wins() -> None:
    assert stream(["ab", "c\n\nd", "ef"], ["ef", "\n\n"]) == ("abc", True)
    assert stream(["abc"], ["x"]) == ("abc", False)


@given(text=st.text(alphabet="abE\nND", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6))
def test_pieces_do_not_change_the_answer(text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    stops = ["END", "\n\n"]
    whole = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    expected = (text[:whole], True) if whole >= 0 else (text, False)
    assert stream(pieces, stops) == expected


def test_bad_stops_name_the_field() -> None:
    with pytest.raises(InvalidArgument, match=r"^stop\[1\]"):
        StopMatcher.of(["a", ""])
    with pytest.raises(InvalidArgument, match="at most 4"):
        StopMatcher.of(["a", "b", "c", "d", "e"])
