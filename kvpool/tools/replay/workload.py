"""What a replay sends: trace sessions as agent timelines of turns, their sizes at a token scale, what was skipped.

Inputs (``load_workload`` picks by path):
- weka: a ``trace_*.json`` folder or one session file. A session keeps its
  subagents as their own timelines (``kvpool.workload.timelines``): they run
  beside the parent at their own times (``kvpool.tools.replay.schedule``). Every
  session arrives at the start (a closed loop: a session starts when a slot of
  ``--concurrency`` frees up).
- Mooncake JSONL (a ``.jsonl`` file): each line is a one-turn session arriving
  at its ``timestamp`` (scaled by ``--think-scale``), i.e. an OPEN-LOOP
  arrival stream capped at ``--concurrency`` requests in flight. Why not
  sessions: the file has no session ids, and grouping by shared leading block
  ids would invent conversations (many requests share only a system prompt);
  the ids are global, so all requests share one token namespace and cross-
  request reuse happens exactly as in the trace.

Invariants: a turn is kept only if ``prompt_tokens + max_tokens`` fits the
model's context (the others are counted in ``skipped_turns`` and left out of
the timelines AND the bounds); ``prompt_tokens`` equals the length of
``ReplaySession.token_ids(turn)`` (the shared prefix included); token ids are a
pure function of (namespace, hash ids, lengths, scale, vocabulary).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvpool.workload.bounds import trace_block_bound
from kvpool.workload.mooncake import BLOCK_SIZE as MOONCAKE_BLOCK_SIZE
from kvpool.workload.mooncake import load_mooncake, mooncake_block_bound
from kvpool.workload.timelines import AgentTimeline, agent_timelines
from kvpool.workload.tokens import (
    scaled_prompt_tokens,
    shared_prefix_tokens,
    turn_token_ids,
)
from kvpool.workload.weka import TRACE_GLOB, Session, load_session


class DeviceCacheTooSmall(ValueError):
    """The longest turn at this scale does not fit one prefill stage's device cache."""


@dataclass(slots=True, frozen=True)
class ReplayTurn:
    """One request to send; ``index`` is its place in the session's time-ordered turns (the bound's order)."""

    index: int
    t: float
    think_time: float
    input_tokens: int
    hash_ids: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    agent_id: str | None = None


@dataclass(slots=True, frozen=True)
class ReplaySession:
    """A session: its key (``prompt_cache_key``), arrival, kept turns and timelines over them."""

    id: str
    namespace: str  # what token ids are derived from: the session id (weka), one per file (Mooncake)
    block_size: int
    arrival_s: float
    prefix_tokens: int  # unscaled shared prefix length, 0 without --shared-prefix
    turns: tuple[ReplayTurn, ...]
    timelines: tuple[AgentTimeline, ...]

    def token_ids(self, turn: ReplayTurn, scale: int, vocab_size: int) -> list[int]:
        prefix = shared_prefix_tokens(self.prefix_tokens, scale, vocab_size) if self.prefix_tokens else []
        return turn_token_ids(self.namespace, turn.hash_ids, turn.input_tokens, self.block_size, scale,
                              vocab_size, prefix)


@dataclass(slots=True)
class ReplayWorkload:
    """Every session to replay, in the order a closed loop takes them."""

    kind: str  # "weka" or "mooncake"
    source: str
    sessions: list[ReplaySession]
    scale: int
    vocab_size: int
    context: int
    trace_block_bound: float  # over every kept turn; the report uses sent_block_bound over the turns sent
    skipped_turns: int
    skipped_reasons: list[str]

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for s in self.sessions for t in s.turns)

    @property
    def longest_prompt(self) -> int:
        return max((t.prompt_tokens for s in self.sessions for t in s.turns), default=0)

    @property
    def num_subagents(self) -> int:
        return sum(len(s.timelines) - 1 for s in self.sessions)


def sent_block_bound(workload: ReplayWorkload, sent: Iterable[tuple[str, int]]) -> float:
    """The trace's own block bound over the turns actually sent, ``(session id, turn index)`` in send order.

    A block counts as reused when its hash id was in an earlier sent turn of the
    same session (weka: ids are per file) or of any request (Mooncake: global ids);
    a last partial block counts its own tokens, an id-less tail never.
    """
    by_id = {s.id: s for s in workload.sessions}
    seen: dict[str, set[int]] = {}
    reused = total = 0
    for session_id, index in sent:
        session = by_id[session_id]
        turn = session.turns[index]
        scope = seen.setdefault(session.namespace, set())
        total += turn.input_tokens
        for i, hash_id in enumerate(turn.hash_ids):
            if hash_id in scope:
                reused += min(session.block_size, turn.input_tokens - session.block_size * i)
        scope.update(turn.hash_ids)
    return reused / total if total else 0.0


def turn_max_tokens(output_tokens: int, scale: int, cap: int) -> int:
    """The turn's output scaled like its input, at least 1, at most ``cap``."""
    return max(1, min(cap, -(-output_tokens // scale)))


def _weka_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob(TRACE_GLOB)) or sorted(path.glob("*.json"))
        if not files:
            raise ValueError(f"{path}: no weka session files (trace_*.json or *.json)")
        return files
    return [path]


@dataclass(slots=True)
class _Builder:
    scale: int
    vocab_size: int
    context: int
    max_tokens: int
    skipped: list[str] = dataclasses.field(default_factory=list)

    def keep(self, where: str, prompt_tokens: int, max_tokens: int) -> bool:
        if prompt_tokens + max_tokens <= self.context:
            return True
        self.skipped.append(f"{where}: {prompt_tokens} prompt + {max_tokens} output tokens > context {self.context}")
        return False

    def weka(self, session: Session, shared_prefix: bool) -> tuple[ReplaySession | None, Session]:
        prefix = session.shared_prefix_tokens if shared_prefix else 0
        prefix_len = -(-prefix // self.scale)
        kept_turns, replay_turns = [], []
        for index, turn in enumerate(session.turns):
            prompt = prefix_len + scaled_prompt_tokens(turn.input_tokens, session.block_size, self.scale)
            out = turn_max_tokens(turn.output_tokens, self.scale, self.max_tokens)
            if not self.keep(f"{session.id} turn {index}", prompt, out):
                continue
            replay_turns.append(ReplayTurn(len(kept_turns), turn.t, turn.think_time, turn.input_tokens,
                                           turn.hash_ids, prompt, out, turn.agent_id))
            kept_turns.append(turn)
        kept = dataclasses.replace(session, turns=tuple(kept_turns))
        if not replay_turns:
            return None, kept
        return ReplaySession(session.id, session.id, session.block_size, 0.0, prefix, tuple(replay_turns),
                             tuple(agent_timelines(kept))), kept


def load_workload(path: Path | str, *, scale: int, vocab_size: int, context: int, max_tokens: int,
                  sessions: int | None = None, shared_prefix: bool = False,
                  turns: int | None = None) -> ReplayWorkload:
    """Read a weka folder/file or a Mooncake ``.jsonl`` (see the module doc).

    ``sessions`` keeps the first ones; ``turns`` keeps the first N turns of
    every weka session (sub-agent turns among them, in time order) before its
    timelines are built, so the working set is known before a run.
    """
    path = Path(path)
    if scale < 1 or max_tokens < 1:
        raise ValueError(f"scale and max_tokens must be >= 1, got {scale} and {max_tokens}")
    if turns is not None and turns < 1:
        raise ValueError(f"--turns: must be >= 1, got {turns}")
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    builder = _Builder(scale, vocab_size, context, max_tokens)
    if path.suffix == ".jsonl":
        if turns is not None:
            raise ValueError("--turns: a Mooncake trace has one request per line, no sessions to cut")
        return _mooncake(path, builder, sessions)
    files = _weka_files(path)[: sessions if sessions is not None else None]
    replay, kept = [], []
    for file in files:
        session = load_session(file)
        if turns is not None:
            session = dataclasses.replace(session, turns=session.turns[:turns])
        built, trimmed = builder.weka(session, shared_prefix)
        kept.append(trimmed)
        if built is not None:
            replay.append(built)
    return ReplayWorkload("weka", str(path), replay, scale, vocab_size, context, trace_block_bound(kept),
                          len(builder.skipped), builder.skipped)


def _mooncake(path: Path, builder: _Builder, limit: int | None) -> ReplayWorkload:
    requests = load_mooncake(path, limit=limit)
    namespace = f"mooncake:{path.stem}"  # ids are global across the file: one namespace for every request
    start = requests[0].t if requests else 0.0
    replay, kept = [], []
    for request in requests:
        prompt = scaled_prompt_tokens(request.input_tokens, MOONCAKE_BLOCK_SIZE, builder.scale)
        out = turn_max_tokens(request.output_tokens, builder.scale, builder.max_tokens)
        if not builder.keep(f"{path.name}:{request.line}", prompt, out):
            continue
        kept.append(request)
        turn = ReplayTurn(0, 0.0, 0.0, request.input_tokens, request.hash_ids, prompt, out)
        replay.append(ReplaySession(f"{path.stem}-{request.line}", namespace, MOONCAKE_BLOCK_SIZE,
                                    request.t - start, 0, (turn,), (AgentTimeline(None, None, 0.0, 0, (0,)),)))
    return ReplayWorkload("mooncake", str(path), replay, builder.scale, builder.vocab_size, builder.context,
                          mooncake_block_bound(kept), len(builder.skipped), builder.skipped)


def check_device_cache(workload: ReplayWorkload, device_cache_tokens: int, chunk_size: int) -> None:
    """Raise DeviceCacheTooSmall, naming ``--scale`` and ``--device-cache-tokens``, if the longest turn cannot fit.

    A prompt needs ``ceil(tokens / chunk_size)`` device blocks on every stage at
    once; a stage has ``device_cache_tokens // chunk_size`` of them.
    """
    capacity = device_cache_tokens // chunk_size * chunk_size
    longest = workload.longest_prompt
    if longest > capacity:
        raise DeviceCacheTooSmall(
            f"the longest turn is {longest:,} tokens at --scale {workload.scale}, more than the device cache of "
            f"--device-cache-tokens {device_cache_tokens:,} ({capacity:,} tokens in whole {chunk_size}-token "
            f"blocks): raise --device-cache-tokens to at least {-(-longest // chunk_size) * chunk_size:,} or "
            f"raise --scale")
