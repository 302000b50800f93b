"""Who may call the router's gRPC ``Generate``, and as which tenant: the gRPC side of ``auth.ApiGate``.

With API keys configured, a call must carry gRPC metadata ``authorization: Bearer KEY`` with a key of the
same set the HTTP API takes (``auth.KeyRing``, re-read on SIGHUP): its tenant becomes the request's tenant,
so one tenant's prompts are never a cache hit for another's. A call without that metadata is let in only
when it came over mutual TLS with a client certificate of role ``client`` (``kvpool.tls.RoleCheck`` has
verified the certificate and its role by then); it is tenant ``default``. Anything else is UNAUTHENTICATED,
a wrong key as a missing one. Each key may hold ``OpenRequests.max_per_key`` calls open at once, its HTTP
requests included; one more is RESOURCE_EXHAUSTED. Without keys every call is tenant ``default``.
The stock health and reflection services stay open.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from kvpool.core.tenancy.access import Peer, PermissionDenied
from kvpool.services.router.auth import DEFAULT_TENANT, KeyRing, bearer_key
from kvpool.services.router.open_requests import OpenRequests

METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
CLIENT_ROLE = "client"
NEEDS_KEY = (f"this router needs an API key: send gRPC metadata '{METADATA_KEY}: Bearer KEY' "
             "(or call over mutual TLS with a client certificate of role client)")


def _certificate_role(context: grpc.aio.ServicerContext) -> str | None:
    """The role a verified client certificate names; None without one (plaintext, or no certificate)."""
    names = context.auth_context().get("x509_common_name") or []
    if not names:
        return None
    try:
        return Peer.from_common_name(names[0].decode()).role
    except PermissionDenied:
        return None


@dataclass(slots=True)
class GrpcGate:
    """Authentication and the per-key bound for gRPC calls (module doc)."""

    ring: KeyRing
    open_requests: OpenRequests

    @asynccontextmanager
    async def admitted(self, context: grpc.aio.ServicerContext) -> AsyncIterator[str]:
        """The call's tenant, for as long as the call is open; aborts the call when it may not be served."""
        keys = self.ring.keys
        if not keys:
            yield DEFAULT_TENANT
            return
        values = [str(v) for k, v in context.invocation_metadata() or () if k == METADATA_KEY]
        if not values:
            if _certificate_role(context) != CLIENT_ROLE:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, NEEDS_KEY)
            yield DEFAULT_TENANT
            return
        caller = keys.caller(bearer_key(values[0])) if len(values) == 1 else None
        if caller is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"gRPC metadata '{METADATA_KEY}' holds no valid 'Bearer KEY' of this router")
            return
        if not self.open_requests.open(caller.key_id):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.open_requests.refusal())
        try:
            yield caller.tenant
        finally:
            self.open_requests.close(caller.key_id)
