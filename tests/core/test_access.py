"""Who may call what: the control plane's role policy."""

from __future__ import annotations

import pytest

from kvpool.core.tenancy.access import POLICY, ROLES, Peer, authorize, authorize_admin
from kvpool.core.errors import PermissionDenied
from kvpool.rpc import decode_pb2, handoff_pb2, pool_pb2, prefill_pb2, router_pb2

POOL = "/kvpool.rpc.PoolMaster/"


def allowed(method: str, peer: Peer, segment_id: str | None = None) -> bool:
    try:
        authorize(method, peer, segment_id)
    except PermissionDenied:
        return False
    return True


def admin_allowed(peer: Peer) -> bool:
    try:
        authorize_admin(peer)
    except PermissionDenied:
        return False
    return True


def test_only_store_and_master_mount_and_unmount_and_a_store_only_its_own() -> None:
    for method in ("MountSegment", "UnmountSegment", "Heartbeat"):
        assert allowed(POOL + method, Peer("store", "s1"), "s1")
        assert not allowed(POOL + method, Peer("store", "s1"), "s2")
        assert allowed(POOL + method, Peer("master"), "s2")
        for role in ("prefill", "decode", "router", "client"):
            assert not allowed(POOL + method, Peer(role), "s1")
    with pytest.raises(PermissionDenied) as info:
        authorize(POOL + "UnmountSegment", Peer("store", "s1"), "s2")
    assert info.value.field == "segment_id"


def test_pool_wide_calls_need_store_or_master() -> None:
    for method in ("Remove", "Stats"):
        assert {r for r in ROLES if allowed(POOL + method, Peer(r))} == {"master", "store"}


def test_each_method_has_exactly_its_callers() -> None:
    callers = {method: {r for r in ROLES if allowed(method, Peer(r, "x"), "x")} for method in POLICY}
    assert callers[POOL + "PutStart"] == {"master", "prefill"}
    assert callers[POOL + "Lookup"] == {"master", "prefill"}
    assert callers["/kvpool.rpc.Prefill/Prefill"] == {"decode", "router"}  # decode's Serve, or an older shard's
    assert callers["/kvpool.rpc.PrefillStage/Forward"] == {"prefill"}
    assert callers["/kvpool.rpc.PrefillStage/ForwardPieces"] == {"prefill"}
    assert callers["/kvpool.rpc.PrefillStage/StageInfo"] == {"prefill", "router"}
    assert callers["/kvpool.rpc.PrefillStage/HandoffDone"] == {"prefill"}
    assert callers["/kvpool.rpc.Decode/Landed"] == {"prefill"}
    assert callers["/kvpool.rpc.Decode/Generate"] == {"router"}
    assert callers["/kvpool.rpc.Decode/Serve"] == {"router"}
    assert callers["/kvpool.rpc.Router/Generate"] == {"client", "router"}


def test_every_method_of_every_service_is_in_the_policy() -> None:
    """A new method is refused until someone decides who may call it; this lists the gaps."""
    methods = {f"/{service.full_name}/{m.name}"
               for module in (decode_pb2, handoff_pb2, pool_pb2, prefill_pb2, router_pb2)
               for service in module.DESCRIPTOR.services_by_name.values() for m in service.methods}
    assert methods == set(POLICY)


def test_unknown_methods_are_refused_and_health_is_open() -> None:
    assert not allowed("/kvpool.rpc.PoolMaster/DropEverything", Peer("master"))
    assert allowed("/grpc.health.v1.Health/Check", Peer("client"))
    assert allowed("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", Peer("decode"))


def test_a_certificate_must_name_a_role() -> None:
    assert Peer.from_common_name("store/up-store0") == Peer("store", "up-store0")
    assert Peer.from_common_name("router") == Peer("router", "")
    with pytest.raises(PermissionDenied, match="names no role"):
        Peer.from_common_name("attacker")


def test_a_monitor_reads_admin_ports_and_calls_nothing() -> None:
    assert not any(allowed(method, Peer("monitor")) for method in POLICY)
    assert {r for r in ROLES if admin_allowed(Peer(r, "x"))} == {"monitor", "client"}
    with pytest.raises(PermissionDenied, match="^admin port: needs the client or monitor role; the caller is "
                                               "store$"):
        authorize_admin(Peer("store", "s0"))
