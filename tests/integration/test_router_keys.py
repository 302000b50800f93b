"""One keyed router's front door (issue 35): gRPC needs a key too, keys reload on SIGHUP, ``/health`` tells a
keyless caller only whether the cluster serves, no key on the command line, keyless sockets cannot lock a keyed
client out, and each key holds a bounded number of open requests.

One small cluster (a one-stage pipeline, one decode shard, no pool) whose router reads its keys from a file
(``api_keys_file``) and bounds each key to ``MAX_PER_KEY`` open requests.
"""

from __future__ import annotations

import http.client
import json
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.tools.cluster import Cluster
from tests.integration.conftest import front_door_cluster, wait_for

pytestmark = pytest.mark.cluster

ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-9876543210", "sk-carol-55555555"
MAX_PER_KEY = 2
FLOOD = 4096


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api_keys"
    path.write_text(f"alice={ALICE}\nbob={BOB}\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, keys_file: Path) -> Iterator[Cluster]:
    with front_door_cluster(tmp_path_factory.mktemp("router-keys"),
                            f'api_keys_file = "{keys_file}"\nmax_requests_per_key = {MAX_PER_KEY}\n') as up:
        yield up


def call(cluster: Cluster, method: str, path: str, key: str = "", body: dict[str, Any] | None = None,
         ) -> tuple[int, dict[str, str], dict[str, Any]]:
    host, port = cluster.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, json.dumps(body) if body is not None else None, headers)
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, answer


def generate(cluster: Cluster, metadata: tuple[tuple[str, str], ...], token_ids: list[int] | None = None,
             session_key: str = "") -> router_pb2.GenerateUsage:
    request = router_pb2.GenerateRequest(token_ids=token_ids or [5, 6, 7, 8], session_key=session_key,
                                         sampling=router_pb2.SamplingParams(max_tokens=2))
    with grpc.insecure_channel(f"127.0.0.1:{cluster.find('router').ready['port']}") as channel:
        replies = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60, metadata=metadata))
    return replies[-1].usage


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def refused_code(cluster: Cluster, metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        generate(cluster, metadata)
    return caught.value.code(), caught.value.details()


def test_grpc_without_a_valid_key_is_unauthenticated_and_names_the_metadata(cluster: Cluster) -> None:
    code, details = refused_code(cluster, ())
    assert code == grpc.StatusCode.UNAUTHENTICATED and "'authorization: Bearer KEY'" in details
    code, details = refused_code(cluster, bearer("sk-alice-0123456780"))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "'authorization'" in details
    assert generate(cluster, bearer(ALICE)).completion_tokens == 2


def test_over_grpc_the_keys_tenant_is_the_requests_so_no_cache_hit_crosses_tenants(cluster: Cluster) -> None:
    prompt = [(i * 7) % 250 + 1 for i in range(768)]
    assert generate(cluster, bearer(ALICE), prompt, "alice-1").device_tokens == 0
    assert generate(cluster, bearer(BOB), prompt, "bob-1").device_tokens == 0  # not alice's prefix
    assert generate(cluster, bearer(ALICE), prompt, "alice-2").device_tokens > 0  # alice's own prefix is cached
    assert generate(cluster, bearer(BOB), prompt, "bob-2").device_tokens > 0  # bob's repeat: a hit was possible


def test_health_without_a_key_says_only_whether_the_cluster_serves(cluster: Cluster) -> None:
    status, _, body = call(cluster, "GET", "/health")
    assert (status, body) == (200, {"status": "ok"})
    status, _, body = call(cluster, "GET", "/health", key="sk-alice-0123456780")
    assert (status, body) == (200, {"status": "ok"})
    status, _, body = call(cluster, "GET", "/health", key=ALICE)
    assert status == 200 and body["status"] == "ok" and body["targets"] and all(body["targets"].values())


def test_sighup_reloads_the_keys_file_and_a_broken_file_keeps_the_keys(cluster: Cluster, keys_file: Path) -> None:
    router = cluster.find("router")
    assert call(cluster, "GET", "/v1/models", key=CAROL)[0] == 401
    keys_file.write_text(f"alice={ALICE}\ncarol={CAROL}\n")  # carol in, bob out
    router.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: call(cluster, "GET", "/v1/models", key=CAROL)[0] == 200, what="carol's key in force")
    assert call(cluster, "GET", "/v1/models", key=BOB)[0] == 401
    assert refused_code(cluster, bearer(BOB))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert generate(cluster, bearer(CAROL)).completion_tokens == 2
    keys_file.write_text("carol=short\n")
    router.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "api_keys_reload_failed" in router.log_file.read_text(), what="the failed reload logged")
    assert "shorter than 8" in router.log_file.read_text()
    assert call(cluster, "GET", "/v1/models", key=CAROL)[0] == 200
    keys_file.write_text(f"alice={ALICE}\nbob={BOB}\n")
    router.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: call(cluster, "GET", "/v1/models", key=BOB)[0] == 200, what="bob's key back")


def test_a_key_on_the_routers_command_line_is_refused_naming_the_file_option() -> None:
    run = subprocess.run([sys.executable, "-m", "kvpool.services.cli", "router", "--api-key", f"alice={ALICE}",
                          "--pipelines", "127.0.0.1:1", "--shards", "127.0.0.1:2"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "/proc/PID/cmdline" in run.stderr and "--api-keys-file PATH" in run.stderr
    assert "KVPOOL_API_KEY" in run.stderr and ALICE not in run.stderr


def test_a_keyed_client_is_served_while_one_address_holds_4096_keyless_connections(cluster: Cluster) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 256:
        pytest.skip(f"the open-file hard limit {hard} is below {FLOOD + 256}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 256), hard))
    port = cluster.find("router").ready["http_port"]
    flood = []
    try:
        for _ in range(FLOOD):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        status, _, body = call(cluster, "POST", "/v1/completions", key=ALICE,
                               body={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert status == 200, body
        assert call(cluster, "GET", "/v1/models", key=BOB)[0] == 200
    finally:
        for sock in flood:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_key_past_its_bound_of_open_requests_gets_429_and_resource_exhausted(cluster: Cluster) -> None:
    port = cluster.find("router").ready["http_port"]
    held = []
    try:
        for _ in range(MAX_PER_KEY):  # a head whose body never comes: open until the body deadline
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
                         "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode())
            held.append(sock)
        def refused() -> bool:
            return call(cluster, "GET", "/v1/models", key=ALICE)[0] == 429
        wait_for(refused, what="alice's requests open")
        status, headers, body = call(cluster, "GET", "/v1/models", key=ALICE)
        assert status == 429 and headers["retry-after"] == "1"
        assert body["error"]["code"] == "too_many_open_requests" and "--max-requests-per-key" in body["error"]["message"]
        code, details = refused_code(cluster, bearer(ALICE))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-requests-per-key" in details
        assert call(cluster, "GET", "/v1/models", key=BOB)[0] == 200  # another key is not held back
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: call(cluster, "GET", "/v1/models", key=ALICE)[0] == 200, what="alice's places freed")
