"""Nothing a cluster starts listens on a wildcard address (issue 19).

The stock transfer engine binds every interface; kvpool/native/bind_shim.c,
preloaded by every engine-owning role, rewrites those binds to the configured
transfer host. One ``kvpool up`` cluster for the module: every listening
socket of its processes is read with ``ss`` and checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import bind_shim
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster


WILDCARDS = {"0.0.0.0", "*", "[::]", "::", "[::ffff:0.0.0.0]"}


def listening(pids: set[int]) -> list[tuple[str, str, int]]:
    """(protocol, local address, pid) of every listening TCP socket and bound UDP socket of ``pids``."""
    found = []
    for proto, flag in (("tcp", "-ltnpH"), ("udp", "-lunpH")):
        out = subprocess.run(["ss", flag], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            fields = line.split()
            for pid in pids:
                if f"pid={pid}," in line:
                    found.append((proto, fields[3], pid))
    return found


def host_of(local: str) -> str:
    host = local.rsplit(":", 1)[0]
    return host.split("%", 1)[0]  # 127.0.0.1%lo: bound to a device as well


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("up")
    settings = UpSettings(stages=1, stores=2, segment_size="32MiB", http_port=0, grpc_port=0,
                          device_cache_tokens=2048, workdir=str(workdir))
    up = up_cluster(settings).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.mark.cluster
def test_no_socket_of_a_default_cluster_listens_on_a_wildcard_address(cluster: Cluster) -> None:
    pids = {int(p.ready["pid"]) for p in cluster.services}
    assert len(pids) == 6  # master, 2 stores, 1 stage, decode, router
    sockets = listening(pids)
    engines = {p.name for p in cluster.services} - {"master", "router"}
    assert engines == {"store0", "store1", "p0-stage0", "decode0"}
    # each engine listens twice (handshake and TCP transport), each service for gRPC and metrics
    assert len(sockets) >= 2 * len(engines) + 2 * len(pids)
    wide = [s for s in sockets if host_of(s[1]) in WILDCARDS]
    assert wide == []
    assert {host_of(s[1]) for s in sockets} <= {"127.0.0.1", "[::ffff:127.0.0.1]"}


@pytest.mark.cluster
def test_bytes_still_move_between_engines(cluster: Cluster) -> None:
    """A completion crosses the prefill → decode handoff; the pool's save and restore cross the stores."""
    body = json.dumps({"model": "tiny", "prompt": "x" * 600, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{cluster.http_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["usage"]["completion_tokens"] == 4


SNIPPET = """
import ctypes, socket, sys
out = []
for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"), (socket.AF_INET, "127.0.0.2")):
    with socket.socket(family) as s:
        s.bind((host, 0))
        out.append(s.getsockname()[0])
print(",".join(out))
"""


@pytest.mark.cluster
def test_the_shim_rewrites_wildcard_binds_and_leaves_named_ones(tmp_path: Path) -> None:
    path = bind_shim.build()
    env = {**os.environ, "LD_PRELOAD": str(path), bind_shim.ADDRESS_ENV: "127.0.0.1"}
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "127.0.0.1,::ffff:127.0.0.1,127.0.0.2"
    # without an address it passes every bind through: the control that proves the check can fail
    env.pop(bind_shim.ADDRESS_ENV)
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.0.0.0,::,127.0.0.2"


def test_a_wildcard_transfer_host_is_refused() -> None:
    with pytest.raises(ValueError, match="wildcard"):
        bind_shim.bind_address("0.0.0.0")
    assert bind_shim.bind_address("::1") == "::1"
    assert bind_shim.bind_address("localhost") in {"127.0.0.1", "::1"}
