"""API keys, tenants and bound sockets on a real cluster (issue 19): ``kvpool up`` with keys alice=…,bob=….

The cache must not be an oracle across tenants: bob guessing alice's PIN
learns nothing through ``cached_tokens``, while alice's own sessions still
share her prefixes; and one tenant flooding the pool evicts only its own
chunks beyond its share. One cluster for the module, its pool small (two
16 MiB segments, 768 KiB a chunk of the tiny model: 38 chunks under the high
watermark, 19 a tenant's share).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from prometheus_client.parser import text_string_to_metric_families

from kvpool.tools.certs import Identity
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpAccess, UpSettings, up_cluster
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from tests.integration.conftest import wait_for
from tests.integration.test_bindings import WILDCARDS, host_of, listening

pytestmark = pytest.mark.cluster

ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("up")
    settings = UpSettings(stages=1, stores=2, segment_size="16MiB", http_port=0, grpc_port=0,
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
    assert b"kvpool_router" in admin_metrics(cluster, "router")


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


def samples(cluster: Cluster, name: str) -> dict[tuple[str, str], float]:
    """A service's Prometheus samples by (name, its tenant or result label or "")."""
    text = admin_metrics(cluster, name).decode()
    return {(s.name, s.labels.get("tenant", s.labels.get("result", s.labels.get("reason", "")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def saves_ended(cluster: Cluster) -> float:
    """Chunks stage 0 has finished saving (stored, found stored, or not stored)."""
    got = samples(cluster, "p0-stage0")
    return sum(v for (name, _), v in got.items()
               if name in ("kvpool_prefill_saves_stored_total", "kvpool_prefill_saves_skipped_total"))


def tenants(cluster: Cluster) -> tuple[pool_pb2.StatsResponse, dict[str, pool_pb2.TenantStats]]:
    stats = asyncio.run(master_stats(cluster))
    return stats, {t.tenant: t for t in stats.tenants}


def operator(cluster: Cluster) -> tuple[Path, Identity]:
    """The cluster's CA and client certificate: keys imply mutual TLS, so an operator's tools call with them."""
    assert isinstance(cluster.access, UpAccess) and cluster.access.ca is not None and cluster.access.client
    return cluster.access.ca.ca_path, cluster.access.client


def admin_metrics(cluster: Cluster, name: str) -> bytes:
    ca, client = operator(cluster)
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(client.cert, client.key)
    admin = cluster.find(name).ready["admin_port"]
    with urllib.request.urlopen(f"https://127.0.0.1:{admin}/metrics", timeout=10, context=context) as page:
        return page.read()


async def master_stats(cluster: Cluster) -> pool_pb2.StatsResponse:
    ca, _ = operator(cluster)  # Stats wants the master or store role: the master's certificate, as docs/security.md
    master = Identity(ca, ca.with_name("master.pem"), ca.with_name("master.key"))
    creds = grpc.ssl_channel_credentials(ca.read_bytes(), master.key.read_bytes(), master.cert.read_bytes())
    async with grpc.aio.secure_channel(cluster.master_address, creds) as channel:
        return await pool_pb2_grpc.PoolMasterStub(channel).Stats(pool_pb2.StatsRequest(), timeout=10)


def flood_prompt(i: int) -> str:
    # 2,100 bytes, 8 full chunks; no two share a first chunk
    return f"Flood number {i:03d}. " + "All work and no play makes Jack a dull boy. " * 47


def test_a_flooding_tenant_evicts_only_its_own_oldest_chunks(cluster: Cluster) -> None:
    history = "Bob's long session: the design review notes. " * 12  # 552 bytes, 2 chunks
    saved = saves_ended(cluster)
    assert cached(cluster, BOB, history, "bob-history") == 0
    wait_for(lambda: saves_ended(cluster) >= saved + 2, what="bob's saves")
    stats, before = tenants(cluster)
    bob = before["bob"]
    assert 0 < bob.bytes < bob.share_bytes  # bob within his share
    for i in range(6):  # 48 chunks of alice: past her share, past the whole pool
        assert cached(cluster, ALICE, flood_prompt(i), f"flood-{i}") == 0
    wait_for(lambda: saves_ended(cluster) >= saved + 2 + 48, what="alice's saves")
    stats, after = tenants(cluster)
    none = pool_pb2.TenantStats()
    assert after["alice"].evicted_groups - before.get("alice", none).evicted_groups >= 8
    assert after["bob"].evicted_groups == bob.evicted_groups == 0
    assert after["bob"].bytes == bob.bytes
    assert stats.used_bytes > 0.8 * stats.capacity_bytes  # the pool did fill
    # bob's earlier session still finds his history; alice's newest flood is whole, her oldest gone
    assert cached(cluster, BOB, history, "bob-history") == 512
    assert cached(cluster, ALICE, flood_prompt(5), "flood-5") == 2048
    assert cached(cluster, ALICE, flood_prompt(0), "flood-0") == 0
    # stage 0's device cache counts each tenant's blocks, and the master each tenant's bytes
    device = samples(cluster, "p0-stage0")
    assert device[("kvpool_prefill_tenant_device_blocks", "alice")] > 0
    wait_for(lambda: samples(cluster, "master").get(("kvpool_pool_tenant_bytes", "bob")) == bob.bytes,
             what="the master's gauges (refreshed each second)")


def test_no_socket_of_the_cluster_listens_on_a_wildcard_address(cluster: Cluster) -> None:
    pids = {int(p.ready["pid"]) for p in cluster.services}
    assert len(pids) == 6  # master, 2 stores, 1 stage, decode, router
    sockets = listening(pids)
    assert [s for s in sockets if host_of(s[1]) in WILDCARDS] == []
    assert {host_of(s[1]) for s in sockets} <= {"127.0.0.1", "[::ffff:127.0.0.1]"}
    # one host, keys and mutual TLS: no transfer engine anywhere (shared memory carries every bulk byte), so
    # the only ports are each service's gRPC and admin port and the router's HTTP port (issue 36)
    declared = {int(p.ready[key]) for p in cluster.services for key in ("port", "admin_port", "http_port")
                if key in p.ready}
    assert {int(s[1].rsplit(":", 1)[1]) for s in sockets} == declared
    assert len(sockets) == len(declared) == 2 * len(pids) + 1
