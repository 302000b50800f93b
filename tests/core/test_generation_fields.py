"""Request field checks shared by the HTTP and gRPC APIs (``kvpool.core.api.generation_fields``)."""

from __future__ import annotations

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.core.api.generation_fields import check_prompt_text


def test_prompt_text_is_bounded_by_the_context_times_the_longest_token() -> None:
    check_prompt_text(0, 1, 64, "prompt")
    check_prompt_text(63, 1, 64, "prompt")  # 63 one-byte tokens fit a 64-token context (one token of output)
    check_prompt_text(63 * 11, 11, 64, "messages")
    with pytest.raises(InvalidArgument) as info:
        check_prompt_text(64, 1, 64, "prompt")
    assert info.value.field == "prompt"
    assert str(info.value) == ("prompt: the prompt's text has 64 characters; this server serves at most 63 prompt "
                               "tokens, and no token here stands for more than 1 character, so at most 63 characters")
    with pytest.raises(InvalidArgument, match="text: the prompt's text has 694 characters; .* at most 693 characters"):
        check_prompt_text(63 * 11 + 1, 11, 64, "text")
