"""A request body as one JSON object, at most ``MAX_JSON_DEPTH`` deep and valid Unicode throughout, else a
400 in OpenAI's shape; ``MAX_BODY_BYTES`` bounds it before it is parsed (the HTTP API answers 413 past it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvpool.services.router.openai_errors import ApiError, invalid

MAX_BODY_BYTES = 32 << 20
MAX_JSON_DEPTH = 64


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
    _check_tree(body)
    return body


def _check_tree(body: dict[str, Any]) -> None:
    """Walk the whole body once, without recursion: its depth, and every string and key as valid Unicode."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(body, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise invalid(_path(path), f"holds a lone surrogate {value[exc.start]!r} at character {exc.start}, "
                              "which is not valid Unicode text") from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels at {_path(path)}",
                           _path(path) or None, "invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                stack.append((key, depth, path))
            stack.append((item, depth + 1, (*path, key)))


def _path(path: Sequence[Any]) -> str:
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text
