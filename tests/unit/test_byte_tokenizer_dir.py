"""The Hugging Face tokenizer directory written for peers' clients counts exactly as the built-in models do."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from kvpool.tokenizer import ByteTokenizer
from kvpool.tools.byte_tokenizer_dir import HUB_NAME, write_byte_tokenizer, write_hub_cache_entry


def test_same_ids_as_the_byte_tokenizer(tmp_path: Path) -> None:
    hf = Tokenizer.from_file(str(write_byte_tokenizer(tmp_path) / "tokenizer.json"))
    ours = ByteTokenizer(1024)
    for text in ("def fib(n):\n    return n", "héllo wörld ✓", " leading space", "\x00\x7f\xff"):
        assert hf.encode(text).ids == ours.encode(text)
        assert hf.decode(ours.encode(text)) == text
    assert hf.get_vocab_size() == 256


def test_the_hub_cache_entry_resolves_offline_to_the_same_tokenizer(tmp_path: Path) -> None:
    """What aiperf's offline workers do with a name: the cache's snapshot of it (no network), then load it."""
    from huggingface_hub import snapshot_download

    snapshot = write_hub_cache_entry(tmp_path / "hf")
    found = snapshot_download(HUB_NAME, local_files_only=True, cache_dir=tmp_path / "hf" / "hub")
    assert Path(found) == snapshot
    hf = Tokenizer.from_file(str(Path(found) / "tokenizer.json"))
    assert hf.encode("héllo ✓").ids == ByteTokenizer(1024).encode("héllo ✓")
