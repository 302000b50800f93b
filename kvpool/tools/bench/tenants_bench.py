"""``kvpool bench tenants``: one tenant's flood against another tenant's small turns, fair and FIFO side by side.

Each side is a whole cluster started by this checkout's ``kvpool up`` on its
defaults, with an API keys file of two tenants (``victim`` and ``flooder``);
the ``fifo`` side adds only a settings file whose ``[router]`` and
``[prefill]`` tables set ``tenant_fair = false`` (tenants in arrival order,
as before fair sharing), the ``fair`` side runs the defaults. The sides run
one after the other, so neither competes with the other for this host's
cores. On each side, through the router's streaming HTTP API with each
tenant's own key:

- ``victim alone``: tenant A sends ``--victim-turns`` small turns, a fresh
  prompt of ``--victim-tokens`` tokens each (``max_tokens`` 1), one every
  ``1 / --victim-rate`` seconds, open loop (a turn is sent on time whether
  or not the one before has ended): half before the flood, half after;
- ``--flood-prompts`` pairs of rounds in between: tenant B sends
  ``--flood-concurrency`` fresh prompts of ``--flood-tokens`` tokens at once
  (``max_tokens`` 1) alone, then as many again with A's turns going on
  during them (from ``--victim-delay-s`` after the round's start until it
  ends). Alone and during alternate, so a change in the host's load (it is
  shared) meets both alike; B's throughput is prompt tokens over the rounds'
  seconds, each from its sends to its last answer.

Keys: ``victim_ttft_p50_over_alone`` and ``..._p99_...`` (the victim's
time to first token during the flood over alone, fair side),
``victim_ttft_p50_over_alone_fifo`` and ``..._p99_..._fifo`` (the same on
the FIFO side, over its own alone), ``fair_p50_gain_over_fifo`` (FIFO's p50
during the flood over fair's), ``flooder_throughput_over_alone`` (B's
during over alone, fair side; ``..._fifo``, FIFO side), ``errors``
(requests that failed, both sides). Every time is the
client's clock: from the POST to the first streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvpool.model import get_config
from kvpool.tools.api_key import auth_headers
from kvpool.tools.bench.ab_bench import Side, current_commit
from kvpool.tools.bench.stats import percentile
from kvpool.tools.sse import StreamError, stream_events

TENANTS = {"victim": "victim-key-0123456789abcdef", "flooder": "flooder-key-0123456789abcdef"}
UP_ARGS = ["--log-level", "warning"]
FIFO_CONFIG = "[router]\ntenant_fair = false\n\n[prefill]\ntenant_fair = false\n"


class Client:
    """One tenant's HTTP client of a side's router, and what its requests saw."""

    def __init__(self, side: Side, tenant: str, vocab: int, seed: int) -> None:
        self.url = f"http://127.0.0.1:{side.http_port}"
        self.http = httpx.AsyncClient(headers=auth_headers(TENANTS[tenant]), timeout=httpx.Timeout(900.0),
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.errors: list[str] = []

    async def close(self) -> None:
        await self.http.aclose()

    def prompt(self, num_tokens: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(num_tokens)]

    async def turn(self, num_tokens: int) -> dict[str, float] | None:
        """One fresh prompt, one token: its TTFT and the router's queue time; None when it failed."""
        body = {"model": "tiny", "prompt": self.prompt(num_tokens), "max_tokens": 1, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        ttft = 0.0
        usage: dict[str, Any] = {}
        try:
            async for event in stream_events(self.http, self.url, "/v1/completions", body):
                if event.get("choices") and not ttft:
                    ttft = time.perf_counter() - started
                if event.get("usage"):
                    usage = event["usage"]
        except (StreamError, httpx.HTTPError) as exc:
            self.errors.append(str(exc)[:200])
            return None
        if not ttft or not usage:
            self.errors.append("no token or no usage")
            return None
        return {"ttft_s": ttft, "queued_s": float(usage.get("kvpool", {}).get("queued_seconds", 0.0))}


async def victim_turns(client: Client, tokens: int, rate: float, turns: int,
                       until: asyncio.Future[None] | None = None) -> list[dict[str, float]]:
    """Open loop: a turn every 1/rate s, ``turns`` of them, and (``until``) on until it is done."""
    tasks: list[asyncio.Task[dict[str, float] | None]] = []
    start = time.perf_counter()
    i = 0
    while i < turns or (until is not None and not until.done()):
        delay = start + i / rate - time.perf_counter()
        if delay > 0 and until is not None and i >= turns:
            await asyncio.wait([until], timeout=delay)  # the next send time, or the flood's end first
            if until.done():
                break
        elif delay > 0:
            await asyncio.sleep(delay)  # the turn's send time (the workload's rate), not work
        tasks.append(asyncio.ensure_future(client.turn(tokens)))
        i += 1
    return [r for r in await asyncio.gather(*tasks) if r is not None]


async def flood_round(client: Client, tokens: int, concurrency: int) -> tuple[float, int]:
    """``concurrency`` fresh prompts at once: the seconds until the last answered, and how many did."""
    started = time.perf_counter()
    got = await asyncio.gather(*(client.turn(tokens) for _ in range(concurrency)))
    return time.perf_counter() - started, sum(g is not None for g in got)


def throughput(rounds: list[tuple[float, int]], tokens: int) -> dict[str, float]:
    seconds = math.fsum(s for s, _ in rounds)
    done = sum(d for _, d in rounds)
    return {"rounds": len(rounds), "seconds": round(seconds, 2), "prompts_done": done,
            "tokens_per_s": round(done * tokens / seconds, 1) if seconds else 0.0}


def summary(results: list[dict[str, float]]) -> dict[str, float]:
    ttfts = [r["ttft_s"] for r in results]
    return {"turns": len(ttfts), "ttft_ms_p50": round(percentile(ttfts, 50) * 1e3, 1),
            "ttft_ms_p99": round(percentile(ttfts, 99) * 1e3, 1),
            "queued_ms_p50": round(percentile([r["queued_s"] for r in results], 50) * 1e3, 1)}


async def run_side(side: Side, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The victim alone (half its turns before the flood, half after), then ``--flood-prompts`` rounds of
    ``--flood-concurrency`` prompts with the victim's turns during each, every one after a round of the flood
    alone: alone and during alternate, so a change in the host's load meets both alike."""
    victim, flooder = Client(side, "victim", vocab, 1), Client(side, "flooder", vocab, 2)
    tokens, rate = args.victim_tokens, args.victim_rate
    out: dict[str, Any] = {}
    try:
        await victim_turns(victim, tokens, rate, 3)  # warm-up: not counted (its errors are)
        alone = await victim_turns(victim, tokens, rate, args.victim_turns // 2)
        flood_alone: list[tuple[float, int]] = []
        flood_during: list[tuple[float, int]] = []
        during: list[dict[str, float]] = []
        for _ in range(args.flood_prompts):
            flood_alone.append(await flood_round(flooder, args.flood_tokens, args.flood_concurrency))
            flooding = asyncio.ensure_future(flood_round(flooder, args.flood_tokens, args.flood_concurrency))
            await asyncio.wait([flooding], timeout=args.victim_delay_s)  # the flood reaches the cluster first
            during += await victim_turns(victim, tokens, rate, 1, flooding)
            flood_during.append(await flooding)
        alone += await victim_turns(victim, tokens, rate, args.victim_turns - args.victim_turns // 2)
        out["victim_alone"] = summary(alone)
        out["victim_flood"] = summary(during)
        out["flooder_alone"] = throughput(flood_alone, args.flood_tokens)
        out["flood"] = throughput(flood_during, args.flood_tokens)
        out["errors"] = len(victim.errors) + len(flooder.errors)
        out["errors_by_tenant"] = {"victim": len(victim.errors), "flooder": len(flooder.errors)}
        out["error_samples"] = sorted({e[:120] for e in victim.errors + flooder.errors})[:4]
    finally:
        await victim.close()
        await flooder.close()
    return out


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def main(args: argparse.Namespace) -> int:
    vocab = get_config("tiny").vocab_size
    sides = [s for s in args.sides.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-tenants-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        keys = workdir / "api_keys"
        keys.write_text("".join(f"{t}={k}\n" for t, k in TENANTS.items()))
        keys.chmod(0o600)
        (workdir / "fifo.toml").write_text(FIFO_CONFIG)
        got: dict[str, dict[str, Any]] = {}
        for name in sides:
            up_args = [*UP_ARGS, "--api-keys-file", str(keys)]
            if name == "fifo":
                up_args += ["--config", str(workdir / "fifo.toml")]
            side = Side(name, None, workdir, up_args)
            try:
                side.wait_ready()
                got[name] = asyncio.run(run_side(side, args, vocab))
            finally:
                side.stop()
    result: dict[str, Any] = {}
    fair, fifo = got.get("fair"), got.get("fifo")
    if fair is not None:
        alone, during = fair["victim_alone"], fair["victim_flood"]
        result["victim_ttft_p50_over_alone"] = ratio(during["ttft_ms_p50"], alone["ttft_ms_p50"])
        result["victim_ttft_p99_over_alone"] = ratio(during["ttft_ms_p99"], alone["ttft_ms_p99"])
        result["flooder_throughput_over_alone"] = ratio(fair["flood"]["tokens_per_s"],
                                                        fair["flooder_alone"]["tokens_per_s"])
    if fifo is not None:
        alone, during = fifo["victim_alone"], fifo["victim_flood"]
        result["victim_ttft_p50_over_alone_fifo"] = ratio(during["ttft_ms_p50"], alone["ttft_ms_p50"])
        result["victim_ttft_p99_over_alone_fifo"] = ratio(during["ttft_ms_p99"], alone["ttft_ms_p99"])
        result["flooder_throughput_over_alone_fifo"] = ratio(fifo["flood"]["tokens_per_s"],
                                                             fifo["flooder_alone"]["tokens_per_s"])
    if fair is not None and fifo is not None:
        result["fair_p50_gain_over_fifo"] = ratio(fifo["victim_flood"]["ttft_ms_p50"],
                                                  fair["victim_flood"]["ttft_ms_p50"])
    result["errors"] = sum(g["errors"] for g in got.values())
    result["sides"] = got
    result |= {"flood_prompts": args.flood_prompts, "flood_tokens": args.flood_tokens,
               "flood_concurrency": args.flood_concurrency, "victim_tokens": args.victim_tokens,
               "victim_rate": args.victim_rate, "commit": current_commit(),
               "load_1m_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(result, default=str) if args.json else json.dumps(result, indent=1, default=str))
    return 0 if result["errors"] == 0 else 1
