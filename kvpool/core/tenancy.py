"""Tenants: who shares what. Pure.

Each API key names a tenant. Chunk hashes are rooted per tenant
(``chunk_hash.hash_root``); session keys are scoped per tenant here, so one
tenant's ``prompt_cache_key`` never steers or joins another's session.
"""

from __future__ import annotations

from kvpool.core.chunk_hash import DEFAULT_TENANT


def scoped_session_key(tenant: str, session_key: str) -> str:
    """``session_key`` within ``tenant``; "" (no session) stays "".

    The default tenant keeps its keys as they are; any other tenant's key is
    prefixed with its name and a NUL, which no tenant name holds, so two
    tenants' keys can never be equal.
    """
    if not session_key or tenant in ("", DEFAULT_TENANT):
        return session_key
    return f"{tenant}\0{session_key}"
