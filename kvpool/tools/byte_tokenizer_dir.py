"""A Hugging Face tokenizer directory equal to the built-in models' byte-level tokenizer, for peers' clients.

Clients such as NVIDIA's ``aiperf`` count and synthesize tokens with a
Hugging Face tokenizer (``--tokenizer DIR``). The built-in models read UTF-8
bytes as ids 0..255 (``kvpool.tokenizer.ByteTokenizer``); this writes a
``tokenizer.json`` whose byte-level BPE has those 256 ids and no merges, so
the client's counts are the server's.

    python -m kvpool.tools.byte_tokenizer_dir DIR
    python -m kvpool.tools.byte_tokenizer_dir --hub-cache HF_HOME   # as the Hub model kvpool/byte-tokenizer

aiperf 0.13 decodes a trace's token blocks in worker processes that force
``HF_HUB_OFFLINE=1``, and offline it looks every tokenizer name up as a Hub
cache snapshot, a directory path included (which fails). ``--hub-cache`` writes
the tokenizer as a local Hugging Face cache entry (``HF_HOME/hub/models--kvpool--byte-tokenizer``,
``refs/main`` naming its one snapshot): with ``HF_HOME`` pointing there, the
name ``kvpool/byte-tokenizer`` loads offline in every process.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

HUB_NAME = "kvpool/byte-tokenizer"


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


def write_hub_cache_entry(hf_home: str | Path, name: str = HUB_NAME) -> Path:
    """The tokenizer as the Hub model ``name`` in the cache under ``hf_home`` (``$HF_HOME``); returns the snapshot.

    The snapshot's name is the files' sha1 (any 40 hex digits serve: it only has to match ``refs/main``)."""
    repo = Path(hf_home) / "hub" / f"models--{name.replace('/', '--')}"
    staging = write_byte_tokenizer(repo / "staging")
    files = sorted(staging.iterdir())
    commit = hashlib.sha1(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in files:
        file.replace(snapshot / file.name)
    staging.rmdir()
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--hub-cache":
        print(write_hub_cache_entry(sys.argv[2]))
    elif len(sys.argv) == 2:
        print(write_byte_tokenizer(sys.argv[1]))
    else:
        raise SystemExit("usage: python -m kvpool.tools.byte_tokenizer_dir DIR | --hub-cache HF_HOME")
