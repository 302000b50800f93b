"""Slow and silent HTTP clients cannot hold the router's connections (slowloris), nor can a flood of them.

One small cluster (a one-stage pipeline, one decode shard, no pool) whose router bounds a request's head
and body to 3 s (``http_read_timeout_s``) and its open connections to 6 (``http_max_connections``). Raw
sockets play the attacker: a connection that sends nothing is closed, one that trickles header lines or
its body gets a 408 in OpenAI's shape and is closed, the seventh connection at once gets a 429 with
Retry-After, and so does a fifth from one address (``http_max_connections_per_client`` 4: the other
loopback addresses, 127.0.0.2 and up, play other clients); each is counted by reason. On the gRPC port,
calls held open (health watches here) count against ``grpc_max_concurrent_rpcs`` (3): one more is
RESOURCE_EXHAUSTED at once. A well-behaved client is served throughout and afterwards.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.tools.cluster import Cluster
from tests.integration.conftest import front_door_cluster, wait_for

pytestmark = pytest.mark.cluster

READ_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 6
MAX_PER_CLIENT = 4
MAX_RPCS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with front_door_cluster(tmp_path_factory.mktemp("connections"), (
            f"http_read_timeout_s = {READ_TIMEOUT_S}\nhttp_max_connections = {MAX_CONNECTIONS}\n"
            f"http_max_connections_per_client = {MAX_PER_CLIENT}\ngrpc_max_concurrent_rpcs = {MAX_RPCS}\n")) as up:
        yield up


def connect(cluster: Cluster, client: int = 1) -> socket.socket:
    """A connection from loopback address 127.0.0.``client``: each is another client to the router."""
    return socket.create_connection(("127.0.0.1", cluster.find("router").ready["http_port"]), timeout=30,
                                    source_address=(f"127.0.0.{client}", 0))


def answer(sock: socket.socket) -> bytes:
    """Everything the router sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def metrics(cluster: Cluster) -> list[str]:
    port = cluster.find("router").ready["admin_port"]
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode().splitlines()


def refused(cluster: Cluster) -> dict[str, float]:
    counts = {"connections": 0.0, "client_connections": 0.0, "head_timeout": 0.0, "body_timeout": 0.0}
    for line in metrics(cluster):
        if line.startswith("kvpool_router_http_refused_total{"):
            counts[line.split('"')[1]] = float(line.split()[-1])
    return counts


def open_connections(cluster: Cluster) -> float:
    return next(float(line.split()[-1]) for line in metrics(cluster) if line.startswith("kvpool_router_http_connections "))


def error_of(response: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)["error"]


def served(cluster: Cluster) -> None:
    host, port = cluster.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    conn.close()


def test_a_silent_connection_is_closed(cluster: Cluster) -> None:
    before = refused(cluster)["head_timeout"]
    with connect(cluster) as sock:
        started = time.monotonic()
        assert answer(sock) == b""  # nothing came: nothing to answer
        assert READ_TIMEOUT_S - 0.5 <= time.monotonic() - started < READ_TIMEOUT_S + 10
    assert refused(cluster)["head_timeout"] == before + 1
    served(cluster)


def test_trickled_header_lines_get_a_408(cluster: Cluster) -> None:
    before = refused(cluster)["head_timeout"]
    with connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        # a header line every quarter second, so the head never ends, until the router answers
        while not select.select([sock], [], [], 0.25)[0]:
            assert time.monotonic() - started < READ_TIMEOUT_S + 10, "the router kept a trickling head open"
            sock.sendall(b"X-Slow: 1\r\n")
        response = answer(sock)
    status, headers, error = error_of(response)
    assert status == 408 and headers["connection"] == "close"
    assert error["code"] == "request_timeout" and "--http-read-timeout-s" in str(error["message"])
    assert refused(cluster)["head_timeout"] == before + 1
    served(cluster)


def test_a_trickled_body_gets_a_408(cluster: Cluster) -> None:
    before = refused(cluster)["body_timeout"]
    with connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")  # 9 of the 100 bytes, and no more
        response = answer(sock)
    status, headers, error = error_of(response)
    assert status == 408 and error["code"] == "request_timeout" and "body" in str(error["message"])
    assert refused(cluster)["body_timeout"] == before + 1
    served(cluster)


def test_one_connection_past_the_bound_gets_a_429_at_once(cluster: Cluster) -> None:
    wait_for(lambda: open_connections(cluster) == 0, what="the earlier tests' connections closed")
    before = refused(cluster)["connections"]
    held = [connect(cluster, 2 + k) for k in range(MAX_CONNECTIONS)]  # each from its own address
    try:
        wait_for(lambda: open_connections(cluster) == MAX_CONNECTIONS, what="the held connections open")
        with connect(cluster, 2 + MAX_CONNECTIONS) as extra:
            started = time.monotonic()
            response = answer(extra)
            assert time.monotonic() - started < READ_TIMEOUT_S  # turned away at once, not timed out
        status, headers, error = error_of(response)
        assert status == 429 and headers["retry-after"] == "1" and error["code"] == "overloaded"
        assert refused(cluster)["connections"] == before + 1
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: open_connections(cluster) == 0, what="the held connections closed")
    served(cluster)  # the bound counts open connections: closed ones free their places


def test_one_connection_past_a_clients_bound_gets_a_429_and_other_clients_are_served(cluster: Cluster) -> None:
    wait_for(lambda: open_connections(cluster) == 0, what="the earlier tests' connections closed")
    before = refused(cluster)
    held = [connect(cluster, 1) for _ in range(MAX_PER_CLIENT)]
    try:
        wait_for(lambda: open_connections(cluster) == MAX_PER_CLIENT, what="the held connections open")
        with connect(cluster, 1) as extra:
            status, headers, error = error_of(answer(extra))
        assert status == 429 and headers["retry-after"] == "1" and error["code"] == "overloaded"
        assert "--http-max-connections-per-client" in str(error["message"])
        with connect(cluster, 9) as other:  # another address still has its places
            other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answer(other).startswith(b"HTTP/1.1 200 ")
        after = refused(cluster)
        assert after["client_connections"] == before["client_connections"] + 1
        assert after["connections"] == before["connections"]
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: open_connections(cluster) == 0, what="the held connections closed")
    with connect(cluster, 1) as again:  # the address's closed connections freed its places
        again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert answer(again).startswith(b"HTTP/1.1 200 ")


def test_one_grpc_call_past_the_bound_is_resource_exhausted(cluster: Cluster) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.find('router').ready['port']}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(MAX_RPCS)]
        try:
            for watch in watches:  # each sends the status at once: every one is open on the router now
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:
                health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for watch in watches:
                watch.cancel()

        def checks() -> bool:
            try:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

        wait_for(checks, what="the cancelled watches' places free")
        request = router_pb2.GenerateRequest(text="hi", sampling=router_pb2.SamplingParams(max_tokens=2))
        events = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60))
        assert sum(e.WhichOneof("event") == "token_id" for e in events) == 2
    served(cluster)
