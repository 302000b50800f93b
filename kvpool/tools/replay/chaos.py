"""``kvpool replay --chaos SPEC``: the same sessions twice on a supervised cluster, clean then with faults.

Both runs start a fresh cluster through ``kvpool up``'s launcher and keep it
under ``kvpool up``'s supervisor (a killed process is restarted with backoff,
the master first). The clean run answers every turn at temperature 0 with
float32 KV, so its answers are the right ones; the chaos run injects the
faults of SPEC (``kvpool.core.supervision.chaos_spec``) at their times after the replay
starts, and ``kvpool.tools.replay.chaos_report`` compares the two turn by turn.

What each fault does, exactly:
- ``kill:NAME`` — SIGKILL to that process; the supervisor restarts it on its ports.
- ``slow:STORE=D`` — the store process is held stopped (SIGSTOP) for D, then let
  run (SIGCONT) for D, over and over for ``SLOW_WINDOW_S``: every transfer it
  serves (its transfer engine runs in that process) and its heartbeats wait up
  to D. Loopback ``tc netem`` cannot be scoped to one store here: the transfer
  engine's data connections use ports chosen at run time, shared by nobody.
- ``corrupt:STORE`` — our own transfer engine overwrites the store's whole
  segment (its address and size from the store's ready file) with random bytes,
  as a peer on the fabric can; every object there then fails its checksum when
  restored, which must be a recompute, never a wrong answer.

The supervisor runs on the thread that started the cluster (children die with
that thread), the replay on a thread of its own with its own event loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.secret_files import private_folder
from kvpool.core.supervision.chaos_spec import SLOW_WINDOW_S, Fault, FaultKind
from kvpool.tools.cluster import Cluster
from kvpool.tools.cluster.supervisor import Supervisor
from kvpool.tools.replay.engine import run_replay
from kvpool.tools.replay.probes import ClusterProbes
from kvpool.tools.replay.records import ReplayOptions, ReplayResult
from kvpool.tools.replay.workload import ReplayWorkload

CORRUPT_BLOCK = 8 << 20  # bytes per write when overwriting a segment
TICK_S = 0.1


def cluster_names(stores: int, pipelines: int, stages: int, decode_shards: int) -> set[str]:
    """The processes ``kvpool up`` starts for this shape (``kvpool.tools.up.up_topology``'s names)."""
    names = {"router", *(f"decode{i}" for i in range(decode_shards)),
             *(f"p{p}-stage{s}" for p in range(pipelines) for s in range(stages))}
    if stores:
        names |= {"master", *(f"store{i}" for i in range(stores))}
    return names


def corrupt_segment(ready: dict[str, Any]) -> int:
    """Overwrite a store's segment with random bytes, as a peer on its host would (mapping its shared
    memory) when it runs no engine, else through a transfer engine of our own; bytes written."""
    if not ready.get("endpoint"):
        return asyncio.run(_corrupt_shared(ready))
    from kvpool.transfer import HostBuffer, TransferEngine

    engine = TransferEngine("127.0.0.1")
    block = HostBuffer(CORRUPT_BLOCK)
    block.view()[:] = os.urandom(CORRUPT_BLOCK)
    engine.register(block.address, CORRUPT_BLOCK)
    try:
        base, size = int(ready["segment_address"]), int(ready["segment_size"])
        written = 0
        while written < size:
            n = min(CORRUPT_BLOCK, size - written)
            engine.write_sync(str(ready["endpoint"]), [block.address], [base + written], [n])
            written += n
        return written
    finally:
        engine.unregister(block.address)
        block.close()


async def _corrupt_shared(ready: dict[str, Any]) -> int:
    from kvpool.shared_memory import SegmentMaps

    shared = ready["shared_memory"]
    maps = SegmentMaps()
    try:
        mapped = await maps.map(shared["socket_path"], shared["name"], shared["token"])
        with mapped.using():
            noise = os.urandom(CORRUPT_BLOCK)
            for start in range(0, mapped.size, CORRUPT_BLOCK):
                n = min(CORRUPT_BLOCK, mapped.size - start)
                mapped.view(start, n)[:] = noise[:n]
        return mapped.size
    finally:
        await maps.close()


def _slow(cluster: Cluster, name: str, delay_s: float, stop: threading.Event) -> None:
    until = time.monotonic() + SLOW_WINDOW_S
    while time.monotonic() < until and not stop.is_set():
        proc = cluster.find(name)
        proc.pause()
        try:
            stop.wait(delay_s)
        finally:
            proc.resume()
        stop.wait(delay_s)


@dataclass(slots=True)
class ChaosRun:
    """One replay on a supervised cluster, with ``faults`` injected at their times (none: the clean run)."""

    cluster: Cluster
    probes: ClusterProbes
    faults: list[Fault] = field(default_factory=list)
    say: Callable[[str], None] = print
    injected: list[tuple[str, float]] = field(default_factory=list)  # (label, perf_counter when done)
    back: dict[str, float] = field(default_factory=dict)  # a killed process's label: perf_counter when ready again

    def run(self, workload: ReplayWorkload, options: ReplayOptions) -> ReplayResult:
        supervisor = Supervisor(self.cluster, say=self.say)
        box: dict[str, Any] = {}
        stop = threading.Event()

        def replay() -> None:
            try:
                box["result"] = asyncio.run(run_replay(self.cluster.http_url, workload, options, self.probes))
            except BaseException as exc:  # noqa: BLE001 - handed to the supervising thread
                box["error"] = exc

        thread = threading.Thread(target=replay, name="chaos-replay")
        started = time.perf_counter()
        thread.start()
        pending = list(self.faults)
        helpers: list[threading.Thread] = []
        try:
            while thread.is_alive():
                while pending and time.perf_counter() - started >= pending[0].at_s:
                    helpers += self._inject(pending.pop(0), stop)
                supervisor.tick()
                self._note_back()
                thread.join(TICK_S)
        finally:
            stop.set()
            for helper in helpers:
                helper.join()
            thread.join()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _note_back(self) -> None:
        """A killed process the supervisor has restarted (tick returns once it is ready) is back now."""
        for fault in self.faults:
            if (fault.kind is FaultKind.KILL and fault.label not in self.back
                    and any(label == fault.label for label, _ in self.injected)
                    and self.cluster.find(fault.target).alive):
                self.back[fault.label] = time.perf_counter()

    def _inject(self, fault: Fault, stop: threading.Event) -> list[threading.Thread]:
        proc = self.cluster.find(fault.target)
        helpers = []
        if fault.kind is FaultKind.KILL:
            proc.kill()
        elif fault.kind is FaultKind.SLOW:
            helper = threading.Thread(target=_slow, args=(self.cluster, fault.target, fault.delay_s, stop))
            helper.start()
            helpers.append(helper)
        else:
            written = corrupt_segment(proc.ready)
            self.say(f"kvpool replay: {fault.target}: {written:,} segment bytes overwritten")
        self.injected.append((fault.label, time.perf_counter()))
        self.say(f"kvpool replay: {fault.label} injected")
        return helpers


def fault_times(run: ChaosRun, result: ReplayResult) -> list[tuple[str, float]]:
    """Each injected fault's moment in the replay's own clock (seconds after its start)."""
    return [(label, at - result.started_at) for label, at in run.injected]


def back_times(run: ChaosRun, result: ReplayResult) -> dict[str, float]:
    """When each killed process was ready again, in the replay's own clock."""
    return {label: at - result.started_at for label, at in run.back.items()}


def workdir_of(base: Path, phase: str) -> Path:
    """A phase's cluster workdir: the cluster's own folder (``Cluster.start`` wants it this user's, 0700)."""
    return private_folder(base / phase, "workdir")


def main_chaos(args: Any, workload: ReplayWorkload, faults: list[Fault], device_cache_tokens: int,
               write_config: Callable[[Path, Any], Path], probes_of: Callable[[Cluster], ClusterProbes],
               workdir: Path) -> dict[str, Any]:
    """Clean run, then chaos run, each on a fresh supervised cluster; the report (``chaos_report``)."""
    from kvpool.tools.replay.chaos_report import chaos_report
    from kvpool.tools.up import UpSettings, up_cluster

    level = int(str(args.concurrency or "4").split(",")[0])
    options = ReplayOptions(concurrency=level, think_scale=args.think_scale, duration_s=args.duration,
                            chunk_size=args.chunk_size)
    results: dict[str, tuple[ChaosRun, ReplayResult]] = {}
    phases: list[tuple[str, list[Fault]]] = [("clean", []), ("chaos", faults)]
    if any(f.kind is FaultKind.KILL and f.target == "master" for f in faults):
        phases.append(("no_pool", []))  # the master outage's bound: the same turns without any pool
    for phase, phase_faults in phases:
        settings = UpSettings(http_port=0, grpc_port=0, pipelines=args.pipelines, stages=args.stages,
                              decode_shards=args.decode_shards, stores=0 if phase == "no_pool" else args.stores,
                              segment_size=args.segment_size,
                              master_standbys=0 if phase == "no_pool" else getattr(args, "master_standbys", 0),
                              kv_dtype="float32", device_cache_tokens=device_cache_tokens,
                              workdir=str(workdir_of(workdir, phase)))
        cluster = up_cluster(settings, str(write_config(workdir / f"chaos-{phase}.toml", args)), args.log_level)
        try:
            cluster.start()
            print(f"kvpool replay: {phase} run", flush=True)
            run = ChaosRun(cluster, probes_of(cluster), phase_faults, say=lambda line: print(line, flush=True))
            results[phase] = (run, run.run(workload, options))
        except Exception as exc:
            if phase != "no_pool":
                raise
            # the bound's baseline only: the report stands without it, and says it is missing
            print(f"kvpool replay: the run without a pool failed: {exc}", flush=True)
        finally:
            cluster.stop()
    chaos_run, chaos_result = results["chaos"]
    no_pool = results["no_pool"][1].records if "no_pool" in results else None
    return chaos_report(results["clean"][1].records, chaos_result.records, fault_times(chaos_run, chaos_result),
                        back_times(chaos_run, chaos_result), no_pool)
