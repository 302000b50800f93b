"""``kvpool bench decode``: decode tokens per second of one shard as concurrency grows.

One real shard process (``kvpool decode``, tiny model by default). Every
prompt's KV is computed in this process with ``InProcessPipeline``, packed
in the handoff region layout (one stage over all layers) and written into a
region the shard reserved, with a real transfer engine (``PromptFiller``; the
integration tests use it too). Then ``c`` greedy Generate streams run at
once, for c in ``--concurrency``; tok/s is the tokens streamed over the time
from the first call to the last token, the median of ``--repeats`` runs. ``batching_gain`` is tok/s at 16 over
tok/s at 1: what sharing each step's weight matmuls buys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvpool import service
from kvpool.core.handoff.layout import HandoffLayout, transfer_plan
from kvpool.handoff import write_slab
from kvpool.tools.cluster import LocalDecode, ServiceFailed
from kvpool.model import InProcessPipeline, get_config, kv_dtype, pack_kv
from kvpool.model.config import ModelConfig
from kvpool.model.sampling import greedy_token
from kvpool.rpc import decode_pb2, decode_pb2_grpc, handoff_pb2
from kvpool.transfer import HostBuffer, TransferEngine

BLOCK_SIZE = 64


@dataclass(slots=True)
class Prepared:
    """A prompt whose KV is in a reserved region: what Generate needs."""

    region_id: str
    prompt_token_ids: list[int]
    first_token: int


class PromptFiller:
    """Prefill in this process and write the KV into a shard's region over the transfer engine."""

    def __init__(self, config: ModelConfig, kv_dtype_name: str = "float32", max_tokens: int = 4096,
                 staging_bytes: int = 64 << 20, engine: TransferEngine | None = None) -> None:
        self.config = config
        self.kv_dtype_name = kv_dtype_name
        num_blocks = -(-max_tokens // BLOCK_SIZE)
        self.pipeline = InProcessPipeline(config, num_blocks, BLOCK_SIZE, kv_dtype(kv_dtype_name))
        self.block_table = list(range(num_blocks))
        self.engine = engine or TransferEngine("127.0.0.1")
        self.staging = HostBuffer(staging_bytes)
        self.engine.register(self.staging.address, staging_bytes)
        self.entry_bytes = config.kv_entry_dim * kv_dtype(kv_dtype_name).itemsize

    def close(self) -> None:
        """Unregister the staging buffer: an engine that outlives us must not keep a freed range."""
        self.engine.unregister(self.staging.address)
        self.staging.close()

    def __enter__(self) -> PromptFiller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prefill(self, prompt_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the prompt's last position and its KV packed in the region layout."""
        prompt = torch.tensor(prompt_token_ids)
        with torch.inference_mode():
            logits = self.pipeline.forward(prompt, self.block_table, 0)
        return logits[-1], pack_kv(self.pipeline.kv_caches[0], self.block_table, 0, len(prompt_token_ids))

    def reserve_request(self, num_tokens: int, max_tokens: int = 0, with_logits: bool = False
                        ) -> decode_pb2.ReserveRequest:
        return decode_pb2.ReserveRequest(
            num_tokens=num_tokens, layer_split=[handoff_pb2.LayerRange(start=0, end=self.config.num_hidden_layers)],
            entry_bytes=self.entry_bytes, kv_dtype=self.kv_dtype_name, max_tokens=max_tokens,
            with_logits=with_logits)

    def write(self, target: handoff_pb2.HandoffTarget, packed: torch.Tensor, logits: torch.Tensor | None = None
              ) -> None:
        """Write packed KV (then the logits, when the region takes them) into the region with the engine."""
        layout = HandoffLayout.of(target.layout.num_tokens, [(r.start, r.end) for r in target.layout.layer_split],
                                  target.layout.entry_bytes, target.layout.trailer_bytes)
        data = packed.view(-1)
        if layout.trailer_bytes and logits is not None:
            data = torch.cat((data, logits.to(torch.float32).contiguous().view(torch.uint8)))
        torch.frombuffer(self.staging.view(0, data.numel()), dtype=torch.uint8).copy_(data)
        transfers = layout.transfers(0) if not layout.trailer_bytes else transfer_plan(layout.nbytes)
        write_slab(self.engine, self.staging.address, target.endpoint, target.address, transfers)

    async def prepare(self, stub: decode_pb2_grpc.DecodeStub, prompt_token_ids: list[int], max_tokens: int = 0,
                      with_logits: bool = False) -> Prepared:
        """Reserve (with ``max_tokens``: the pages too), prefill here, write the region; the first
        token is the prompt's greedy one (with ``with_logits`` decode samples it itself)."""
        logits, packed = self.prefill(prompt_token_ids)
        reply = await stub.Reserve(self.reserve_request(len(prompt_token_ids), max_tokens, with_logits), timeout=30)
        await asyncio.to_thread(self.write, reply.target, packed, logits)
        return Prepared(reply.target.region_id, list(prompt_token_ids), greedy_token(logits, self.config))


def decode_request(prepared: Prepared, max_tokens: int, **sampling: Any) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        region_id=prepared.region_id, prompt_token_ids=prepared.prompt_token_ids,
        first_token=prepared.first_token, max_tokens=max_tokens, sampling=decode_pb2.DecodeSampling(**sampling))


async def _measure(address: str, filler: PromptFiller, concurrency: int, prompt_tokens: int,
                   max_tokens: int) -> dict[str, Any]:
    async with service.channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        generator = torch.Generator().manual_seed(concurrency)
        prepared = []
        for _ in range(concurrency):
            prompt = torch.randint(0, filler.config.vocab_size, (prompt_tokens,), generator=generator).tolist()
            prepared.append(await filler.prepare(stub, prompt))
        peak_pages = 0

        async def one(p: Prepared) -> int:
            tokens = 0
            async for reply in stub.Generate(decode_request(p, max_tokens), timeout=600):
                tokens += reply.HasField("token_id")
            return tokens

        async def watch() -> None:
            nonlocal peak_pages
            while True:
                stats = await stub.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
                peak_pages = max(peak_pages, stats.num_pages_used)
                await asyncio.sleep(0.05)  # sampling the gauge, not standing in for work

        watcher = asyncio.create_task(watch())
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prepared))
        elapsed = time.perf_counter() - started
        watcher.cancel()
        stats = await stub.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
    total = sum(counts)
    if total != concurrency * max_tokens:
        raise RuntimeError(f"expected {concurrency * max_tokens} tokens, got {total}")
    return {"concurrency": concurrency, "tokens": total, "seconds": elapsed, "tok_s": total / elapsed,
            "pages_used_peak": peak_pages, "num_pages": stats.num_pages, "pages_used_after": stats.num_pages_used}


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = get_config(args.model)
    levels = [int(c) for c in str(args.concurrency).split(",") if c]
    shard_args = ["--model", args.model, "--kv-dtype", args.kv_dtype, "--max-batch-size", str(max(levels)),
                  "--log-level", args.log_level]
    filler = PromptFiller(config, args.kv_dtype, max_tokens=args.prompt_tokens)
    rows = []
    with LocalDecode(shard_args) as shard:
        asyncio.run(_measure(shard.address, filler, 1, args.prompt_tokens, 8))  # warm-up, not reported
        for level in levels:
            # this machine is shared and noisy: the median of a few runs per level
            runs = [asyncio.run(_measure(shard.address, filler, level, args.prompt_tokens, args.max_tokens))
                    for _ in range(max(1, args.repeats))]
            rows.append(sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2] | {"repeats": len(runs)})
    by_level = {str(r["concurrency"]): round(r["tok_s"], 1) for r in rows}
    gain = by_level["16"] / by_level["1"] if "16" in by_level and "1" in by_level else None
    return {"bench": "decode", "model": args.model, "kv_dtype": args.kv_dtype, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "runs": rows, "tok_s_by_concurrency": by_level,
            "batching_gain": None if gain is None else round(gain, 2)}


def main(args: argparse.Namespace) -> int:
    """``kvpool bench decode``: a table, and with ``--json`` one JSON object as the last line."""
    try:
        summary = run(args)
    except (ServiceFailed, ValueError) as exc:
        raise SystemExit(f"kvpool bench decode: {exc}") from None
    print(f"decode bench: model {summary['model']}, kv {summary['kv_dtype']}, prompt {summary['prompt_tokens']} "
          f"tokens, {summary['max_tokens']} tokens each")
    print(f"{'concurrency':>11} {'tok/s':>9} {'seconds':>8} {'peak pages':>11}")
    for row in summary["runs"]:
        print(f"{row['concurrency']:>11} {row['tok_s']:>9.1f} {row['seconds']:>8.2f} "
              f"{row['pages_used_peak']:>5}/{row['num_pages']}")
    print(f"batching gain (16 vs 1): {summary['batching_gain']}")
    if args.json:
        print(json.dumps(summary))
    return 0
