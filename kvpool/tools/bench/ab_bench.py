"""``kvpool bench ab``: time to first token of this checkout against an earlier commit, through the public API.

Two whole clusters run side by side on this host, each started by its own
checkout's ``kvpool up`` on the same settings: ``baseline`` from a clone of
``--baseline`` (a commit of this repository; its ``services/`` is linked where
an installed tree has it, and the clone's tree is put first on
``PYTHONPATH``), ``current`` from this checkout. Requests go one at a time
through each router's gRPC ``Generate``, the client's own clock timing the
first token, and every case runs in rounds that alternate the two (ABAB…, one
side then the other with the same prompt; which goes first alternates by
round), so both meet the same host at about the same load.

Cases, on 4 stages at ``dsv3-kv-lean`` with float8 KV (``kvpool bench path``'s
cases' cluster, here behind the router), no pool:

- ``4k_cold``, ``16k_cold``: fresh random prompts;
- ``16k_warm``: the round's 16K prompt's first 61 chunks (95.3%) and a fresh tail,
  so the prefix is a device hit.

And on a second pair of clusters, ``kvpool up``'s own defaults (the ``tiny``
model, 4 stages, the pool on), where a short turn is mostly control time:

- ``one_token_hit``: a 512-token prompt, then that prompt and one more token: all
  but one token a device hit. (At ``dsv3-kv-lean`` one token's forward over a
  4K context costs about 25 ms a stage on these CPUs, float8 KV read back every
  layer, which is compute, not the path this case is about.)

Per case and side: the TTFT samples and their median; ``ratio_p50`` is current's
median over baseline's, ``pair_ratio_p50`` the median of the per-pair ratios.
``greedy_identical``: both sides' tokens agree on every prompt (temperature 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from kvpool import service
from kvpool.model import get_config
from kvpool.rpc import router_pb2, router_pb2_grpc

MODEL = "dsv3-kv-lean"
KV_DTYPE = "float8_e4m3fn"
CHUNK = 256
WARM_CHUNKS = 61
READY_TIMEOUT_S = 300.0
CASES = ("4k_cold", "16k_cold", "16k_warm")
CONTROL_CASES = ("one_token_hit",)
CONTROL_PROMPT_TOKENS = 512
UP_ARGS = ["--no-pool", "--stores", "0", "--stages", "4", "--pipelines", "1", "--decode-shards", "1",
           "--model", MODEL, "--kv-dtype", KV_DTYPE, "--device-cache-tokens", str(4 * 16384),
           "--region-arena-bytes", "160MiB", "--log-level", "warning"]
CONTROL_UP_ARGS = ["--stages", "4", "--pipelines", "1", "--decode-shards", "1", "--log-level", "warning"]
ROOT = Path(__file__).resolve().parents[3]


def baseline_tree(commit: str, workdir: Path) -> Path:
    """A clone of this repository at ``commit``, importable as ``kvpool`` (``kvpool.services`` linked in)."""
    tree = workdir / "baseline-tree"
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"kvpool bench ab: --baseline {commit!r} is not a commit of {ROOT}")
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", commit], check=True)
    link = tree / "kvpool" / "services"
    if not link.exists():
        link.symlink_to("../services")
    return tree


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


LAUNCH = "from kvpool.services.cli import main; raise SystemExit(main())"


def side_env(tree: Path | None) -> dict[str, str]:
    """The environment a side's processes run in: ``tree`` first on the import path (the baseline)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH", "")]))
    return env


def side_cwd(tree: Path | None) -> Path:
    """Where a side's ``kvpool up`` runs: ``python -c`` puts its working directory first on the import path, so
    the baseline runs in its own tree (from this checkout's root, it would import this checkout instead)."""
    return tree if tree is not None else ROOT


def side_source(tree: Path | None) -> Path:
    """The folder a side's processes import ``kvpool.services`` from, asked of a python started as they are."""
    done = subprocess.run([sys.executable, "-c", "import kvpool.services.cli as c; print(c.__file__)"],
                          env=side_env(tree), cwd=side_cwd(tree), capture_output=True, text=True, check=True)
    return Path(done.stdout.strip()).resolve()


def check_side_source(tree: Path) -> None:
    """Refuse to compare against a baseline whose processes would not run the baseline's own code."""
    source, want = side_source(tree), tree.resolve()
    if not source.is_relative_to(want):
        raise SystemExit(f"kvpool bench ab: the baseline's processes would import {source}, not its tree {want}")


class Side:
    """One checkout's ``kvpool up`` on ports picked here (an older ``up`` may write no ready file), and where
    its router listens."""

    def __init__(self, name: str, tree: Path | None, workdir: Path, up_args: list[str]) -> None:
        self.name = name
        env = side_env(tree)
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"{name}.out"
        (workdir / name).mkdir(mode=0o700, exist_ok=True)  # kvpool up's workdir must be private
        # this checkout's up binds free ports itself and says which in its ready file; an older one (``tree``)
        # may write none: ports picked here, which another process may take first
        self.ready = None if tree is not None else workdir / f"{name}.ready.json"
        if self.ready is None:
            self.http_port, grpc_port = free_port(), free_port()
            ports = ["--http-port", str(self.http_port), "--grpc-port", str(grpc_port)]
            self.address = f"127.0.0.1:{grpc_port}"
        else:
            self.http_port, self.address = 0, ""
            ports = ["--http-port", "0", "--grpc-port", "0", "--ready-file", str(self.ready)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LAUNCH, "up", *up_args, *ports, "--workdir", str(workdir / name)],
                env=env, cwd=side_cwd(tree), stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        """Until the router's /health answers 200: every backend in rotation."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: kvpool up exited with {self.proc.returncode} (see {self.log})")
            if self.ready is not None and not self.http_port:
                try:
                    ready = json.loads(self.ready.read_text())
                    self.http_port, self.address = int(ready["http_port"]), f"127.0.0.1:{ready['grpc_port']}"
                except (OSError, ValueError, KeyError):
                    time.sleep(0.2)  # not written yet
                    continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: not healthy within {READY_TIMEOUT_S} s (see {self.log})")
            time.sleep(0.5)  # a cluster starting up, not work

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def first_token(stub: router_pb2_grpc.RouterStub, token_ids: list[int], max_tokens: int
                      ) -> tuple[float, list[int]]:
    """Seconds to the first token through the router, and every token (greedy)."""
    request = router_pb2.GenerateRequest(token_ids=token_ids, sampling=router_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0))
    started = time.perf_counter()
    ttft, tokens = 0.0, []
    async for response in stub.Generate(request, timeout=600):
        if response.HasField("usage"):
            continue
        ttft = ttft or time.perf_counter() - started
        tokens.append(response.token_id)
    return ttft, tokens


async def run_rounds(sides: list[Side], cases: tuple[str, ...], rounds: int, hit_requests: int,
                     vocab: int) -> dict[str, Any]:
    rng = random.Random(41)
    samples: dict[str, dict[str, list[float]]] = {c: {s.name: [] for s in sides} for c in cases}
    pairs: dict[str, list[float]] = {c: [] for c in cases}
    compared = identical = errors = 0
    channels = [service.channel(s.address) for s in sides]
    stubs = {s.name: router_pb2_grpc.RouterStub(c) for s, c in zip(sides, channels)}
    try:
        for r in range(rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            fresh = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
            prompts: dict[str, list[list[int]]] = {}
            if "4k_cold" in cases:
                long = fresh(16384)
                prompts |= {"4k_cold": [fresh(4096)], "16k_cold": [long],
                            "16k_warm": [long[: WARM_CHUNKS * CHUNK] + fresh(16384 - WARM_CHUNKS * CHUNK)]}
            if "one_token_hit" in cases:  # the first request makes the device hit; the rest are the case
                short = fresh(CONTROL_PROMPT_TOKENS)
                prompts["one_token_hit"] = [short] + [short + [rng.randrange(1, vocab)] for _ in range(hit_requests)]
            for case in cases:
                for i, token_ids in enumerate(prompts[case]):
                    got: dict[str, tuple[float, list[int]]] = {}
                    for side in order:
                        try:
                            got[side.name] = await first_token(stubs[side.name], token_ids, 2)
                        except grpc.aio.AioRpcError:
                            errors += 1
                    if len(got) == 2:
                        compared += 1
                        identical += got["baseline"][1] == got["current"][1]
                    if case == "one_token_hit" and i == 0:
                        continue  # it only made the hit
                    for name, (ttft, _) in got.items():
                        samples[case][name].append(ttft)
                    if len(got) == 2:
                        pairs[case].append(got["current"][0] / got["baseline"][0])
    finally:
        for channel in channels:
            await channel.close()
    out: dict[str, Any] = {}
    for case in cases:
        medians = {name: statistics.median(v) if v else None for name, v in samples[case].items()}
        out[case] = {
            "ttft_ms_p50": {n: round(m * 1e3, 2) if m is not None else None for n, m in medians.items()},
            "ratio_p50": (round(medians["current"] / medians["baseline"], 3)
                          if medians["current"] and medians["baseline"] else None),
            "pair_ratio_p50": round(statistics.median(pairs[case]), 3) if pairs[case] else None,
            "ttft_ms": {n: [round(t * 1e3, 1) for t in v] for n, v in samples[case].items()},
        }
    out["errors"] = errors
    out["compared"], out["identical"] = compared, identical
    return out


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-ab-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        tree = baseline_tree(args.baseline, workdir)
        check_side_source(tree)
        rounds = args.rounds or (2 if args.quick else 5)
        result: dict[str, Any] = {}
        errors = compared = identical = 0
        for label, up_args, cases, model in (("cases", UP_ARGS, CASES, MODEL),
                                             ("control", CONTROL_UP_ARGS, CONTROL_CASES, "tiny")):
            if args.cases not in ("all", label):
                continue
            sides = [Side("baseline", tree, workdir / label, up_args), Side("current", None, workdir / label, up_args)]
            try:
                for side in sides:
                    side.wait_ready()
                got = asyncio.run(run_rounds(sides, cases, rounds, args.hit_requests, get_config(model).vocab_size))
            finally:
                for side in sides:
                    side.stop()
            errors += got.pop("errors")
            compared += got.pop("compared")
            identical += got.pop("identical")
            result |= got
    result |= {"errors": errors, "greedy_identical": f"{identical}/{compared}", "baseline": args.baseline,
               "current": current_commit(), "rounds": rounds, "cases_model": MODEL, "cases_kv_dtype": KV_DTYPE,
               "control_model": "tiny", "stages": 4, "which_cases": args.cases,
               "load_1m_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(result, default=str) if args.json else json.dumps(result, indent=1, default=str))
    return 0 if result["errors"] == 0 else 1


def current_commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()
