"""Reader of the Mooncake FAST'25 trace format (``traces/mooncake/*.jsonl``).

One JSON object per line::

    {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}

``hash_ids`` has one id per ``BLOCK_SIZE`` (512) -token block of the input,
GLOBAL across the file: equal ids in two requests are equal content, whoever
sent them (the traces are cross-request reuse). The real files give
``ceil(input_length / 512)`` ids (the last block partial); ``floor`` is also
accepted, as for the weka format. Blank lines are skipped; anything else
malformed raises ValueError naming the file, the line and the field.

The trace has no session ids, so a request is an arrival, not a turn of a
known conversation: ``kvpool.tools.replay`` plays the file as an open-loop arrival
stream by ``timestamp``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_SIZE = 512


@dataclass(slots=True, frozen=True)
class MooncakeRequest:
    """One line: arrival ``t`` in seconds (``timestamp / 1000``), token counts, global block ids."""

    line: int
    t: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def _int(obj: dict[str, Any], key: str, where: str) -> int:
    if key not in obj:
        raise ValueError(f"{where}: {key}: missing")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {key}: expected an integer >= 0, got {value!r}")
    return value


def parse_request(obj: Any, where: str, line: int = 0) -> MooncakeRequest:
    """One decoded line; ``where`` names it in errors."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    timestamp = obj.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not math.isfinite(timestamp) \
            or timestamp < 0:
        raise ValueError(f"{where}: timestamp: expected a finite number of ms >= 0, got {timestamp!r}")
    input_tokens = _int(obj, "input_length", where)
    output_tokens = _int(obj, "output_length", where)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
        raise ValueError(f"{where}: hash_ids: expected a list of integers")
    full, whole = input_tokens // BLOCK_SIZE, -(-input_tokens // BLOCK_SIZE)
    if len(hash_ids) not in (full, whole):
        raise ValueError(f"{where}: hash_ids: {len(hash_ids)} ids for input_length={input_tokens}; expected "
                         f"{whole} (one per {BLOCK_SIZE}-token block) or {full} (full blocks)")
    return MooncakeRequest(line, timestamp / 1000.0, input_tokens, output_tokens, tuple(hash_ids))


def load_mooncake(path: Path | str, limit: int | None = None) -> list[MooncakeRequest]:
    """The requests of a ``.jsonl`` file in file order (the real files are in timestamp order)."""
    path = Path(path)
    requests: list[MooncakeRequest] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON: {exc}") from exc
            requests.append(parse_request(obj, where, number))
    return requests


def mooncake_block_bound(requests: list[MooncakeRequest]) -> float:
    """Share of input tokens in blocks whose id appeared in any earlier request (global ids)."""
    seen: set[int] = set()
    reused = total = 0
    for request in requests:
        total += request.input_tokens
        for i, hash_id in enumerate(request.hash_ids):
            if hash_id in seen:  # a last partial block counts its own tokens
                reused += min(BLOCK_SIZE, request.input_tokens - BLOCK_SIZE * i)
        seen.update(request.hash_ids)
    return reused / total if total else 0.0
