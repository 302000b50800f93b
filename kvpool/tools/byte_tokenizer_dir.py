"""A Hugging Face tokenizer directory equal to the built-in models' byte-level tokenizer, for peers' clients.

Clients such as NVIDIA's ``aiperf`` count and synthesize tokens with a
Hugging Face tokenizer (``--tokenizer DIR``). The built-in models read UTF-8
bytes as ids 0..255 (``kvpool.tokenizer.ByteTokenizer``); this writes a
``tokenizer.json`` whose byte-level BPE has those 256 ids and no merges, so
the client's counts are the server's.

    python -m kvpool.tools.byte_tokenizer_dir DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def write_byte_tokenizer(directory: str | Path, context: int = 32768) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    alphabet = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context}))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m kvpool.tools.byte_tokenizer_dir DIR")
    print(write_byte_tokenizer(sys.argv[1]))
