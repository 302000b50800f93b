"""Real processes on loopback: a master, two stores, and a pool client here."""

from __future__ import annotations

import asyncio
import contextlib
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
