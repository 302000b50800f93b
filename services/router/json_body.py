"""A request body as one JSON object, at most ``MAX_JSON_DEPTH`` deep and valid Unicode throughout, else a
400 in OpenAI's shape; ``MAX_BODY_BYTES`` bounds it before it is parsed (the HTTP API answers 413 past it)."""

from __future__ import annotations

import json
import re
from typing import Any

from kvpool.services.router.openai_errors import ApiError, invalid, param_of

MAX_BODY_BYTES = 32 << 20
MAX_JSON_DEPTH = 64

# where a lone surrogate could come from in UTF-8 JSON: a \uD800-\uDFFF escape, or its UTF-8 form (json reads
# bytes with surrogatepass); a surrogate pair matches too and is then checked by the walk
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_INNERMOST = re.compile(rb"\[\]|\{\}")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; deeper than ``MAX_JSON_DEPTH`` or holding text UTF-8 cannot carry is a 400."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer past Python's digit limit
        raise ApiError(400, f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    if not _plainly_fine(raw):
        _check_tree(body)
    return body


def _plainly_fine(raw: bytes) -> bool:
    """What the raw UTF-8 text shows without walking the parsed tree: no possible surrogate, and no more than
    ``MAX_JSON_DEPTH`` levels (each pass drops the innermost level of brackets, strings taken out first).
    False sends the body through ``_check_tree``, which finds and names what is wrong."""
    if json.detect_encoding(raw) != "utf-8" or _MAYBE_SURROGATE.search(raw):
        return False
    # escaped backslashes, then escaped quotes, go first: every quote left opens or closes a string
    quotes_and_brackets = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    brackets = b"".join(quotes_and_brackets.split(b'"')[::2])  # what lies outside strings
    for _ in range(MAX_JSON_DEPTH):
        if not brackets:
            return True
        brackets = _INNERMOST.sub(b"", brackets)
    return not brackets


def _check_tree(body: dict[str, Any]) -> None:
    """Walk the whole body once, without recursion: its depth, and every string and key as valid Unicode."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(body, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise invalid(param_of(path), f"holds a lone surrogate {value[exc.start]!r} at character "
                              f"{exc.start}, which is not valid Unicode text") from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels at {param_of(path)}",
                           param_of(path) or None, "invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                stack.append((key, depth, path))
            stack.append((item, depth + 1, (*path, key)))
