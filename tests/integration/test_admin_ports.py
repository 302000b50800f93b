"""A secure cluster's admin ports (issue 35): every service's ``/metrics`` over mutual TLS, read only by a
certificate of a reading role; the tenants' series are there for it and for nobody else.

One ``kvpool up --secure`` cluster with two tenants' keys; its throwaway CA issues the certificates the
test scrapes with, so each role is tried as itself.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.request
from collections.abc import Iterator

import pytest

from kvpool.tools.certs import Identity, ThrowawayCA
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpAccess, UpSettings, up_cluster
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.cluster

ALICE = "sk-admin-alice-0123456789"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    settings = UpSettings(stages=2, stores=1, segment_size="32MiB", http_port=0, grpc_port=0,
                          device_cache_tokens=2048, api_key=[f"alice={ALICE}"], secure=True,
                          workdir=str(tmp_path_factory.mktemp("up")))
    up = up_cluster(settings).start()
    try:
        yield up
    finally:
        up.stop()


def authority(cluster: Cluster) -> ThrowawayCA:
    assert isinstance(cluster.access, UpAccess) and cluster.access.ca is not None
    return cluster.access.ca


def scrape(port: int, ca: ThrowawayCA, who: Identity | None) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(ca.ca_path))
    if who is not None:
        context.load_cert_chain(str(who.cert), str(who.key))
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def test_every_admin_port_wants_a_certificate_of_a_reading_role(cluster: Cluster) -> None:
    ca = authority(cluster)
    monitor, decode = ca.issue("monitor"), ca.issue("decode", file_stem="test-decode")
    for proc in cluster.services:
        port = proc.ready["admin_port"]
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # plaintext: no TLS, no answer
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
                page.read()
        with pytest.raises((ssl.SSLError, ConnectionError)):  # TLS without a client certificate
            scrape(port, ca, None)
        status, text = scrape(port, ca, decode)  # a member of the cluster, but not a reader
        assert status == 403 and "needs the client or monitor role" in text, proc.name
        status, text = scrape(port, ca, monitor)
        assert status == 200 and "# TYPE" in text, proc.name


def test_a_monitor_scrape_sees_the_tenants_series(cluster: Cluster) -> None:
    body = json.dumps({"model": "tiny", "prompt": "z" * 700, "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"{cluster.http_url}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {ALICE}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
    ca = authority(cluster)
    monitor = ca.issue("monitor")
    master = cluster.find("master").ready["admin_port"]
    wait_for(lambda: 'kvpool_pool_tenant_bytes{tenant="alice"}' in scrape(master, ca, monitor)[1],
             what="alice's bytes in the master's metrics")
    stage0 = cluster.find("p0-stage0").ready["admin_port"]
    assert 'kvpool_prefill_tenant_device_blocks{tenant="alice"}' in scrape(stage0, ca, monitor)[1]
