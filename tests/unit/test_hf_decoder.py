"""A model directory's streaming decoder (``kvpool.tokenizer._HFDecoder``) over a byte-level BPE ``tokenizer.json``
(256 byte tokens, no merges: a character is one to four tokens): the streamed pieces are the text, no piece ends in
half a character, and each token decodes only a short window of ids, so a long stream costs linear time."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.tokenizer import HFTokenizer
from kvpool.tools.byte_tokenizer_dir import write_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(write_byte_tokenizer(tmp_path_factory.mktemp("bytes")))


class Counting:
    """The ``tokenizers`` object, recording how many ids each decode was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=st.text(st.characters(blacklist_characters="\ufffd"), max_size=60))
def test_the_streamed_pieces_are_the_text_and_never_end_in_half_a_character(tokenizer: HFTokenizer, text: str) -> None:
    decoder = tokenizer.decoder()
    pieces = [decoder.feed(i) for i in tokenizer.encode(text)]
    assert "".join(pieces) + decoder.flush() == text
    assert not any(p.endswith("\ufffd") for p in pieces)


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement(tokenizer: HFTokenizer) -> None:
    decoder = tokenizer.decoder()
    ids = tokenizer.encode("a✓")[:-1]  # 'a' and two of the check mark's three bytes
    assert [decoder.feed(i) for i in ids] == ["a", "", ""]
    assert decoder.flush() == "\ufffd"


def test_each_token_decodes_a_short_window(tokenizer: HFTokenizer) -> None:
    decoder = tokenizer.decoder()
    counting = Counting(decoder._tokenizer)
    decoder._tokenizer = counting
    text = "héllo wörld ✓ " * 300  # 4,800 tokens
    assert "".join(decoder.feed(i) for i in tokenizer.encode(text)) + decoder.flush() == text
    assert max(counting.lengths) <= 6  # the last character's bytes and the one before: not the stream so far
