"""The request models' edges: the raw-text depth check agrees with the walk, and a refusal's place is its name."""

from __future__ import annotations

import pytest

from kvpool.services.router.json_body import MAX_JSON_DEPTH, _plainly_fine, parse_json
from kvpool.services.router.openai_errors import ApiError, param_of


@pytest.mark.parametrize(
    ("raw", "fine"),
    [
        (b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}", True),  # 64 levels with the body
        (b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}", False),
        (b'{"a": "' + b"]" * 200 + b'", "b": ' + b"[" * 64 + b"]" * 64 + b"}", False),  # brackets in text count not
        (b'{"a": "\\"' + b"[" * 200 + b'\\\\", "b": [{}]}', True),  # escaped quote and backslash stay inside
        (b'{"a": "\\ud83d\\ude00"}', False),  # a surrogate pair: the walk checks it
        (b'{"a": [' + b"{}," * 1000 + b"{}]}", True),
    ],
)
def test_the_raw_text_check_sends_deep_or_surrogate_bodies_to_the_walk(raw: bytes, fine: bool) -> None:
    assert _plainly_fine(raw) is fine
    deep = raw.count(b"[" * (MAX_JSON_DEPTH))
    if deep and not fine:
        with pytest.raises(ApiError) as info:
            parse_json(raw)
        assert info.value.param == "b" + "[0]" * 63 or info.value.param == "a" + "[0]" * 63
    else:
        parse_json(raw)


def test_a_location_is_named_as_the_api_spells_it() -> None:
    assert param_of(("messages", 0, "content", 2)) == "messages[0].content[2]"
    assert param_of(("stream_options", "include_usage")) == "stream_options.include_usage"
    assert param_of(()) == ""
