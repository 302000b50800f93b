"""``kvpool up --demo``: play one coding-agent session turn by turn through the OpenAI-compatible HTTP API.

Each turn is a streaming ``/v1/completions`` call with the session's prompt
(token ids from a weka trace file, or the built-in synthetic session shaped
like the real ones), ``prompt_cache_key`` set to the session, temperature 0.
Per turn it prints where the prompt's KV came from (device / pool / computed,
from the usage's ``kvpool`` extension) and the time to first token seen by the
client; then a summary. Think time is not played (the demo is about reuse).
"""

from __future__ import annotations

import asyncio
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
from kvpool.workload.weka import Session, load_session

DEMO_MAX_TOKENS = 16


@dataclass(slots=True)
class DemoSettings:
    trace: str = ""
    scale: int = 16
    turns: int = 12
    max_tokens: int = DEMO_MAX_TOKENS


@dataclass(slots=True)
class TurnFigures:
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
    return TurnFigures(usage.get("prompt_tokens", len(prompt)), ext.get("device_tokens", 0),
                       ext.get("pool_tokens", 0), ext.get("computed_tokens", 0),
                       usage.get("completion_tokens", 0), ttft, finish)


def run_demo(url: str, settings: DemoSettings) -> int:
    figures = asyncio.run(_play(url, settings))
    total = sum(f.prompt_tokens for f in figures)
    cached = sum(f.device_tokens + f.pool_tokens for f in figures)
    later = figures[1:] or figures
    print(f"\n{len(figures)} turns, {total} prompt tokens: {cached / total:.1%} served from cache "
          f"(device {sum(f.device_tokens for f in figures)}, pool {sum(f.pool_tokens for f in figures)}), "
          f"{sum(f.computed_tokens for f in figures)} computed", flush=True)
    print(f"TTFT: first turn {figures[0].ttft_s * 1e3:.0f} ms (all computed), later turns median "
          f"{statistics.median(f.ttft_s for f in later) * 1e3:.0f} ms", flush=True)
    return 0


async def _play(url: str, settings: DemoSettings) -> list[TurnFigures]:
    """Every turn in order, one row printed as each answers."""
    session = demo_session(settings)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), headers=auth_headers()) as client:
        model, _ = await served_model(client, url)
        vocab = get_config(model).vocab_size if model in ("tiny", "dsv3-kv", "dsv3-kv-61") else 1024
        prompts = list(session_token_ids(session, settings.scale, vocab))
        source = (f"trace {settings.trace}" if settings.trace
                  else "built-in synthetic session shaped like the real traces")
        print(f"\nkvpool demo: {source}")
        print(f"kvpool demo: session {session.id!r}, {len(prompts)} turns at token scale {settings.scale} "
              f"(64-token trace blocks become {max(1, 64 // settings.scale)} tokens), model {model}\n", flush=True)
        print(f"{'turn':>4} {'prompt':>7} {'device':>7} {'pool':>7} {'computed':>8} {'out':>4} {'TTFT ms':>8}",
              flush=True)
        figures: list[TurnFigures] = []
        for i, (turn, prompt) in enumerate(zip(session.turns, prompts)):
            max_tokens = max(1, min(settings.max_tokens, -(-turn.output_tokens // settings.scale)))
            f = await play_turn(client, url, model, session.id, prompt, max_tokens)
            figures.append(f)
            print(f"{i:>4} {f.prompt_tokens:>7} {f.device_tokens:>7} {f.pool_tokens:>7} {f.computed_tokens:>8} "
                  f"{f.output_tokens:>4} {f.ttft_s * 1e3:>8.0f}", flush=True)
    return figures
