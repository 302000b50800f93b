"""Real processes on loopback: a master, two stores, and a pool client here."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from kvpool.tools.cluster import Cluster, LocalPool
from kvpool.pool.client import PoolClient
from kvpool.transfer import HostBuffer, TransferEngine

# short liveness settings so fault tests finish quickly
FAST_MASTER = ["--segment-ttl-s", "2", "--heartbeat-interval-s", "0.5", "--put-timeout-s", "2", "--lease-s", "2"]


@pytest.fixture(scope="session")
def engine() -> TransferEngine:
    return TransferEngine()


@pytest.fixture(scope="session")
def buffer(engine: TransferEngine) -> HostBuffer:
    buf = HostBuffer(64 << 20)
    engine.register(buf.address, buf.size)
    return buf


@pytest.fixture
def pool(tmp_path) -> Iterator[LocalPool]:  # type: ignore[no-untyped-def]
    with LocalPool(num_stores=2, segment_size="8MiB", master_args=FAST_MASTER, workdir=tmp_path) as local:
        yield local


@pytest.fixture
async def client(pool: LocalPool, engine: TransferEngine, buffer: HostBuffer) -> AsyncIterator[PoolClient]:
    c = PoolClient(pool.master_address, engine)
    c.register(buffer.address, buffer.size)
    yield c
    await c.close()


async def eventually(check: Callable[[], object], timeout_s: float = 15.0, what: str = "condition") -> None:
    """Poll an async or sync check until it is truthy (state changes in other processes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def wait_for(check: Callable[[], object], timeout_s: float = 15.0, what: str = "condition") -> None:
    """``eventually`` for a test that is not async (no event loop is running)."""
    asyncio.run(eventually(check, timeout_s, what))


def metric(service, sample: str) -> float:  # type: ignore[no-untyped-def]
    """One sample (``name{labels}``) of a service's ``/metrics`` on its admin port; 0 when absent."""
    with urllib.request.urlopen(f"http://127.0.0.1:{service.ready['admin_port']}/metrics", timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    return 0.0


@contextlib.contextmanager
def front_door_cluster(workdir: Path, router_toml: str) -> Iterator[Cluster]:
    """The smallest whole cluster, for tests of the router's front door: one one-stage pipeline, one decode
    shard, no pool, started by ``kvpool up``'s launcher with ``router_toml`` as its config's [router] table."""
    from kvpool.tools.up import UpSettings, up_cluster

    config = workdir / "cluster.toml"
    config.write_text("[router]\n" + router_toml)
    up = up_cluster(UpSettings(pipelines=1, stages=1, decode_shards=1, stores=0, http_port=0, grpc_port=0,
                               device_cache_tokens=4096, workdir=str(workdir / "logs")), str(config)).start()
    try:
        yield up
    finally:
        up.stop()


def listening_ports(pid: int) -> set[int]:
    """TCP ports the process listens on (its sockets' inodes in /proc/PID/fd against /proc/PID/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def reserve(decode, token_ids: list[int], max_tokens: int, split):  # type: ignore[no-untyped-def]
    """A region with the final logits and the pages for ``token_ids``, on a shard whose model a pipeline
    split as ``split`` (layers [start, end) per stage), in the shard's own entry size and KV dtype."""
    from kvpool.rpc import decode_pb2, handoff_pb2

    stats = await decode.Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
    request = decode_pb2.ReserveRequest(num_tokens=len(token_ids), entry_bytes=stats.entry_bytes,
                                        kv_dtype=stats.kv_dtype, max_tokens=max_tokens, with_logits=True,
                                        layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in split])
    return (await decode.Reserve(request, timeout=10)).target

