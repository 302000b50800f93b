"""``kvpool up --secure`` with API keys: mutual TLS everywhere, roles gate the control plane (issue 19).

One secure cluster for the module. Its throwaway CA also issues the
certificates the tests call with, so each role is tried as itself.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvpool import tls
from kvpool.pool.session_client import MasterSession
from kvpool.rpc import pool_pb2, pool_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2, router_pb2_grpc
from kvpool.tools.bench.prefill_replay import _pool_stats
from kvpool.tools.certs import Identity, ThrowawayCA
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpAccess, UpSettings, up_cluster

pytestmark = pytest.mark.cluster

KEY = "sk-secure-0123456789"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("up")
    settings = UpSettings(stages=2, stores=2, segment_size="32MiB", http_port=0, grpc_port=0,
                          device_cache_tokens=2048, api_key=[KEY], secure=True, workdir=str(workdir))
    up = up_cluster(settings).start()
    try:
        yield up
    finally:
        up.stop()


def access(cluster: Cluster) -> UpAccess:
    assert isinstance(cluster.access, UpAccess)
    return cluster.access


def address(cluster: Cluster, name: str) -> str:
    return f"127.0.0.1:{cluster.find(name).ready['port']}"


def secure(target: str, who: Identity | None, ca: Path) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=who.key.read_bytes() if who else None,
        certificate_chain=who.cert.read_bytes() if who else None,
    )
    return grpc.aio.secure_channel(target, creds)


async def unmount(channel: grpc.aio.Channel, segment_id: str) -> grpc.StatusCode:
    async with channel:
        try:
            await pool_pb2_grpc.PoolMasterStub(channel).UnmountSegment(
                pool_pb2.UnmountSegmentRequest(segment_id=segment_id), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_completion_runs_over_mutual_tls(cluster: Cluster) -> None:
    body = json.dumps({"model": "tiny", "prompt": "y" * 600, "max_tokens": 3, "temperature": 0}).encode()
    request = urllib.request.Request(f"{cluster.http_url}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 3


async def test_no_certificate_no_call(cluster: Cluster) -> None:
    master = address(cluster, "master")
    assert access(cluster).ca is not None
    # plaintext, and TLS without a client certificate, both fail before any method runs
    assert await unmount(grpc.aio.insecure_channel(master), "up-store0") == grpc.StatusCode.UNAVAILABLE
    assert await unmount(secure(master, None, access(cluster).ca.ca_path), "up-store0") == grpc.StatusCode.UNAVAILABLE


async def test_a_certificate_of_another_ca_is_refused_whatever_it_claims(cluster: Cluster, tmp_path: Path) -> None:
    forger = ThrowawayCA(tmp_path / "forged")
    fake_master = forger.issue("master")
    assert access(cluster).ca is not None
    channel = secure(address(cluster, "master"), fake_master, access(cluster).ca.ca_path)
    assert await unmount(channel, "up-store0") == grpc.StatusCode.UNAVAILABLE


async def test_roles_gate_admin_calls_and_a_store_unmounts_only_its_own(cluster: Cluster) -> None:
    ca = access(cluster).ca
    assert ca is not None
    master = address(cluster, "master")
    for role in ("prefill", "decode", "router", "client"):
        assert await unmount(secure(master, ca.issue(role, f"t-{role}"), ca.ca_path), "up-store0") == \
            grpc.StatusCode.PERMISSION_DENIED
    other_store = ca.issue("store/up-store1", "t-store1")
    assert await unmount(secure(master, other_store, ca.ca_path), "up-store0") == grpc.StatusCode.PERMISSION_DENIED
    # the pool still has both segments
    async with secure(master, ca.issue("master", "t-master"), ca.ca_path) as channel:
        stats = await pool_pb2_grpc.PoolMasterStub(channel).Stats(pool_pb2.StatsRequest(), timeout=5)
    assert len(stats.segments) == 2


async def test_only_a_prefill_stage_or_the_master_opens_a_pool_session(cluster: Cluster) -> None:
    """The master's Session carries lookups and puts: another role is refused before any message is read, and
    a prefill certificate's session is answered."""
    ca = access(cluster).ca
    assert ca is not None
    master = address(cluster, "master")
    lookup = pool_pb2.SessionRequest(call=1, lookup=pool_pb2.LookupRequest(group_ids=["nothing-here"]))
    for role in ("decode", "router", "client", "store/up-store0"):
        async with secure(master, ca.issue(role, f"s-{role.replace('/', '-')}"), ca.ca_path) as channel:
            session = pool_pb2_grpc.PoolMasterStub(channel).Session(timeout=10)
            # refused as it opens (a write racing the refusal fails with a client-side send error instead)
            code, details = await session.code(), await session.details()
        assert code == grpc.StatusCode.PERMISSION_DENIED, (role, details)
        assert "Session: needs the master or prefill role" in details, details
        # the pool client's session reports the master's refusal as such, whichever of its writes met it
        async with secure(master, ca.issue(role, f"t-{role.replace('/', '-')}"), ca.ca_path) as channel:
            stub = pool_pb2_grpc.PoolMasterStub(channel)
            session_client = MasterSession(channel, stub)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await session_client.call("lookup", lookup.lookup, stub.Lookup, timeout=10)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
            finally:
                await session_client.close()
    async with secure(master, ca.issue("prefill", "s-prefill"), ca.ca_path) as channel:
        session = pool_pb2_grpc.PoolMasterStub(channel).Session(timeout=10)
        await session.write(lookup)
        answer = await session.read()
    assert (answer.call, answer.code, answer.lookup.num_complete) == (1, 0, 0) and answer.HasField("lookup")


async def test_only_the_router_and_decode_call_prefill_and_clients_call_generate(cluster: Cluster) -> None:
    ca = access(cluster).ca
    assert ca is not None and access(cluster).client is not None
    async with secure(address(cluster, "p0-stage0"), access(cluster).client, ca.ca_path) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(token_ids=[1, 2]),
                                                                timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with secure(address(cluster, "router"), access(cluster).client, ca.ca_path) as channel:
        request = router_pb2.GenerateRequest(text="hello", sampling=router_pb2.SamplingParams(max_tokens=2))
        replies = [r async for r in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60)]
    assert replies[-1].usage.completion_tokens == 2


async def test_only_a_prefill_stage_streams_pieces_into_a_stage(cluster: Cluster) -> None:
    """ForwardPieces writes KV into a stage's pages: a client's or the router's certificate is refused before
    any piece is read, and the stage still serves its own pipeline."""
    ca = access(cluster).ca
    assert ca is not None
    piece = prefill_pb2.ForwardRequest(request_id="x", block_table=[0], num_tokens=16, piece_start=0, piece_end=16,
                                       activation=prefill_pb2.Activation(num_tokens=16, hidden_size=1))
    for who in (access(cluster).client, ca.issue("router", "t-router")):
        async with secure(address(cluster, "p0-stage1"), who, ca.ca_path) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await prefill_pb2_grpc.PrefillStageStub(channel).ForwardPieces(iter([piece]), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (who, info.value.details())
    test_a_completion_runs_over_mutual_tls(cluster)


async def test_a_bench_client_dials_with_the_process_identity(cluster: Cluster) -> None:
    # the benchmarks' channels are kvpool.service.channel: plaintext unless the process has an identity
    ca = access(cluster).ca
    assert ca is not None
    master = address(cluster, "master")
    with pytest.raises(grpc.aio.AioRpcError) as plaintext:
        await _pool_stats(master)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    bench = ca.issue("master", "t-bench")
    tls.configure(tls.SecuritySettings(ca=str(bench.ca), cert=str(bench.cert), key=str(bench.key)))
    try:
        stats = await _pool_stats(master)
    finally:
        tls.configure(tls.SecuritySettings(ca="", cert="", key=""))
    assert stats["capacity_bytes"] == 2 * 32 * 2**20  # both stores' 32 MiB segments
