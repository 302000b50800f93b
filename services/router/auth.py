"""Who may call the HTTP API, and as which tenant.

``ApiGate`` is ASGI middleware in front of the OpenAI-compatible app:

- a request that carries an ``Origin`` other than the server's own is refused
  (403) unless that origin is configured (``cors_origins``, then answered with
  CORS headers): a web page can never drive the API from a user's browser, a
  ``text/plain`` "simple" POST included;
- with API keys configured every route but ``GET /health`` needs
  ``Authorization: Bearer KEY``; a missing or unknown key gets OpenAI's 401
  body. The key's tenant is put in ``scope["state"]["tenant"]``;
- without keys the API is open and every request is tenant ``default``;
- each tenant may start ``tenant_rate`` requests a second (``tenant_burst`` at
  once); past that a POST gets OpenAI's 429 with ``Retry-After``.

Keys come from ``--api-key`` (``KEY`` or ``TENANT=KEY``, comma-separated), a
keys file (one such entry a line, ``#`` comments) and ``KVPOOL_API_KEY``.
They are held only as SHA-256 digests, so a lookup takes the same time
whatever prefix of a key an attacker guessed.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpool.core.tenancy.tenants import TenantRates
from kvpool.services.router.openai_errors import ApiError

API_KEY_ENV = "KVPOOL_API_KEY"
DEFAULT_TENANT = "default"
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """API key → tenant. Empty: the API is open and everyone is tenant ``default``.

    Invariant: every tenant name matches ``TENANT_RE``; a key names one tenant only.
    """

    tenants: Mapping[bytes, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tenants)

    def tenant_of(self, key: str) -> str | None:
        return self.tenants.get(_digest(key))

    @classmethod
    def parse(cls, entries: Iterable[str], source: str) -> ApiKeys:
        tenants: dict[bytes, str] = {}
        for entry in entries:
            entry = entry.strip()
            if not entry or entry.startswith("#"):
                continue
            tenant, sep, key = entry.partition("=")
            if not sep:
                tenant, key = DEFAULT_TENANT, entry
            tenant, key = tenant.strip(), key.strip()
            if not TENANT_RE.match(tenant):
                raise ValueError(f"{source}: tenant {tenant!r} must be 1-64 of A-Z a-z 0-9 _ . - ")
            if len(key) < 8 or any(c.isspace() for c in key):
                raise ValueError(f"{source}: an API key of tenant {tenant!r} is shorter than 8 characters "
                                 "or holds whitespace")
            digest = _digest(key)
            if tenants.get(digest, tenant) != tenant:
                raise ValueError(f"{source}: one key is given to tenants {tenants[digest]!r} and {tenant!r}")
            tenants[digest] = tenant
        return cls(tenants)

    @classmethod
    def load(cls, api_key: Sequence[str], keys_file: str, environ: Mapping[str, str] = os.environ) -> ApiKeys:
        """Every key from the flag, the file and the environment, together."""
        tenants: dict[bytes, str] = {}
        parts = [cls.parse(api_key, "api_key"), cls.parse(environ.get(API_KEY_ENV, "").split(","), API_KEY_ENV)]
        if keys_file:
            path = Path(keys_file)
            if not path.is_file():
                raise ValueError(f"api_keys_file: {path} is not a file")
            parts.append(cls.parse(path.read_text().splitlines(), f"api_keys_file {path}"))
        for part in parts:
            for digest, tenant in part.tenants.items():
                if tenants.get(digest, tenant) != tenant:
                    raise ValueError(f"one key is given to tenants {tenants[digest]!r} and {tenant!r}")
                tenants[digest] = tenant
        return cls(tenants)


def _error(status: int, message: str, code: str | None, extra: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ApiError(status, message, None, code).body(), status_code=status, headers=extra)


MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
               "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")


def _masked(key: str) -> str:
    return key[:3] + "*" * min(max(len(key) - 7, 0), 20) + key[-4:] if len(key) > 8 else "*" * len(key)


@dataclass(slots=True)
class ApiGate:
    """Origin check and API-key authentication in front of ``app`` (see the module docstring)."""

    app: ASGIApp
    keys: ApiKeys
    cors_origins: frozenset[str] = frozenset()
    rates: TenantRates = field(default_factory=lambda: TenantRates(0.0, 0))  # requests a tenant may start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is not None and origin not in self.cors_origins and not _same_origin(origin, headers):
            response = _error(403, f"cross-origin requests are refused (Origin: {origin[:100]}); the server's "
                              "cors_origins setting lists the origins it serves", "cross_origin_refused")
            await response(scope, receive, send)
            return
        tenant = DEFAULT_TENANT
        if self.keys and scope["path"] not in OPEN_PATHS:
            scheme, _, key = headers.get("authorization", "").partition(" ")
            key = key.strip()
            if scheme.lower() != "bearer" or not key:
                await _error(401, MISSING_KEY, None, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
            found = self.keys.tenant_of(key)
            if found is None:
                await _error(401, f"Incorrect API key provided: {_masked(key)}.", "invalid_api_key",
                             {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
            tenant = found
        if scope["method"] == "POST":
            wait = self.rates.take(tenant, time.monotonic())
            if wait > 0:
                response = JSONResponse(ApiError(429, f"Rate limit reached for tenant {tenant}: "
                                                 f"{self.rates.rate:g} requests/s. Try again in {wait:.2f}s.",
                                                 None, "rate_limit_exceeded", "requests").body(),
                                        status_code=429, headers={"Retry-After": str(max(1, round(wait)))})
                await response(scope, receive, send)
                return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def _same_origin(origin: str, headers: Headers) -> bool:
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and parts.netloc == headers.get("host")


def gate(app: ASGIApp, keys: ApiKeys, cors_origins: Iterable[str] = (), tenant_rate: float = 0.0,
         tenant_burst: int = 1) -> ASGIApp:
    """``app`` behind the gate; configured origins get CORS answers (preflights included) first."""
    origins = frozenset(o.rstrip("/") for o in cors_origins if o)
    gated: ASGIApp = ApiGate(app, keys, origins, TenantRates(tenant_rate, tenant_burst))
    if origins:
        gated = CORSMiddleware(gated, allow_origins=sorted(origins), allow_methods=["GET", "POST"],
                               allow_headers=["authorization", "content-type"])
    return gated


def tenant_of(scope: Mapping[str, Any]) -> str:
    """The tenant ``ApiGate`` found for this request."""
    return str(scope.get("state", {}).get("tenant", DEFAULT_TENANT))
