"""The prefill benchmark's workload: its settings, and weka sessions turned into prompts.

The first ``sessions`` traces, their first ``turns`` turns each, become token
ids at ``scale`` (deterministic, see ``kvpool.workload.tokens``); a turn that
cannot fit the device cache or the model's context is skipped and named.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import kvpool
from kvpool.workload import Session, load_sessions, turn_token_ids

CHUNK_SIZE = 256  # the system's chunk size (the stages' default)
NUM_STAGES = 4
MODEL = "tiny"
KV_DTYPE = "float32"  # the logits are compared with a float32 computation from scratch

# defaults: a few minutes on a 2-core host; --quick: well under three minutes for both passes
DEFAULTS = {"sessions": 4, "turns": 10, "scale": 16, "concurrency": 4, "device_cache_tokens": 8192}
QUICK = {"sessions": 4, "turns": 8, "scale": 32, "concurrency": 4, "device_cache_tokens": 4096}


class TracesMissing(FileNotFoundError):
    """The weka traces directory is not there."""


def default_traces_dir() -> Path:
    """``<repo>/../shared/traces/agentx-weka``: the shared traces next to the checkout."""
    return Path(kvpool.__file__).resolve().parents[1].parent / "shared" / "traces" / "agentx-weka"


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """What one run replays and on which cluster."""

    traces: Path
    sessions: int
    turns: int
    scale: int
    concurrency: int
    device_cache_tokens: int
    chunk_size: int = CHUNK_SIZE
    num_stages: int = NUM_STAGES
    model: str = MODEL
    kv_dtype: str = KV_DTYPE

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "scale", "concurrency", "device_cache_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Flags over the defaults (``--quick`` picks the small defaults)."""
    base = QUICK if getattr(args, "quick", False) else DEFAULTS
    values = {name: default if getattr(args, name, None) is None else getattr(args, name)
              for name, default in base.items()}
    traces = Path(args.traces) if getattr(args, "traces", None) else default_traces_dir()
    return BenchSettings(traces=traces, **values)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One turn to send: its session, its place in the session, its token ids."""

    session_id: str
    turn_index: int
    token_ids: tuple[int, ...]
    is_last: bool = False


@dataclass(slots=True)
class Workload:
    """The prompts of every session in turn order, and what was left out."""

    sessions: list[list[Prompt]]
    traces: list[Session]  # the sessions cut to the turns actually sent
    num_turns_skipped: int
    skipped_reasons: list[str]

    @property
    def prompts(self) -> list[Prompt]:
        return [p for session in self.sessions for p in session]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def working_set_tokens(self) -> int:
        """Sum over sessions of the longest prompt: the KV the sessions' histories need at once."""
        return sum(max((len(p.token_ids) for p in s), default=0) for s in self.sessions)


def _max_prompt_tokens(settings: BenchSettings) -> tuple[int, int]:
    """(device cache tokens in whole blocks, the model's context)."""
    from kvpool.model import get_config

    blocks = settings.device_cache_tokens // settings.chunk_size
    return blocks * settings.chunk_size, get_config(settings.model).max_position_embeddings


def build_workload(settings: BenchSettings) -> Workload:
    """Load the sessions, cut them to ``turns`` turns, make token ids, skip prompts that cannot fit."""
    if not settings.traces.is_dir():
        raise TracesMissing(f"traces directory {settings.traces} not found (pass --traces DIR: the weka "
                            "traces, e.g. ../shared/traces/agentx-weka)")
    from kvpool.model import get_config

    vocab = get_config(settings.model).vocab_size
    device_tokens, context = _max_prompt_tokens(settings)
    loaded = load_sessions(settings.traces, limit=settings.sessions)
    if not loaded:
        raise TracesMissing(f"no trace_*.json files in {settings.traces}")
    sessions: list[list[Prompt]] = []
    traces: list[Session] = []
    skipped: list[str] = []
    for session in loaded:
        prompts, kept = [], []
        for index, turn in enumerate(session.turns[: settings.turns]):
            ids = turn_token_ids(session.id, turn.hash_ids, turn.input_tokens, session.block_size,
                                 settings.scale, vocab)
            if len(ids) > min(device_tokens, context):
                skipped.append(f"{session.id} turn {index}: {len(ids)} tokens > device cache {device_tokens} "
                               f"/ context {context}")
                continue
            prompts.append(Prompt(session.id, index, tuple(ids)))
            kept.append(turn)
        if prompts:
            prompts[-1] = dataclasses.replace(prompts[-1], is_last=True)
            sessions.append(prompts)
            traces.append(dataclasses.replace(session, turns=tuple(kept)))
    return Workload(sessions, traces, len(skipped), skipped)
