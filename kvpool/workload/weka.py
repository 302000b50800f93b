"""Loader of the "weka" trace format (``traces/agentx-weka/trace_*.json``).

A file is one coding-agent session::

    {"id", "block_size", "hash_id_scope", "tool_tokens", "system_tokens",
     "requests": [{"t", "in", "out", "hash_ids", "think_time", ...}, ...]}

A request with ``"type": "subagent"`` holds its own ``requests`` list whose
``t`` are relative to that entry's ``t``; its hash ids share the parent's
namespace.

Choices made here:
- Subagent requests are flattened into the session: each gets the absolute
  time ``entry.t + request.t`` and all turns are stably sorted by that time
  (ties keep file order). A replay that issues the turns one after another
  therefore serialises a subagent with its parent where the real session
  overlapped them; ``Turn.agent_id`` says which stream a turn came from, and
  ``Turn.agent_start`` / ``Turn.parent_agent_id`` keep the tree, so
  ``kvpool.workload.timelines`` can rebuild each agent's own timeline.
- ``hash_ids`` of the real files cover only the FULL 64-token blocks: all 4,223
  requests have ``len(hash_ids) == in // 64`` (59 have ``in % 64 == 0``, where
  that is also ``ceil(in / 64)``); the trailing ``in % 64`` tokens carry no id.
  Both ``floor`` and ``ceil`` counts are accepted (the format's description says
  "one id per block", i.e. ``ceil``); anything else is rejected.
  ``tokens.turn_token_ids`` and ``bounds.trace_block_bound`` treat an id-less
  tail as content never seen before.
- ``think_time`` is missing on a few requests (8 of 4,223); it is then 0.0.
  It is kept as recorded: the pause before this request in its own stream.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_GLOB = "trace_*.json"


@dataclass(slots=True, frozen=True)
class Turn:
    """One model request of a session.

    ``t``: seconds since the session started (absolute, also for subagent turns).
    ``hash_ids``: one id per ``block_size``-token block of the input, chained from
    the start of the prompt (equal ids = equal content and equal prefix); either
    ``input_tokens // block_size`` ids (the real files) or ``ceil`` of it.
    ``agent_id``: None for the main agent, else the subagent's id.
    ``agent_start``: absolute time the turn's agent started (its subagent entry's
    ``t``; 0.0 for the main agent). ``parent_agent_id``: the agent that spawned
    it (None for the main agent and for the main agent's own subagents).
    """

    t: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    think_time: float
    agent_id: str | None = None
    # where the turn sits in the agent tree; not part of what a turn IS (equality, hashing)
    agent_start: float = field(default=0.0, compare=False)
    parent_agent_id: str | None = field(default=None, compare=False)


@dataclass(slots=True, frozen=True)
class Session:
    """A whole trace file; ``turns`` are in nondecreasing ``t``."""

    id: str
    block_size: int
    system_tokens: int
    tool_tokens: int
    turns: tuple[Turn, ...]

    @property
    def shared_prefix_tokens(self) -> int:
        """Length of the system+tool prompt real sessions share with each other."""
        return self.system_tokens + self.tool_tokens


class _Fields:
    """Typed field access that raises ValueError naming the file and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> ValueError:
        return ValueError(f"{self.path}: {where}: {message}")

    def get(self, obj: dict[str, Any], key: str, where: str) -> Any:
        if key not in obj:
            raise self.fail(f"{where}{key}", "missing")
        return obj[key]

    def int_(self, obj: dict[str, Any], key: str, where: str, minimum: int = 0) -> int:
        value = self.get(obj, key, where)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(f"{where}{key}", f"expected an integer >= {minimum}, got {value!r}")
        return value

    def seconds(self, obj: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
        if key not in obj and default is not None:
            return default
        value = self.get(obj, key, where)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise self.fail(f"{where}{key}", f"expected a finite number >= 0, got {value!r}")
        return float(value)

    def list_(self, obj: dict[str, Any], key: str, where: str) -> list[Any]:
        value = self.get(obj, key, where)
        if not isinstance(value, list):
            raise self.fail(f"{where}{key}", f"expected a list, got {type(value).__name__}")
        return value


def _turns(
    fields: _Fields, requests: list[Any], where: str, offset: float, block_size: int, agent_id: str | None,
    parent_id: str | None = None,
) -> Iterable[Turn]:
    """Turns of ``requests`` (recursing into subagents), in file order, absolute times."""
    for index, request in enumerate(requests):
        at = f"{where}requests[{index}]"
        if not isinstance(request, dict):
            raise fields.fail(at, f"expected an object, got {type(request).__name__}")
        at += "."
        t = offset + fields.seconds(request, "t", at)
        if request.get("type") == "subagent":
            sub_id = request.get("agent_id")
            sub_id = sub_id if isinstance(sub_id, str) else at.rstrip(".")  # unnamed: its position
            yield from _turns(fields, fields.list_(request, "requests", at), at, t, block_size, sub_id, agent_id)
            continue
        input_tokens = fields.int_(request, "in", at)
        hash_ids = fields.list_(request, "hash_ids", at)
        if not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise fields.fail(f"{at}hash_ids", "expected a list of integers")
        full_blocks, all_blocks = input_tokens // block_size, -(-input_tokens // block_size)
        if len(hash_ids) not in (full_blocks, all_blocks):
            raise fields.fail(
                f"{at}hash_ids",
                f"{len(hash_ids)} ids for in={input_tokens}; expected {full_blocks} (full blocks)"
                f" or {all_blocks} (all blocks) of {block_size} tokens",
            )
        yield Turn(
            t=t,
            input_tokens=input_tokens,
            output_tokens=fields.int_(request, "out", at),
            hash_ids=tuple(hash_ids),
            think_time=fields.seconds(request, "think_time", at, default=0.0),
            agent_id=agent_id,
            agent_start=offset,
            parent_agent_id=parent_id,
        )


def parse_session(data: Any, path: Path | str = "<trace>") -> Session:
    """A Session from an already-decoded weka document; ``path`` only names it in errors."""
    fields = _Fields(Path(path))
    if not isinstance(data, dict):
        raise fields.fail("top level", f"expected an object, got {type(data).__name__}")
    session_id = fields.get(data, "id", "")
    if not isinstance(session_id, str) or not session_id:
        raise fields.fail("id", f"expected a non-empty string, got {session_id!r}")
    # ids are per file; tokens.py namespaces them by session id, which is wrong for global ids
    scope = data.get("hash_id_scope", "local")
    if scope != "local":
        raise fields.fail("hash_id_scope", f"only 'local' is supported, got {scope!r}")
    block_size = fields.int_(data, "block_size", "", minimum=1)
    turns = list(_turns(fields, fields.list_(data, "requests", ""), "", 0.0, block_size, None))
    turns.sort(key=lambda turn: turn.t)  # stable: equal times keep file order
    return Session(
        id=session_id,
        block_size=block_size,
        system_tokens=fields.int_(data, "system_tokens", ""),
        tool_tokens=fields.int_(data, "tool_tokens", ""),
        turns=tuple(turns),
    )


def load_session(path: Path | str) -> Session:
    """Read and validate one weka trace file. Raises ValueError naming file and field."""
    path = Path(path)
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    return parse_session(data, path)


def load_sessions(directory: Path | str, ids: Iterable[str] | None = None, limit: int | None = None) -> list[Session]:
    """Sessions of ``directory/trace_*.json``, sorted by file name.

    ``ids`` selects files by stem (which is the session id in the real set) and
    keeps the given order; an id with no file raises ValueError. ``limit`` keeps
    the first ``limit`` of the selection.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory")
    files = sorted(directory.glob(TRACE_GLOB))
    if ids is not None:
        by_stem = {f.stem: f for f in files}
        wanted = list(ids)
        missing = [i for i in wanted if i not in by_stem]
        if missing:
            raise ValueError(f"{directory}: no trace file for ids {missing}")
        files = [by_stem[i] for i in wanted]
    if limit is not None:
        files = files[: max(0, limit)]
    return [load_session(f) for f in files]
