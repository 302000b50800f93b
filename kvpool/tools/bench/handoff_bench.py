"""``kvpool bench handoff``: gathered vs per-token-per-layer prefill → decode handoff, and the same host's
shared-memory path vs the engine's.

Two real processes on this host, each with its own transfer engine (TCP):
a sender holding one prefill stage's paged KV (the model's own cache
layout, DeepSeek-V3's fp8 entry shape; the request's tokens are seeded
random bytes in blocks scattered over twice as many) and this process as the receiver, with decode's
token-major pages (``[pages, page_size, layers, entry]``, the request's pages
scattered too) and a receive region, all registered; the region is decode's
kind of receive arena, a sealed memfd offered over a Unix socket in a private
folder (``kvpool.shared_memory``).

- naive: the sender writes every (layer, token) entry straight from its page
  slot to decode's page slot, ``entry_bytes`` per write, in batches of 1,024;
- gathered: the sender packs the request into one registered slab, writes it
  in the layout's transfers (at most 8 MiB) into the region, and the receiver
  scatters the region into its pages. Seconds = gather + write + scatter.
- same host: the sender maps the region (once, as a stage does) and gathers
  the request straight into it (the gather is the move: no slab, no engine);
  the receiver scatters it. Seconds = gather + scatter.
  ``same_host_over_engine`` = gathered seconds / same-host seconds.

Before each run the pages and the region are zeroed; after it, every entry of
the request in decode's pages must equal the sender's (regenerated here from
the same seed), byte for byte, or the run fails. The gathered and same-host
paths run once each to warm up (connections, the mapping, page faults), then
``repeats`` times each, alternating; their medians count.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch

from kvpool.core.handoff.layout import HandoffLayout, num_naive_writes
from kvpool.handoff import (
    gather_range_into,
    gather_stage,
    memory_tensor,
    region_range,
    scatter_region,
    token_major_destinations,
    write_naive,
    write_slab,
)
from kvpool.model import ModelConfig, allocate_kv_cache, get_config, unpack_kv
from kvpool.model.kv_cache import token_slots
from kvpool.shared_memory import SegmentMaps, SegmentShare, SharedSegment, default_shared_memory_dir
from kvpool.transfer import HostBuffer, TransferEngine

BLOCK_SIZE = 256  # prefill: tokens per device block (the chunk size)
PAGE_SIZE = 16  # decode: tokens per page
KV_DTYPE = torch.float8_e4m3fn  # DeepSeek-V3's KV: one byte per value, 576 per entry
READY_TIMEOUT_S = 60.0
REGION_NAME = "bench-region"  # the receive region's segment name on its shared-memory socket


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


class LoopThread:
    """An event loop on a daemon thread, for the shared-memory socket's owner and peer (both async) in these
    otherwise blocking processes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="bench-loop", daemon=True).start()

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(READY_TIMEOUT_S)


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
    loop, maps = LoopThread(), SegmentMaps()
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
        elif command["op"] == "same_host":
            mapped = loop.run(maps.map(command["socket_path"], REGION_NAME, command["token"]))  # cached after once
            with mapped.using():
                t0 = time.perf_counter()
                region = memory_tensor(mapped.address, layout.nbytes)
                destination = region_range(region, layout, 0, 0, spec.tokens)
                gather_range_into(cache, block_table, 0, spec.tokens, destination)
                gather_s = time.perf_counter() - t0
                del region, destination  # no tensor over the mapping outlives its pin
            _reply({"transfers": 0, "bytes": layout.nbytes, "gather_seconds": gather_s, "write_seconds": 0.0})
        else:
            break
    del slab  # the buffer's memory outlives no tensor
    slab_buffer.close()
    loop.run(maps.close())


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
    # decode's kind of receive arena: shared memory, registered with the engine too
    region_buffer = SharedSegment(layout.nbytes, REGION_NAME)
    region_buffer.touch()
    engine.register(region_buffer.address, layout.nbytes)
    region = torch.frombuffer(region_buffer.view(), dtype=torch.uint8)
    loop = LoopThread()
    share = SegmentShare(Path(default_shared_memory_dir()), f"bench-handoff-{region_buffer.token[:16]}")
    share.add(REGION_NAME, region_buffer)
    socket_path = str(loop.run(_start(share)))
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

            def timed(path: str, command: dict[str, Any]) -> dict[str, Any]:
                pages_bytes.zero_()
                region.zero_()  # a path that moved nothing must not pass on the last run's bytes
                result = sender_proc.ask(command)
                t0 = time.perf_counter()
                scatter_region(region, layout, pages, page_ids)
                result["scatter_seconds"] = time.perf_counter() - t0
                result["verified"] = verify(path)
                result["seconds"] = result["gather_seconds"] + result["write_seconds"] + result["scatter_seconds"]
                return result

            def gathered() -> dict[str, Any]:
                return timed("gathered", {"op": "gathered", "endpoint": engine.endpoint,
                                          "region_address": region_buffer.address})

            def same_host() -> dict[str, Any]:
                return timed("same_host", {"op": "same_host", "socket_path": socket_path,
                                           "token": region_buffer.token})

            gathered()  # warm-up: connections, page faults
            same_host()  # warm-up: the mapping, its page faults
            pages_bytes.zero_()
            naive = sender_proc.ask({"op": "naive", "endpoint": engine.endpoint, "pages_address": pages_buffer.address,
                                     "pages_shape": pages_shape, "page_ids": page_ids.tolist()})
            naive["verified"] = verify("naive")
            runs, memory_runs = [], []
            for _ in range(spec.repeats):  # alternating: neither path gets the quieter half of the run
                runs.append(gathered())
                memory_runs.append(same_host())
        finally:
            sender_proc.close()
            loop.run(share.close())
    pages_buffer.close()
    region_buffer.close()
    median = _median(runs)
    memory = _median(memory_runs)
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
        "same_host_seconds": memory["seconds"], "same_host_gather_seconds": memory["gather_seconds"],
        "same_host_scatter_seconds": memory["scatter_seconds"],
        "same_host_seconds_all": [r["seconds"] for r in memory_runs],
        "same_host_bytes_verified": min(r["verified"] for r in memory_runs),
        "same_host_over_engine": median["seconds"] / memory["seconds"],
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


async def _start(share: SegmentShare) -> Path:
    return await share.start()


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
        (f"{'same host':<10}{0:>10}{s['same_host_seconds']:>10.3f}"
         f"{s['bytes'] / s['same_host_seconds'] / 1e9:>8.2f}  gather into decode's mapped region "
         f"{s['same_host_gather_seconds'] * 1e3:.1f} ms + scatter {s['same_host_scatter_seconds'] * 1e3:.1f} ms "
         f"(median of {s['repeats']})"),
        (f"speedup {s['speedup']:.1f}x; same host over engine {s['same_host_over_engine']:.2f}x; verified byte for "
         f"byte: naive {s['naive_bytes_verified']} B, gathered {s['bytes_verified']} B, same host "
         f"{s['same_host_bytes_verified']} B per run"),
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
