"""Who may call the HTTP API, and as which tenant.

``ApiGate`` is ASGI middleware in front of the OpenAI-compatible app:

- a request that carries an ``Origin`` other than the server's own is refused
  (403) unless that origin is configured (``cors_origins``, then answered with
  CORS headers): a web page can never drive the API from a user's browser, a
  ``text/plain`` "simple" POST included;
- with API keys configured every route but ``GET /health`` needs
  ``Authorization: Bearer KEY``; a missing or unknown key gets OpenAI's 401
  body. The key's tenant is put in ``scope["state"]["tenant"]``, and the
  connection it came on is told it is authenticated (``http_server``'s
  ``AUTHENTICATED_EXTENSION``: it leaves the per-address bound of
  ``http_connections``);
- ``scope["state"]["authenticated"]`` says whether the caller may see detail
  (``/health``'s targets): True for a valid key, or when the API is open;
- without keys the API is open and every request is tenant ``default``;
- each tenant may start ``tenant_rate`` requests a second (``tenant_burst`` at
  once); past that a POST gets OpenAI's 429 with ``Retry-After``;
- each key may hold ``max_requests_per_key`` requests open at once
  (``open_requests``); one more gets OpenAI's 429 with ``Retry-After``.

Keys come from a keys file (``KEY`` or ``TENANT=KEY`` a line, ``#``
comments) and ``KVPOOL_API_KEY`` (such entries, comma-separated), never from
a command line, which every local user reads in /proc/PID/cmdline.
``KeyRing.reload`` re-reads them (the router does on SIGHUP). They are held
only as SHA-256 digests, so a lookup takes the same time whatever prefix of a
key an attacker guessed.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpool.core.tenancy.tenants import TenantRates
from kvpool.services.router.http_server import AUTHENTICATED_EXTENSION
from kvpool.services.router.open_requests import OpenRequests
from kvpool.services.router.openai_errors import ApiError

API_KEY_ENV = "KVPOOL_API_KEY"
DEFAULT_TENANT = "default"
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_key(authorization: str) -> str:
    """The KEY of an ``Authorization: Bearer KEY`` value; "" for any other value."""
    scheme, _, key = authorization.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a valid API key says is calling: the key (its digest, what per-key bounds count) and its tenant."""

    key_id: bytes
    tenant: str


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

    def caller(self, key: str) -> Caller | None:
        """The caller ``key`` names; None for an unknown key."""
        key_id = _digest(key)
        tenant = self.tenants.get(key_id)
        return None if tenant is None else Caller(key_id, tenant)

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
    def load(cls, keys_file: str, environ: Mapping[str, str] = os.environ) -> ApiKeys:
        """Every key from the file and the environment, together."""
        tenants: dict[bytes, str] = {}
        parts = [cls.parse(environ.get(API_KEY_ENV, "").split(","), API_KEY_ENV)]
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


@dataclass(slots=True)
class KeyRing:
    """The keys in force, which ``reload`` replaces whole from their file and ``KVPOOL_API_KEY``.

    Invariant: ``keys`` is always a set that parsed whole; a reload that fails keeps the old set, and one
    that would leave no key where there were keys is refused (it would open the API to everyone).
    """

    keys: ApiKeys
    keys_file: str = ""
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)

    @classmethod
    def load(cls, keys_file: str, environ: Mapping[str, str] = os.environ) -> KeyRing:
        return cls(ApiKeys.load(keys_file, environ), keys_file, environ)

    def reload(self) -> ApiKeys:
        """Read the keys again and put them in force; raises ValueError (keeping the old keys) saying why not."""
        keys = ApiKeys.load(self.keys_file, self.environ)
        if self.keys and not keys:
            raise ValueError(f"api_keys_file {self.keys_file}: holds no key now; refusing to open the API to "
                             "everyone (restart the router without keys for that)")
        self.keys = keys
        return keys


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
    ring: KeyRing  # read at each request: a reload holds from the next request on
    cors_origins: frozenset[str] = frozenset()
    rates: TenantRates = field(default_factory=lambda: TenantRates(0.0, 0))  # requests a tenant may start
    open_requests: OpenRequests | None = None  # per key; None: no bound

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
        keys = self.ring.keys
        key = bearer_key(headers.get("authorization", ""))
        caller = keys.caller(key) if keys and key else None
        if keys and caller is None and scope["path"] not in OPEN_PATHS:
            if not key:
                await _error(401, MISSING_KEY, None, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            else:
                await _error(401, f"Incorrect API key provided: {_masked(key)}.", "invalid_api_key",
                             {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        if caller is not None:
            connection_authenticated = scope.get("extensions", {}).get(AUTHENTICATED_EXTENSION)
            if connection_authenticated is not None:
                connection_authenticated()
        tenant = caller.tenant if caller is not None else DEFAULT_TENANT
        if scope["method"] == "POST":
            wait = self.rates.take(tenant, time.monotonic())
            if wait > 0:
                response = JSONResponse(ApiError(429, f"Rate limit reached for tenant {tenant}: "
                                                 f"{self.rates.rate:g} requests/s. Try again in {wait:.2f}s.",
                                                 None, "rate_limit_exceeded", "requests").body(),
                                        status_code=429, headers={"Retry-After": str(max(1, round(wait)))})
                await response(scope, receive, send)
                return
        state = scope.setdefault("state", {})
        state["tenant"] = tenant
        state["authenticated"] = not keys or caller is not None
        if caller is None or self.open_requests is None:
            await self.app(scope, receive, send)
            return
        if not self.open_requests.open(caller.key_id):
            await _error(429, self.open_requests.refusal(), "too_many_open_requests",
                         {"Retry-After": "1"})(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.open_requests.close(caller.key_id)


def _same_origin(origin: str, headers: Headers) -> bool:
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and parts.netloc == headers.get("host")


def gate(app: ASGIApp, keys: KeyRing | ApiKeys, cors_origins: Iterable[str] = (), tenant_rate: float = 0.0,
         tenant_burst: int = 1, open_requests: OpenRequests | None = None) -> ASGIApp:
    """``app`` behind the gate (``keys``: a ring to reload, or a fixed set); configured origins get CORS answers
    (preflights included) first."""
    origins = frozenset(o.rstrip("/") for o in cors_origins if o)
    ring = keys if isinstance(keys, KeyRing) else KeyRing(keys)
    gated: ASGIApp = ApiGate(app, ring, origins, TenantRates(tenant_rate, tenant_burst), open_requests)
    if origins:
        gated = CORSMiddleware(gated, allow_origins=sorted(origins), allow_methods=["GET", "POST"],
                               allow_headers=["authorization", "content-type"])
    return gated


def tenant_of(scope: Mapping[str, Any]) -> str:
    """The tenant ``ApiGate`` found for this request."""
    return str(scope.get("state", {}).get("tenant", DEFAULT_TENANT))


def authenticated(scope: Mapping[str, Any]) -> bool:
    """Whether ``ApiGate`` found a valid key on this request, or the API is open (no keys)."""
    return bool(scope.get("state", {}).get("authenticated", False))
