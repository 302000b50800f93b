"""Another local user against a running ``kvpool up`` (issue 36): uid 65534, holding no file of the cluster.

``kvpool up`` on its defaults, keys off: one host, so no transfer engine anywhere. Its processes listen on no
TCP port but each service's gRPC and admin port and the router's HTTP port, so there is no engine to read
from or write into. The attacker then tries every Unix socket on the host, asking each for every shared
segment by name (stores' segments, decode's receive arena, the stages' send arenas), and every process's
/proc/PID/fd and map_files, and gets no descriptor and no file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from kvpool.services.decode.shard import ARENA_NAME
from kvpool.services.prefill.pieces import SEND_ARENA
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.integration.test_bindings import listening
from tests.integration.test_shared_memory_attack import ATTACK

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                 reason="acting as another local user needs root and setpriv")]

SECRET = "kvpool-up-secret-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    settings = UpSettings(stages=2, stores=1, segment_size="32MiB", http_port=0, grpc_port=0,
                          device_cache_tokens=2048, workdir=str(tmp_path_factory.mktemp("up")))
    up = up_cluster(settings).start()
    try:
        yield up
    finally:
        up.stop()


def test_only_the_declared_ports_listen(cluster: Cluster) -> None:
    pids = {int(p.ready["pid"]) for p in cluster.services}
    sockets = listening(pids)
    declared = {int(p.ready[key]) for p in cluster.services for key in ("port", "admin_port", "http_port")
                if key in p.ready}
    assert {int(s[1].rsplit(":", 1)[1]) for s in sockets if s[0] == "tcp"} == declared
    assert all(p.ready.get("endpoint", "") == "" for p in cluster.services)  # no engine was started


def test_another_user_gets_no_shared_memory_of_a_serving_cluster(cluster: Cluster) -> None:
    body = json.dumps({"model": "tiny", "prompt": SECRET * 40, "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"{cluster.http_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200  # its KV now sits in the stages' pages, the pool and decode
    pids = ",".join(str(p.ready["pid"]) for p in cluster.services)
    names = ",".join([*(p.ready["segment_id"] for p in cluster.services if "segment_id" in p.ready),
                      ARENA_NAME, SEND_ARENA])
    done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                           sys.executable, "-c", ATTACK, SECRET, pids, names],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sockets_tried"] > 0
    assert (result["fds_received"], result["opened"], result["secret_seen"]) == (0, [], False)
