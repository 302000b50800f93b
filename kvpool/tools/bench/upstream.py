"""Baseline benchmarks: the raw Mooncake transfer engine and upstream Mooncake Store.

Both measurements run on one host over TCP (loopback) and are the reference
points that kvpool's own pool numbers are compared against:

* ``measure_te_raw`` -- two processes and nothing but ``TransferEngine``: a
  *target* registers a buffer, an *initiator* does ``batch_transfer_sync_write``
  and ``batch_transfer_sync_read`` against it.  This is the transport ceiling.
* ``measure_mooncake_store`` -- a ``mooncake_master``, one or more *store*
  processes that each mount a global segment, and a *client* (segment 0) that
  does ``batch_put_from`` / ``batch_get_into`` / ``batch_is_exist`` from a
  registered buffer.

Conventions shared by every number reported here:

* Throughput is in GB/s with GB = 1e9 bytes: the bytes of the measured
  objects that were read back and verified, over the summed seconds of the
  measured batches (``stats.throughput_gbps``, the formula kvpool's own numbers
  use too).  Latencies are per-batch p50/p99 in milliseconds
  (linear-interpolated percentiles, like numpy's default).
* The first ``warmup_batches`` batches (default 1) are run and verified but not
  counted: they include the engines' lazy connection handshakes.
* Every byte is verified: each object carries a (system, batch, index) stamp on
  top of random payload, each destination is zeroed before its read, and the
  CRC32 of every object read back must equal the CRC32 of what was written.  A
  failed put or get or a mismatch raises ``BenchError``.
* No buffer here asks for huge pages (see ``worker_protocol.Region``); each
  result reports the huge-page bytes its processes ended up with.

Workers are ``python -m kvpool.tools.bench.upstream <role>``: this module dispatches
each role to ``te_raw`` or ``mooncake_store``; the process protocol, payload
verification and statistics live in ``worker_protocol``.  They speak one JSON
object per stdout line (``ready`` / ``result`` / ``error``); everything else
they or the engine print goes to a per-run log file.

Manual use::

    python -m kvpool.tools.bench.upstream all --object-size 1179648 --batch-size 64 --batches 16
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvpool.tools.bench.mooncake_store import mc_client_main, mc_store_main, measure_mooncake_store
from kvpool.tools.bench.te_raw import measure_te_raw, te_initiator_main, te_target_main
from kvpool.tools.bench.worker_protocol import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_BATCHES,
    DEFAULT_EXIST_KEYS,
    DEFAULT_EXIST_REPS,
    DEFAULT_OBJECT_SIZE,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WARMUP_BATCHES,
    MODULE,
    BenchError,
    emit,
    percentile,
    protocol_stream,
    summarize_batches,
    summarize_latency,
)

__all__ = [
    "DEFAULT_BATCHES",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_EXIST_KEYS",
    "DEFAULT_EXIST_REPS",
    "DEFAULT_OBJECT_SIZE",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WARMUP_BATCHES",
    "BenchError",
    "main",
    "measure_mooncake_store",
    "measure_te_raw",
    "percentile",
    "summarize_batches",
    "summarize_latency",
]

WORKER_ROLES = {
    "te-target": te_target_main,
    "te-initiator": te_initiator_main,
    "mc-store": mc_store_main,
    "mc-client": mc_client_main,
}


def worker_main(role: str, spec_json: str) -> int:
    """Run one worker role; any failure becomes an ``error`` protocol line."""
    out = protocol_stream()
    try:
        WORKER_ROLES[role](json.loads(spec_json), out)
    except Exception as exc:  # noqa: BLE001 -- reported to the parent, not swallowed
        emit(out, "error", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """CLI: ``all`` | ``te-raw`` | ``store`` with the run shape."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["all", "te-raw", "store"])
    parser.add_argument("--object-size", type=int, default=DEFAULT_OBJECT_SIZE)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--batches", type=int, default=DEFAULT_BATCHES)
    parser.add_argument("--warmup-batches", type=int, default=DEFAULT_WARMUP_BATCHES)
    parser.add_argument("--segment-bytes", type=int, default=None, help="per store; default: auto")
    parser.add_argument("--num-stores", type=int, default=1)
    parser.add_argument(
        "--prefault-segment",
        action="store_true",
        help="put+remove the run's volume first (see mc_prefault)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Worker dispatch, or the manual CLI that prints one JSON object last."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in and args_in[0] in WORKER_ROLES:
        return worker_main(args_in[0], args_in[1])
    args = parse_args(args_in)
    shape = (args.object_size, args.batch_size, args.batches)
    result: dict[str, Any] = {}
    if args.what in ("all", "te-raw"):
        result |= measure_te_raw(*shape, warmup_batches=args.warmup_batches)
    if args.what in ("all", "store"):
        result |= measure_mooncake_store(
            *shape,
            args.segment_bytes,
            num_stores=args.num_stores,
            warmup_batches=args.warmup_batches,
            prefault_segment=args.prefault_segment,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
