"""``kvpool bench path``'s cases: the handoff streamed during prefill against the handoff after it, and the
stages overlapping on the forward's pieces against the stages one after another.

One cluster (a 4-stage prefill pipeline per mode, each started with that mode's
``--bench-forward``, 1 decode shard, no pool: warm turns hit the device cache) at
``dsv3-kv-lean`` with float8 KV: dsv3-kv's KV bytes per
token (8 layers × 576 bytes), with one narrow attention head so a 16K-token
prefill fits a CPU (see docs/benchmarks.md). Three cases, each request run
in every mode of ``--handoff`` side by side (alternating; ``MODE_SETS``):

- ``4k_cold`` and ``16k_cold``: fresh random prompts;
- ``16k_warm``: the last 16K cold prompt's first 61 chunks (95.3%) and a
  fresh tail, so the prefix is a device hit and only the tail is computed.

Each request's prompt runs once in each mode, each mode on its own pipeline
(no cache shared between modes), so both modes do the same work; their greedy tokens must be
identical (``greedy_identical``). The two runs of a prompt are a pair, run back
to back, the mode going first alternating: a prompt's compute varies by ±25%
on a shared host, more than the handoff, so beside each mode's p50 every case
reports the median of the per-pair ratios push / after-prefill
(``pair_ratio_p50``), which compares the modes on the same prompt at about the
same load, and the host's 1-minute load average at each pair's start.

The bench plays the router's part itself (decode ``Reserve`` → stage 0
``Prefill(target)`` → decode ``Generate``) so it can read every stage's
handoff figures. Per request: ``ttft_ms`` and ``second_token_ms`` from the
Reserve to the first and second token; for push, ``handoff_exposed_ms``,
from the last stage's forward end to decode's first token, and
``handoff_total_ms``, every stage's gathers, writes and decode's scatters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from kvpool import service
from kvpool.model import get_config
from kvpool.model.config import split_layers
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2, prefill_pb2, prefill_pb2_grpc
from kvpool.tools.cluster import LocalDecode, LocalPipeline

MODEL = "dsv3-kv-lean"
KV_DTYPE = "float8_e4m3fn"
STAGES = 4
CHUNK = 256
WARM_CHUNKS = 61  # of 64: 95.3% of a 16K prompt cached
MODES = ("push", "after_prefill")
# --handoff: which modes run side by side. push is the service's path (the handoff streamed, the stages
# overlapping on the forward's pieces); after_prefill writes the handoff after the last stage's forward;
# after_stage streams the handoff but passes each stage's request on whole (the stages one after another)
MODE_SETS = {"both": MODES, "pieces": ("push", "after_stage"), "all": ("push", "after_prefill", "after_stage"),
             "push": ("push",), "after-prefill": ("after_prefill",), "after-stage": ("after_stage",)}


def _ms(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


# each mode's pipeline runs with this --bench-forward (the baselines are a stage setting, not a request's)
BENCH_FORWARD = {"push": "streamed", "after_prefill": "handoff-after-prefill", "after_stage": "stages-in-turn"}


class CaseClient:
    """The router's calls for one request, with the figures the router does not keep: each mode's pipeline,
    and the one decode shard."""

    def __init__(self, prefill_addresses: dict[str, str], decode_address: str) -> None:
        self.prefill_channels = {m: service.channel(a) for m, a in prefill_addresses.items()}
        self.decode_channel = service.channel(decode_address)
        self.prefill = {m: prefill_pb2_grpc.PrefillStub(c) for m, c in self.prefill_channels.items()}
        self.decode = decode_pb2_grpc.DecodeStub(self.decode_channel)
        config = get_config(MODEL)
        self.split = split_layers(config.num_hidden_layers, STAGES)
        self.entry_bytes = config.kv_entry_dim  # float8: one byte a value

    async def close(self) -> None:
        for channel in self.prefill_channels.values():
            await channel.close()
        await self.decode_channel.close()

    async def run(self, token_ids: list[int], mode: str) -> dict[str, Any]:
        started = time.perf_counter()
        reserve = decode_pb2.ReserveRequest(
            num_tokens=len(token_ids), kv_dtype=KV_DTYPE, entry_bytes=self.entry_bytes, max_tokens=2,
            with_logits=True, hold_s=600, layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in self.split])
        target = (await self.decode.Reserve(reserve, timeout=60)).target
        done = await self.prefill[mode].Prefill(prefill_pb2.PrefillRequest(
            token_ids=token_ids, session_key="bench-path", target=target), timeout=900)
        call = self.decode.Generate(decode_pb2.DecodeRequest(
            region_id=target.region_id, prompt_token_ids=token_ids, max_tokens=2,
            sampling=decode_pb2.DecodeSampling(temperature=0)), timeout=120)
        tokens, times, figures = [], [], None
        async for response in call:
            if response.HasField("figures"):
                figures = response.figures
            else:
                tokens.append(response.token_id)
                times.append(time.perf_counter())
        stages = done.handoff.stages
        forward_end = max(s.forward_end_unix_ms for s in stages)
        assert figures is not None
        return {
            "tokens": tokens,
            "ttft_ms": (times[0] - started) * 1e3,
            "second_token_ms": (times[1] - started) * 1e3 if len(times) > 1 else None,
            "handoff_exposed_ms": figures.first_token_unix_ms - forward_end,
            "handoff_total_ms": 1e3 * (sum(s.gather_seconds + s.write_seconds + s.scatter_seconds for s in stages)
                                       + figures.scatter_seconds),
            "writes": done.handoff.transfers, "bytes": done.handoff.bytes,
            "computed_tokens": done.figures.num_computed_tokens,
            "per_stage": [{"stage": s.stage, "ranges": s.ranges, "writes": s.transfers, "bytes": s.bytes,
                           "gather_ms": round(s.gather_seconds * 1e3, 2), "write_ms": round(s.write_seconds * 1e3, 2),
                           "scatter_ms": round(s.scatter_seconds * 1e3, 2),
                           "after_forward_ms": round(s.last_write_end_unix_ms - forward_end, 2)} for s in stages],
        }


async def _run_cases(client: CaseClient, reps: dict[str, int], vocab: int, modes: tuple[str, ...]) -> dict[str, Any]:
    rng = random.Random(17)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    cases: dict[str, Any] = {}
    last_cold: list[int] = []
    errors = identical = compared = 0
    for name, length, warm in (("4k_cold", 4096, False), ("16k_cold", 16384, False), ("16k_warm", 16384, True)):
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        pairs: list[dict[str, dict[str, Any]]] = []  # per prompt: each mode's run, when both ran
        loads: list[float] = []
        for i in range(reps[name]):
            loads.append(round(os.getloadavg()[0], 2))
            # the same prompt in every mode, each mode its own pipeline: the same work, no shared cache
            prompt = last_cold[: WARM_CHUNKS * CHUNK] + fresh(length - WARM_CHUNKS * CHUNK) if warm else fresh(length)
            tokens = {}
            pair: dict[str, dict[str, Any]] = {}
            for m in (modes if i % 2 == 0 else modes[::-1]):  # alternate which mode goes first
                try:
                    run = await client.run(prompt, m)
                    runs[m].append(run)
                    tokens[m] = run["tokens"]
                    pair[m] = run
                except (grpc.aio.AioRpcError, AssertionError) as exc:
                    errors += 1
                    runs[m].append({"error": str(exc)})
            if not warm:
                last_cold = prompt
            if len(pair) == len(modes) > 1:
                pairs.append(pair)
            if len(tokens) == len(modes) > 1:
                compared += 1
                identical += len({tuple(t) for t in tokens.values()}) == 1
        ok = {m: [r for r in runs[m] if "error" not in r] for m in modes}
        cases[name] = {
            "prompt_tokens": length, "requests_per_mode": reps[name],
            **{m: {"ttft_ms_p50": _ms([r["ttft_ms"] for r in ok[m]]),
                   "second_token_ms_p50": _ms([r["second_token_ms"] for r in ok[m] if r["second_token_ms"]]),
                   "handoff_exposed_ms_p50": _ms([r["handoff_exposed_ms"] for r in ok[m]]),
                   "handoff_total_ms_p50": _ms([r["handoff_total_ms"] for r in ok[m]]),
                   "computed_tokens": [r["computed_tokens"] for r in ok[m]],
                   "ttft_ms": [round(r["ttft_ms"], 1) for r in runs[m] if "error" not in r],
                   "second_token_ms": [round(r["second_token_ms"] or 0, 1) for r in ok[m]]} for m in modes},
        }
        push = ok.get("push", [])
        cases[name] |= {
            "handoff_exposed_ms_p50": _ms([r["handoff_exposed_ms"] for r in push]),
            "handoff_total_ms_p50": _ms([r["handoff_total_ms"] for r in push]),
            "push_writes": push[0]["writes"] if push else None,
            "push_bytes": push[0]["bytes"] if push else None,
            "push_per_stage": push[-1]["per_stage"] if push else None,
            "pairs": len(pairs),
            "pair_ratio_p50": _pair_ratios(pairs),
            "pair_ratio_after_stage_p50": _pair_ratios(pairs, "after_stage"),
            "load_1m": loads,
        }
    cases["errors"] = errors
    # greedy (temperature 0) first and second tokens of the same prompt, push against after-prefill
    cases["greedy_identical"] = f"{identical}/{compared}"
    return cases


def _pair_ratios(pairs: list[dict[str, dict[str, Any]]], base: str = "after_prefill") -> dict[str, float | None]:
    """Median over the pairs of push's figure over ``base``'s, for the same prompt."""
    out: dict[str, float | None] = {}
    for key in ("ttft_ms", "second_token_ms"):
        ratios = [p["push"][key] / p[base][key] for p in pairs
                  if p.get("push", {}).get(key) and p.get(base, {}).get(key)]
        out[key] = round(statistics.median(ratios), 4) if ratios else None
    return out


def check(cases: dict[str, Any]) -> dict[str, bool]:
    """The targets, each by name."""
    out: dict[str, bool] = {"errors_zero": cases.get("errors") == 0}
    identical, _, compared = str(cases.get("greedy_identical", "0/0")).partition("/")
    if int(compared):
        out["greedy_identical"] = identical == compared
    cold = cases.get("16k_cold", {})
    if cold.get("handoff_exposed_ms_p50") is not None and cold.get("handoff_total_ms_p50"):
        out["16k_cold_exposed_le_0.4_total"] = cold["handoff_exposed_ms_p50"] <= 0.4 * cold["handoff_total_ms_p50"]
    for name in ("4k_cold", "16k_cold", "16k_warm"):
        case = cases.get(name)
        if not case or "push" not in case:
            continue
        for base, label in (("after_prefill", "after"), ("after_stage", "after_stage")):
            if base not in case:
                continue
            for key in ("ttft_ms_p50", "second_token_ms_p50"):
                push, after = case["push"][key], case[base][key]
                if push is not None and after is not None:
                    out[f"{name}_{key}_push_le_{label}_x1.05"] = push <= after * 1.05
    return out


def run_cases(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start the cases' cluster, run every case in both modes, stop it."""
    modes = MODE_SETS[args.handoff]
    reps = {"4k_cold": args.case_requests, "16k_cold": max(1, args.case_requests - 1),
            "16k_warm": args.case_requests}
    workdir.mkdir(parents=True, exist_ok=True)
    model = ["--model", MODEL, "--kv-dtype", KV_DTYPE]
    with contextlib.ExitStack() as parts:
        # one pipeline per mode, each started with its --bench-forward, and one decode shard for all
        pipelines = {m: parts.enter_context(LocalPipeline(
            num_stages=STAGES, workdir=workdir / f"pipeline-{m}",
            stage_args=[*model, "--device-cache-tokens", str(4 * 16384), "--bench-forward", BENCH_FORWARD[m]]))
            for m in modes}
        shard = parts.enter_context(LocalDecode([*model, "--region-arena-bytes", "160MiB"], workdir=workdir / "decode"))

        async def go() -> dict[str, Any]:
            client = CaseClient({m: p.address for m, p in pipelines.items()}, shard.address)  # this loop's channels
            try:
                return await _run_cases(client, reps, get_config(MODEL).vocab_size, modes)
            finally:
                await client.close()

        cases = asyncio.run(go())
    cases["model"], cases["kv_dtype"], cases["stages"], cases["decode_shards"] = MODEL, KV_DTYPE, STAGES, 1
    cases["targets"] = check(cases)
    return cases
