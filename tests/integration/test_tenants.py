"""API keys, tenants and bound sockets on a real cluster (issue 19): ``kvpool up --api-key alice=…,bob=…``.

The cache must not be an oracle across tenants: bob guessing alice's PIN
learns nothing through ``cached_tokens``, while alice's own sessions still
share her prefixes. One cluster for the module.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from tests.integration.test_bindings import WILDCARDS, host_of, listening

pytestmark = pytest.mark.cluster

ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("up")
    settings = UpSettings(stages=1, stores=2, segment_size="32MiB", http_port=0, grpc_port=0,
                          device_cache_tokens=4096, api_key=[f"alice={ALICE}", f"bob={BOB}"], workdir=str(workdir))
    up = up_cluster(settings).start()
    try:
        yield up
    finally:
        up.stop()


def call(url: str, path: str, body: dict[str, Any] | None = None, key: str = "",
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def cached(cluster: Cluster, key: str, prompt: str, session: str, **extra: Any) -> int:
    status, answer = call(cluster.http_url, "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_cache_key": session, **extra,
    }, key)
    assert status == 200, answer
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def secret(pin: str) -> str:
    # the PIN sits in the first 256-token chunk; two full chunks are cached
    return f"My bank PIN is {pin}. Remember it. " + "Notes follow. " * 40


def test_a_completion_needs_a_key(cluster: Cluster) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
    status, answer = call(cluster.http_url, "/v1/completions", body)
    assert status == 401 and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"].startswith("You didn't provide an API key.")
    status, answer = call(cluster.http_url, "/v1/completions", body, key="sk-bogus-000000000")
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    status, answer = call(cluster.http_url, "/v1/models")
    assert status == 401
    # a browser page elsewhere cannot drive the API, not even with a simple text/plain POST
    status, answer = call(cluster.http_url, "/v1/completions", body, key=ALICE,
                          headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert status == 403 and answer["error"]["code"] == "cross_origin_refused"
    status, answer = call(cluster.http_url, "/v1/completions", body, key=ALICE)
    assert status == 200 and answer["usage"]["completion_tokens"] == 1


def test_health_is_open_and_metrics_are_on_the_admin_port_only(cluster: Cluster) -> None:
    status, health = call(cluster.http_url, "/health")
    assert status == 200 and health["status"] == "ok"
    status, _ = call(cluster.http_url, "/metrics", key=ALICE)
    assert status == 404
    admin = cluster.find("router").ready["admin_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as page:
        assert b"kvpool_router" in page.read()


def test_another_tenant_learns_nothing_from_cached_tokens(cluster: Cluster) -> None:
    assert cached(cluster, ALICE, secret("4821"), "alice-session") == 0
    guesses = ["1111", "4821", "9999", "0000", "4822", "1234"]
    seen = {pin: cached(cluster, BOB, secret(pin), f"bob-{pin}") for pin in guesses}
    assert seen == dict.fromkeys(guesses, 0)
    # within alice's tenant a new session shares her prefix
    assert cached(cluster, ALICE, secret("4821"), "alice-other-session") == 512
    assert cached(cluster, ALICE, secret("4822"), "alice-third-session") == 0
    # bob's own repeat is served from his cache: the probe could have seen a hit
    assert cached(cluster, BOB, secret("4821"), "bob-again") == 512


def test_a_cache_salt_separates_requests_of_one_tenant(cluster: Cluster) -> None:
    prompt = "A salted prompt. " * 40
    assert cached(cluster, ALICE, prompt, "salt-1", cache_salt="project-a") == 0
    assert cached(cluster, ALICE, prompt, "salt-2", cache_salt="project-b") == 0
    assert cached(cluster, ALICE, prompt, "salt-3") == 0
    assert cached(cluster, ALICE, prompt, "salt-4", cache_salt="project-a") == 512
    status, answer = call(cluster.http_url, "/v1/completions",
                          {"model": "tiny", "prompt": "x", "cache_salt": 5}, ALICE)
    assert status == 400 and answer["error"]["param"] == "cache_salt"


def test_no_socket_of_the_cluster_listens_on_a_wildcard_address(cluster: Cluster) -> None:
    pids = {int(p.ready["pid"]) for p in cluster.services}
    assert len(pids) == 6  # master, 2 stores, 1 stage, decode, router
    sockets = listening(pids)
    engines = {p.name for p in cluster.services} - {"master", "router"}
    assert engines == {"store0", "store1", "p0-stage0", "decode0"}
    # each engine listens twice (handshake and TCP transport), each service for gRPC and metrics
    assert len(sockets) >= 2 * len(engines) + 2 * len(pids)
    assert [s for s in sockets if host_of(s[1]) in WILDCARDS] == []
    assert {host_of(s[1]) for s in sockets} <= {"127.0.0.1", "[::ffff:127.0.0.1]"}
