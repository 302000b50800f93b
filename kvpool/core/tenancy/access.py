"""Who may call what on the control plane. Pure.

With mutual TLS every peer presents a certificate of the cluster's CA whose
common name names its role, and for a store its segment:
``master``, ``store/<segment_id>``, ``prefill``, ``decode``, ``router``,
``client`` (an operator's tools and gRPC ``Generate`` callers; tenants hold API
keys, not certificates), or ``monitor`` (a metrics scraper: it reads the admin
ports and may call nothing).

Invariants:
- a method not listed in ``POLICY`` is refused (fail closed), except the
  health and reflection services, open to every authenticated peer;
- mount, unmount and heartbeat (a segment's life) need the store or master
  role, and a store acts on its own segment only;
- pool-wide calls (``Remove``, ``Stats``) need the store or master role;
- the admin ports (``/metrics``: every tenant's usage) answer the ``monitor``
  and ``client`` roles only (``ADMIN_READERS``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.errors import PermissionDenied

ROLES = ("master", "store", "prefill", "decode", "router", "client", "monitor")

_POOL = "/kvpool.rpc.PoolMaster/"
_ADMIN = frozenset({"master", "store"})
_POOL_DATA = frozenset({"master", "prefill"})
_ROUTER = frozenset({"router"})
_PREFILL = frozenset({"prefill"})

POLICY: dict[str, frozenset[str]] = {
    _POOL + "MountSegment": _ADMIN,
    _POOL + "UnmountSegment": _ADMIN,
    _POOL + "Heartbeat": _ADMIN,
    _POOL + "Remove": _ADMIN,
    _POOL + "Demote": _POOL_DATA,  # stage 0, when a session ends
    _POOL + "Stats": _ADMIN,
    _POOL + "PutStart": _POOL_DATA,
    _POOL + "PutEnd": _POOL_DATA,
    _POOL + "PutRevoke": _POOL_DATA,
    _POOL + "Lookup": _POOL_DATA,
    _POOL + "ReleaseLease": _POOL_DATA,
    _POOL + "Exists": _POOL_DATA,
    _POOL + "Session": _POOL_DATA,  # lookups, releases and puts as messages on one stream
    # a decode shard's Serve prefills into its own region; the router still may (an older shard's Reserve)
    "/kvpool.rpc.Prefill/Prefill": frozenset({"decode", "router"}),
    "/kvpool.rpc.Prefill/Prefetch": _ROUTER,  # session hints at a turn's end
    "/kvpool.rpc.PrefillStage/StageInfo": frozenset({"prefill", "router"}),
    "/kvpool.rpc.PrefillStage/Restore": _PREFILL,
    "/kvpool.rpc.PrefillStage/Forward": _PREFILL,
    "/kvpool.rpc.PrefillStage/ForwardPieces": _PREFILL,
    "/kvpool.rpc.PrefillStage/SaveDone": _PREFILL,
    "/kvpool.rpc.PrefillStage/HandoffDone": _PREFILL,
    "/kvpool.rpc.Decode/Landed": _PREFILL,
    "/kvpool.rpc.Decode/Serve": _ROUTER,
    "/kvpool.rpc.Decode/Reserve": _ROUTER,
    "/kvpool.rpc.Decode/Generate": _ROUTER,
    "/kvpool.rpc.Decode/ReleaseRegion": _ROUTER,
    "/kvpool.rpc.Decode/Stats": _ROUTER,
    "/kvpool.rpc.Decode/WatchRoom": _ROUTER,  # room given back, for the router's queue
    "/kvpool.rpc.Router/Generate": frozenset({"client", "router"}),
}
# who may read a service's admin port (its /metrics name every tenant and its usage)
ADMIN_READERS = frozenset({"monitor", "client"})
# a segment's own life: a store may name only its own segment
OWN_SEGMENT = frozenset({_POOL + "MountSegment", _POOL + "UnmountSegment", _POOL + "Heartbeat"})
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


@dataclass(frozen=True, slots=True)
class Peer:
    """An authenticated caller: its role, and the name after ``/`` (a store's segment id)."""

    role: str
    name: str = ""

    @classmethod
    def from_common_name(cls, common_name: str) -> Peer:
        role, _, name = common_name.partition("/")
        if role not in ROLES:
            raise PermissionDenied(f"certificate common name {common_name!r} names no role of {', '.join(ROLES)}")
        return cls(role, name)


def is_open(method: str) -> bool:
    return method.startswith(OPEN_SERVICES)


def authorize(method: str, peer: Peer, segment_id: str | None = None) -> None:
    """Raise ``PermissionDenied`` unless ``peer`` may call ``method`` (on ``segment_id``)."""
    if is_open(method):
        return
    allowed = POLICY.get(method)
    if allowed is None:
        raise PermissionDenied(f"{method}: not callable by any role")
    if peer.role not in allowed:
        raise PermissionDenied(f"{method}: needs the {' or '.join(sorted(allowed))} role; the caller is "
                               f"{peer.role}")
    if method in OWN_SEGMENT and peer.role == "store" and segment_id != peer.name:
        raise PermissionDenied(f"segment_id: store {peer.name!r} may act on its own segment only, not "
                               f"{segment_id!r}", field="segment_id")


def authorize_admin(peer: Peer) -> None:
    """Raise ``PermissionDenied`` unless ``peer`` may read an admin port."""
    if peer.role not in ADMIN_READERS:
        raise PermissionDenied(f"admin port: needs the {' or '.join(sorted(ADMIN_READERS))} role; the caller is "
                               f"{peer.role}")
