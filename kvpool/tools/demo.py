"""``kvpool up --demo``: play coding-agent sessions, interleaved, through the OpenAI-compatible HTTP API.

Each turn is a streaming ``/v1/completions`` call with the session's prompt
(token ids from a weka trace file, or the built-in synthetic session shaped
like the real ones; every further session has the same shape and its own
tokens), ``prompt_cache_key`` set to the session, temperature 0. Turns go
round the sessions (A1 B1 A2 B2 ...), and ``up`` sizes each prefill stage's
device cache (``demo_device_cache_tokens``) to hold one session's prompt but
not two: while B's turn runs, A's history leaves the device, and A's next
turn restores it from the pool. Per turn it prints where the prompt's KV came
from (device / pool / computed, from the usage's ``kvpool`` extension) and the
time to first token seen by the client; the summary states what the pool
served and what computing those tokens would have added to TTFT, at the rate
this run's computed turns measured. Think time is not played.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpool.model import get_config
from kvpool.tools.api_key import auth_headers
from kvpool.tools.sse import served_model, stream_events
from kvpool.workload.synthetic import synthetic_session
from kvpool.workload.tokens import session_token_ids
from kvpool.workload.weka import Session, Turn, load_session

DEMO_MAX_TOKENS = 16


@dataclass(slots=True)
class DemoSettings:
    trace: str = ""
    scale: int = 16
    turns: int = 6  # per session
    max_tokens: int = DEMO_MAX_TOKENS
    sessions: int = 2


@dataclass(slots=True)
class TurnFigures:
    session: str
    prompt_tokens: int
    device_tokens: int
    pool_tokens: int
    computed_tokens: int
    output_tokens: int
    ttft_s: float
    finish_reason: str


def default_trace() -> str:
    """A real session when the shared traces lie beside the checkout, else "" (the synthetic session)."""
    from kvpool.tools.bench.prefill_workload import default_traces_dir

    candidate = default_traces_dir() / "trace_0001.json"
    return str(candidate) if candidate.is_file() else ""


def demo_session(settings: DemoSettings) -> Session:
    if settings.trace:
        session = load_session(Path(settings.trace))
        main = tuple(t for t in session.turns if t.agent_id is None)
        return Session(session.id, session.block_size, session.system_tokens, session.tool_tokens,
                       main[: settings.turns])
    return synthetic_session(num_turns=settings.turns)


def demo_sessions(settings: DemoSettings) -> list[Session]:
    """``settings.sessions`` sessions of the demo's shape; each id (and so each one's tokens) its own."""
    session = demo_session(settings)
    return [dataclasses.replace(session, id=f"{session.id}-{chr(ord('A') + i)}") for i in range(settings.sessions)]


def demo_prompts(settings: DemoSettings, vocab_size: int) -> list[tuple[str, Turn, list[int]]]:
    """(session id, turn, prompt) in the order played: round the sessions, turn by turn."""
    sessions = demo_sessions(settings)
    per_session = [list(zip(s.turns, session_token_ids(s, settings.scale, vocab_size))) for s in sessions]
    return [(sessions[k].id, *per_session[k][t]) for t in range(len(per_session[0])) for k in range(len(sessions))]


def demo_device_cache_tokens(settings: DemoSettings, vocab_size: int, chunk_size: int = 256) -> int:
    """A device cache that holds the longest prompt (and one chunk to spare) but not two sessions' histories."""
    longest = max(len(prompt) for _, _, prompt in demo_prompts(settings, vocab_size))
    return (-(-longest // chunk_size) + 1) * chunk_size


async def play_turn(client: httpx.AsyncClient, url: str, model: str, session_key: str, prompt: list[int],
                    max_tokens: int) -> TurnFigures:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "prompt_cache_key": session_key}
    started = time.perf_counter()
    ttft = 0.0
    usage: dict[str, Any] = {}
    finish = ""
    async for event in stream_events(client, url, "/v1/completions", body):
        if event.get("usage"):
            usage = event["usage"]
            continue
        choice = event["choices"][0]
        if not ttft:
            ttft = time.perf_counter() - started
        finish = choice.get("finish_reason") or finish
    ext = usage.get("kvpool", {})
    return TurnFigures(session_key, usage.get("prompt_tokens", len(prompt)), ext.get("device_tokens", 0),
                       ext.get("pool_tokens", 0), ext.get("computed_tokens", 0),
                       usage.get("completion_tokens", 0), ttft, finish)


def run_demo(url: str, settings: DemoSettings) -> int:
    figures = asyncio.run(_play(url, settings))
    for line in summary(figures):
        print(line, flush=True)
    return 0


def summary(figures: list[TurnFigures]) -> list[str]:
    """What the caches served, and what computing the pool's share would have cost at this run's own rate."""
    total = sum(f.prompt_tokens for f in figures)
    device = sum(f.device_tokens for f in figures)
    pool = sum(f.pool_tokens for f in figures)
    computed = sum(f.computed_tokens for f in figures)
    lines = [f"\n{len(figures)} turns, {total} prompt tokens: {(device + pool) / total:.1%} served from cache "
             f"(device {device}, pool {pool}), {computed} computed"]
    # the rate: seconds of TTFT per computed token, over the turns that were mostly computed
    cold = [f for f in figures if f.computed_tokens >= 0.9 * f.prompt_tokens and f.computed_tokens]
    pooled = [f for f in figures if f.pool_tokens]
    if not pooled:
        lines.append("the pool served no turn (every revisit found its history on the device)")
        return lines
    served_s = sum(f.ttft_s for f in pooled)
    line = f"the pool served {pool} prompt tokens over {len(pooled)} turns, whose TTFT summed to {served_s:.1f} s"
    if cold:
        per_token = statistics.median(f.ttft_s / f.computed_tokens for f in cold)
        would_s = served_s + pool * per_token
        line += (f"; computing those tokens instead would have added about {pool * per_token:.1f} s "
                 f"({would_s:.1f} s in all, {would_s / served_s:.1f}x), at the {per_token * 1e6:.0f} µs per computed "
                 f"token this run's {len(cold)} cold turns measured")
    lines.append(line)
    return lines


async def _play(url: str, settings: DemoSettings) -> list[TurnFigures]:
    """Every turn, round the sessions, one row printed as each answers."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), headers=auth_headers()) as client:
        model, _ = await served_model(client, url)
        vocab = get_config(model).vocab_size if model in ("tiny", "dsv3-kv", "dsv3-kv-61") else 1024
        plays = demo_prompts(settings, vocab)
        source = (f"trace {settings.trace}" if settings.trace
                  else "built-in synthetic session shaped like the real traces")
        print(f"\nkvpool demo: {source}")
        print(f"kvpool demo: {settings.sessions} sessions of {len(plays) // settings.sessions} turns, interleaved, at "
              f"token scale {settings.scale} (64-token trace blocks become {max(1, 64 // settings.scale)} tokens), "
              f"model {model}; each revisit finds its history in the pool\n", flush=True)
        print(f"{'session':>12} {'turn':>4} {'prompt':>7} {'device':>7} {'pool':>7} {'computed':>8} {'out':>4} "
              f"{'TTFT ms':>8}", flush=True)
        figures: list[TurnFigures] = []
        for i, (session_id, turn, prompt) in enumerate(plays):
            max_tokens = max(1, min(settings.max_tokens, -(-turn.output_tokens // settings.scale)))
            f = await play_turn(client, url, model, session_id, prompt, max_tokens)
            figures.append(f)
            print(f"{session_id:>12} {i // settings.sessions:>4} {f.prompt_tokens:>7} {f.device_tokens:>7} "
                  f"{f.pool_tokens:>7} {f.computed_tokens:>8} {f.output_tokens:>4} {f.ttft_s * 1e3:>8.0f}", flush=True)
    return figures
