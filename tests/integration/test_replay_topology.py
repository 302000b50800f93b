"""K logical servers with real processes: host identities, namespaces, clean stops, a tiny shared-vs-split run.

Small on purpose (two servers, one-stage pipelines, tiny pools): what is
checked is the wiring — which master each store mounts on, under which host
name, over which link — and that nothing is left behind: every process gone,
every ``kvr-`` namespace and link removed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvpool.pool.stats_client import fetch_stats
from kvpool.tools.cluster import Cluster
from kvpool.tools.cluster.netns import (
    Network,
    link_names,
    netns_names,
    why_unavailable,
)
from kvpool.tools.cluster.zygote import ForkedProcess
from kvpool.tools.replay.compare import run_compare
from kvpool.tools.replay.engine import ReplayOptions
from kvpool.tools.replay.topology import TopologySettings, side_topology
from kvpool.tools.replay.workload import ReplaySession, ReplayTurn, ReplayWorkload
from kvpool.workload.timelines import AgentTimeline

pytestmark = pytest.mark.cluster

TINY: dict = {"servers": 2, "stages": 1, "segment_size": "16MiB", "device_cache_tokens": 1024,
              "netns_lock_wait_s": 600.0}  # another run on this host (a CI copy) may hold the namespaces a while


def netns_reason() -> str | None:
    reason = why_unavailable()
    if reason is None and subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode != 0:
        reason = "ip netns list fails here"
    return reason


def complete(url: str, prompt: list[int], key: str) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, "prompt_cache_key": key}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def segment_hosts(master: str) -> dict[str, str]:
    stats = asyncio.run(fetch_stats(master))
    return {seg["segment_id"]: seg["host"] for seg in stats["segments"]}


def test_loopback_shared_pool_has_a_host_name_per_server_and_stops_clean() -> None:
    topology = Cluster(side_topology(TopologySettings(**TINY, pool="shared", netns=False))).start()
    processes = [p for s in topology.servers for p in s.services] + topology.masters + [topology.router]
    try:
        assert topology.network is None and topology.network_mode.startswith("loopback: loopback asked for")
        assert [s.host_name for s in topology.servers] == ["kvr-s0", "kvr-s1"]
        hosts = segment_hosts(f"127.0.0.1:{topology.masters[0].ready['port']}")
        # one master over both stores of both servers, each store under its server's host name
        assert hosts == {"s0-store-p": "kvr-s0", "s0-store-d": "kvr-s0", "s1-store-p": "kvr-s1",
                         "s1-store-d": "kvr-s1"}
        answer = complete(topology.http_url, list(range(300)), "s1")
        assert answer["usage"]["prompt_tokens"] == 300
        assert topology.link_bytes() == [None, None]
    finally:
        topology.stop()
    assert all(p is not None and not p.alive for p in processes)


@pytest.mark.skipif(netns_reason() is not None, reason=f"no network namespaces: {netns_reason()}")
def test_netns_split_pool_one_master_per_server_and_everything_removed() -> None:
    topology = Cluster(side_topology(TopologySettings(**TINY, pool="split", link_gbit=1.0))).start()
    processes = [p for s in topology.servers for p in s.services] + [topology.router]
    try:
        assert topology.network is not None and topology.network_mode.startswith("netns: 2 namespaces")
        assert sorted(netns_names()) == ["kvr-s0", "kvr-s1"]
        assert [s.address for s in topology.servers] == ["10.77.0.10", "10.77.0.11"]
        assert topology.masters == []  # split: each master is one of its server's processes
        for server in topology.servers:
            # forked from the zygote, each process moved itself into its server's namespace (its host
            # name is checked through the stores' segments below)
            server_net = os.stat(f"/run/netns/{server.place.netns}").st_ino
            assert server_net != os.stat("/proc/self/ns/net").st_ino
            for process in server.services:
                assert isinstance(process.proc, ForkedProcess), process.name
                assert process.proc is not None and os.stat(f"/proc/{process.proc.pid}/ns/net").st_ino == server_net
            master = next(p for p in server.services if p.name.endswith("-master"))
            # only the prefill-side store, under the server's own name, reached over its namespace's address
            assert segment_hosts(f"{server.address}:{master.ready['port']}") == {
                f"s{server.index}-store-p": server.host_name}
        before = topology.link_bytes()
        complete(topology.http_url, list(range(600)), "s2")
        after = topology.link_bytes()
        # the router (root namespace) reached a pipeline and a shard over some server's link, both ways
        moved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]  # type: ignore[index]
        assert sum(m[0] for m in moved) > 0 and sum(m[1] for m in moved) > 0
    finally:
        topology.stop()
    assert all(not p.alive for p in processes)
    assert netns_names() == [] and link_names() == []


@pytest.mark.skipif(netns_reason() is not None, reason=f"no network namespaces: {netns_reason()}")
def test_network_removed_on_error_and_leftovers_of_a_crashed_run_cleared() -> None:
    subprocess.run(["ip", "netns", "add", "kvr-s7"], check=True)  # what a killed run would leave
    network = Network(num_servers=2, link_gbit=0.5)
    with pytest.raises(RuntimeError, match="boom"):
        try:
            network.create(lock_wait_s=600.0)
            assert "netns kvr-s7" in network.removed_leftovers
            assert sorted(netns_names()) == ["kvr-s0", "kvr-s1"]
            assert sorted(link_names()) == ["kvr-br", "kvr-s0h", "kvr-s1h"]
            raise RuntimeError("boom")
        finally:
            network.remove()
    assert netns_names() == [] and link_names() == []


def tiny_workload(num_sessions: int = 2, turns: int = 3) -> ReplayWorkload:
    """Sessions whose every turn extends the last by one 64-token block (scale 1: 64 tokens a block)."""
    sessions = []
    for s in range(num_sessions):
        hash_ids = tuple(1000 * s + b for b in range(6))
        replay_turns = tuple(ReplayTurn(i, float(i), 0.0, 64 * (4 + i), hash_ids[: 4 + i], 64 * (4 + i), 2)
                             for i in range(turns))
        sessions.append(ReplaySession(f"tiny{s}", f"tiny{s}", 64, 0.0, 0, replay_turns,
                                      (AgentTimeline(None, None, 0.0, 0, tuple(range(turns))),)))
    return ReplayWorkload("weka", "tiny", sessions, 1, 1024, 32768, math.nan, 0, [])


def test_tiny_shared_against_split_end_to_end() -> None:
    """Every side of ``--compare pool=shared,split`` (shared, split-moving, split-strict), on loopback: the split
    side in namespaces is test_netns_split_pool_one_master_per_server_and_everything_removed; the shaped-link
    figures are the benchmark's (docs/benchmarks.md)."""
    workload = tiny_workload()
    out = run_compare("pool", ("shared", "split-moving", "split-strict"), TopologySettings(**TINY, netns=False),
                      workload, [2], ReplayOptions(concurrency=2, think_scale=0.0))
    for side in ("shared", "split-moving", "split-strict"):
        summary = out["sides"][side]
        assert (summary["turns_sent"], summary["turns_ok"], summary["errors"]) == (6, 6, 0)
        assert summary["network_mode"].startswith("loopback")
        assert summary["link_bytes"] == [None, None]
        # turns 2 and 3 of each session find the earlier turns' chunks (device or pool)
        assert summary["reuse_ratio"] > 0
        assert out[f"reuse_{side.replace('-', '_')}"] == summary["reuse_ratio"]
        assert out[f"errors_{side.replace('-', '_')}"] == 0
    # the router started with --affinity-max-queue (the policy's threshold is tested in its own unit tests)
    assert out["sides"]["split-strict"]["session_moves"] == 0
    for key in ("shared_over_split_moving", "shared_over_split_strict"):
        assert out[key] > 0 and math.isfinite(out[key])
    assert out["shared_over_split"] == out["shared_over_split_moving"] and out["errors"] == 0
    assert out["regime"]["working_set_bytes"] == 2 * 8 * 256 * 96 * 4


def write_weka_folder(folder: Path, sessions: int) -> Path:
    """``sessions`` weka traces of three turns, each turn extending the last by one 256-token block."""
    folder.mkdir()
    for s in range(1, sessions + 1):
        requests = [{"t": float(i), "in": 256 * (2 + i) + 10, "out": 2, "think_time": 0.0,
                     "hash_ids": list(range(100 * s, 100 * s + 2 + i))} for i in range(3)]
        doc = {"id": f"tiny{s}", "block_size": 256, "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": 0,
               "requests": requests}
        (folder / f"trace_{s:04d}.json").write_text(json.dumps(doc))
    return folder


def test_sched_compare_finds_its_load_then_compares_there(tmp_path: Path) -> None:
    """``--compare sched=fifo,session`` with its load finder on (the default): FIFO alone steps 1 then 2 sessions
    until its prefill queues; both sides then run at the last step's load, FIFO's step standing as its side."""
    trace = write_weka_folder(tmp_path / "weka", 2)
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "replay", str(trace), "--compare", "sched=fifo,session",
         "--servers", "1", "--stages", "1", "--scale", "1", "--sessions", "1", "--find-load-max-sessions", "2",
         "--think-scale", "0", "--max-tokens", "2", "--loopback", "--json"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    load = out["load"]
    steps = load["steps"]
    assert [s["sessions"] for s in steps] == [1, 2][:len(steps)] and steps
    assert all(not s["queues"] for s in steps[:-1])  # it stopped at the first step that queued, or the last
    for step in steps:
        assert step["queues"] == (step["prefill_wait_p50_s"] >= step["prefill_service_p50_s"])
        assert step["prefill_service_p50_s"] > 0 and step["errors"] == 0
    assert (load["sessions"], load["concurrency"]) == (steps[-1]["sessions"],) * 2
    assert load["queues"] == steps[-1]["queues"]
    assert out["levels"] == [load["concurrency"]] and out["sessions"] == load["sessions"]
    fifo, session = out["sides"]["fifo"], out["sides"]["session"]
    assert fifo["ttft_p50_s"] == steps[-1]["ttft_p50_s"]  # the step's run, not another
    for side in (fifo, session):
        assert (side["concurrency"], side["sessions"], side["turns_sent"], side["errors"]) == \
            (load["sessions"], load["sessions"], 3 * load["sessions"], 0)
    assert out["errors"] == 0 and math.isfinite(out["ttft_p50_session_over_fifo"])
