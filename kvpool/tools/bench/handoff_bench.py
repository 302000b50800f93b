"""``kvpool bench handoff``: gathered vs per-token-per-layer prefill → decode handoff.

Two real processes on this host, each with its own transfer engine (TCP):
a sender holding one prefill stage's paged KV (the model's own cache
layout, DeepSeek-V3's fp8 entry shape; the request's tokens are seeded
random bytes in blocks scattered over twice as many) and this process as the receiver, with decode's
token-major pages (``[pages, page_size, layers, entry]``, the request's pages
scattered too) and a receive region, all registered.

- naive: the sender writes every (layer, token) entry straight from its page
  slot to decode's page slot, ``entry_bytes`` per write, in batches of 1,024;
- gathered: the sender packs the request into one registered slab, writes it
  in the layout's transfers (at most 8 MiB) into the region, and the receiver
  scatters the region into its pages. Seconds = gather + write + scatter.

Before each run the pages are zeroed; after it, every entry of the request in
decode's pages must equal the sender's (regenerated here from the same seed),
byte for byte, or the run fails. The gathered path runs once to warm up, then
``repeats`` times; its median counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch

from kvpool.core.handoff.layout import HandoffLayout, num_naive_writes
from kvpool.handoff import (
    gather_stage,
    scatter_region,
    token_major_destinations,
    write_naive,
    write_slab,
)
from kvpool.model import ModelConfig, allocate_kv_cache, get_config, unpack_kv
from kvpool.model.kv_cache import token_slots
from kvpool.transfer import HostBuffer, TransferEngine

BLOCK_SIZE = 256  # prefill: tokens per device block (the chunk size)
PAGE_SIZE = 16  # decode: tokens per page
KV_DTYPE = torch.float8_e4m3fn  # DeepSeek-V3's KV: one byte per value, 576 per entry
READY_TIMEOUT_S = 60.0


class BenchError(RuntimeError):
    """The sender failed, or bytes arrived wrong."""


@dataclass(frozen=True, slots=True)
class HandoffSpec:
    """One run's shape; both processes derive the same pages and tables from it."""

    tokens: int = 8192
    layers: int = 20
    entry_bytes: int = 576
    repeats: int = 3
    seed: int = 0
    threads: int = 1  # torch threads on each side, as a prefill stage runs by default

    @property
    def layout(self) -> HandoffLayout:
        return HandoffLayout.of(self.tokens, [(0, self.layers)], self.entry_bytes)


def entry_config(spec: HandoffSpec) -> ModelConfig:
    """DeepSeek-V3's KV shape (a latent, then a 64-value roped key) with entries of ``entry_bytes`` fp8 values."""
    base = get_config("dsv3-kv")
    if spec.entry_bytes <= base.qk_rope_head_dim:
        raise ValueError(f"--entry-bytes: must exceed the {base.qk_rope_head_dim}-value roped key")
    return dataclasses.replace(base, kv_lora_rank=spec.entry_bytes - base.qk_rope_head_dim)


def sent_kv(spec: HandoffSpec) -> torch.Tensor:
    """The request's KV as the region lays it out, ``[layers, tokens, entry bytes]``: seeded random bytes.

    Both processes derive it from ``spec``: the sender puts it in its pages,
    the receiver checks decode's pages against it.
    """
    generator = torch.Generator().manual_seed(spec.seed)
    return torch.randint(0, 256, (spec.layers, spec.tokens, spec.entry_bytes), dtype=torch.uint8, generator=generator)


def prefill_block_table(spec: HandoffSpec) -> tuple[int, torch.Tensor]:
    """The stage's block count and the request's blocks, scattered over them."""
    needed = -(-spec.tokens // BLOCK_SIZE)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    return 2 * needed, torch.randperm(2 * needed, generator=generator)[:needed]


def decode_page_ids(spec: HandoffSpec) -> tuple[int, torch.Tensor]:
    """Decode's page count and the request's pages, scattered over them."""
    needed = -(-spec.tokens // PAGE_SIZE)
    generator = torch.Generator().manual_seed(spec.seed + 2)
    return 2 * needed, torch.randperm(2 * needed, generator=generator)[:needed]


def _registered(engine: TransferEngine, nbytes: int) -> tuple[HostBuffer, torch.Tensor]:
    buffer = HostBuffer(nbytes)
    buffer.touch()
    engine.register(buffer.address, nbytes)
    return buffer, torch.frombuffer(buffer.view(), dtype=torch.uint8)


# ---- sender (worker process) ----------------------------------------------


def sender(spec: HandoffSpec) -> None:
    """Serve commands (one JSON object per stdin line), answer one JSON object per stdout line."""
    torch.set_num_threads(spec.threads)
    engine = TransferEngine()
    layout = spec.layout
    num_blocks, block_table = prefill_block_table(spec)
    # the stage's pages in whatever layout the model keeps them; registered for the naive path's reads
    cache = allocate_kv_cache(entry_config(spec), spec.layers, num_blocks, BLOCK_SIZE, KV_DTYPE)
    engine.register(cache.data_ptr(), cache.numel() * cache.element_size())
    unpack_kv(cache, block_table, 0, sent_kv(spec).view(-1))
    slab_buffer, slab = _registered(engine, layout.nbytes)
    _reply({"ready": True, "endpoint": engine.endpoint})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "naive":
            destinations = token_major_destinations(command["pages_address"], command["pages_shape"],
                                                    command["page_ids"], spec.tokens, spec.entry_bytes)
            report = write_naive(engine, cache, block_table, spec.tokens, command["endpoint"], destinations)
            _reply({"transfers": report.transfers, "bytes": report.nbytes, "write_seconds": report.seconds})
        elif command["op"] == "gathered":
            t0 = time.perf_counter()
            gather_stage(cache, block_table, spec.tokens, slab)
            gather_s = time.perf_counter() - t0
            report = write_slab(engine, slab_buffer.address, command["endpoint"], command["region_address"],
                                layout.transfers(0))
            _reply({"transfers": report.transfers, "bytes": report.nbytes, "gather_seconds": gather_s,
                    "write_seconds": report.seconds})
        else:
            break
    del slab  # the buffer's memory outlives no tensor
    slab_buffer.close()


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# ---- receiver (this process) ----------------------------------------------


class Sender:
    """The sender worker: spawned with its engine's chatter in a log file."""

    def __init__(self, spec: HandoffSpec, log: IO[bytes]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.tools.bench.handoff_bench", "sender", json.dumps(asdict(spec))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
        )
        self.log = log

    def ask(self, command: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise BenchError(f"sender exited with {self.proc.wait()}:\n{self._log_tail()}")
            if line.startswith("{"):  # anything else is chatter from the engine
                return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"op": "exit"})
            except (BenchError, BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _log_tail(self) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-20:])


def run(spec: HandoffSpec) -> dict[str, Any]:
    """Both paths in one run, every run verified; the summary (see the module doc)."""
    layout = spec.layout
    torch.set_num_threads(spec.threads)
    engine = TransferEngine()
    num_pages, page_ids = decode_page_ids(spec)
    pages_shape = [num_pages, PAGE_SIZE, spec.layers, spec.entry_bytes]
    pages_buffer, pages_bytes = _registered(engine, num_pages * PAGE_SIZE * spec.layers * spec.entry_bytes)
    region_buffer, region = _registered(engine, layout.nbytes)
    pages = pages_bytes.view(pages_shape).view(KV_DTYPE)
    entry_config(spec)  # bad --entry-bytes fails here, not in the sender
    expected = sent_kv(spec).transpose(0, 1)  # what decode must end up with: [tokens, layers, entry bytes]
    received_slots = token_slots(page_ids, 0, spec.tokens, PAGE_SIZE)

    def verify(path: str) -> int:
        got = pages_bytes.view(-1, spec.layers, spec.entry_bytes).index_select(0, received_slots)
        if not torch.equal(got, expected):
            bad = int((got != expected).any(dim=2).sum())
            raise BenchError(f"{path}: {bad} of {spec.tokens * spec.layers} (token, layer) entries differ")
        return got.numel()

    with tempfile.NamedTemporaryFile(prefix="kvpool-handoff-sender-", suffix=".log") as log:
        sender_proc = Sender(spec, log)
        try:
            ready = sender_proc.ask()
            endpoint = ready["endpoint"]

            def gathered() -> dict[str, Any]:
                pages_bytes.zero_()
                result = sender_proc.ask({"op": "gathered", "endpoint": engine.endpoint,
                                          "region_address": region_buffer.address})
                t0 = time.perf_counter()
                scatter_region(region, layout, pages, page_ids)
                result["scatter_seconds"] = time.perf_counter() - t0
                result["verified"] = verify("gathered")
                result["seconds"] = result["gather_seconds"] + result["write_seconds"] + result["scatter_seconds"]
                return result

            gathered()  # warm-up: connections, page faults
            pages_bytes.zero_()
            naive = sender_proc.ask({"op": "naive", "endpoint": engine.endpoint, "pages_address": pages_buffer.address,
                                     "pages_shape": pages_shape, "page_ids": page_ids.tolist()})
            naive["verified"] = verify("naive")
            runs = [gathered() for _ in range(spec.repeats)]
        finally:
            sender_proc.close()
    pages_buffer.close()
    region_buffer.close()
    median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return {
        "tokens": spec.tokens, "layers": spec.layers, "entry_bytes": spec.entry_bytes, "block_size": BLOCK_SIZE,
        "page_size": PAGE_SIZE, "repeats": spec.repeats, "threads": spec.threads, "sender_endpoint": endpoint,
        "naive_writes": naive["transfers"], "expected_naive_writes": num_naive_writes(spec.tokens, spec.layers),
        "gathered_writes": median["transfers"], "expected_gathered_writes": len(layout.transfers(0)),
        "naive_seconds": naive["write_seconds"], "gathered_seconds": median["seconds"],
        "gather_seconds": median["gather_seconds"], "write_seconds": median["write_seconds"],
        "scatter_seconds": median["scatter_seconds"],
        "gathered_seconds_all": [r["seconds"] for r in runs],
        "speedup": naive["write_seconds"] / median["seconds"],
        "bytes": layout.nbytes, "bytes_verified": min(r["verified"] for r in runs),
        "naive_bytes_verified": naive["verified"],
    }


def format_report(summary: dict[str, Any]) -> str:
    s = summary
    mb = s["bytes"] / 1e6
    lines = [
        (f"handoff of {s['tokens']} tokens x {s['layers']} layers x {s['entry_bytes']} B entries = {mb:.1f} MB "
         f"(prefill blocks of {s['block_size']}, decode pages of {s['page_size']} tokens)"),
        f"{'path':<10}{'writes':>10}{'seconds':>10}{'GB/s':>8}  detail",
        (f"{'naive':<10}{s['naive_writes']:>10}{s['naive_seconds']:>10.3f}"
         f"{s['bytes'] / s['naive_seconds'] / 1e9:>8.2f}  one {s['entry_bytes']} B write per token per layer"),
        (f"{'gathered':<10}{s['gathered_writes']:>10}{s['gathered_seconds']:>10.3f}"
         f"{s['bytes'] / s['gathered_seconds'] / 1e9:>8.2f}  gather {s['gather_seconds'] * 1e3:.1f} ms + write "
         f"{s['write_seconds'] * 1e3:.1f} ms + scatter {s['scatter_seconds'] * 1e3:.1f} ms "
         f"(median of {s['repeats']})"),
        (f"speedup {s['speedup']:.1f}x; verified byte for byte: naive {s['naive_bytes_verified']} B, "
         f"gathered {s['bytes_verified']} B per run"),
    ]
    return "\n".join(lines)


def spec_from_args(args: argparse.Namespace) -> HandoffSpec:
    tokens = args.tokens if args.tokens is not None else (1024 if args.quick else 8192)
    spec = HandoffSpec(tokens=tokens, layers=args.layers, entry_bytes=args.entry_bytes, repeats=args.repeats)
    if min(spec.tokens, spec.layers, spec.entry_bytes, spec.repeats) <= 0:
        raise ValueError("--tokens, --layers, --entry-bytes and --repeats must be positive")
    return spec


def main(args: argparse.Namespace) -> int:
    """``kvpool bench handoff``: print the table; with ``--json`` the last line is one JSON object."""
    try:
        summary = run(spec_from_args(args))
    except (ValueError, BenchError) as exc:
        raise SystemExit(f"kvpool bench handoff: {exc}") from None
    print(format_report(summary))
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "sender":
        sender(HandoffSpec(**json.loads(sys.argv[2])))
    else:
        raise SystemExit("usage: python -m kvpool.tools.bench.handoff_bench sender SPEC_JSON (run by kvpool bench handoff)")
