"""The Hugging Face tokenizer directory written for peers' clients counts exactly as the built-in models do."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from kvpool.tokenizer import ByteTokenizer
from kvpool.tools.byte_tokenizer_dir import write_byte_tokenizer


def test_same_ids_as_the_byte_tokenizer(tmp_path: Path) -> None:
    hf = Tokenizer.from_file(str(write_byte_tokenizer(tmp_path) / "tokenizer.json"))
    ours = ByteTokenizer(1024)
    for text in ("def fib(n):\n    return n", "héllo wörld ✓", " leading space", "\x00\x7f\xff"):
        assert hf.encode(text).ids == ours.encode(text)
        assert hf.decode(ours.encode(text)) == text
    assert hf.get_vocab_size() == 256
