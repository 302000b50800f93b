"""Tenants: who shares what. Pure.

Each API key names a tenant. Chunk hashes are rooted per tenant
(``chunk_hash.hash_root``); session keys are scoped per tenant here, so one
tenant's ``prompt_cache_key`` never steers or joins another's session; and
each tenant's request rate is its own (``TenantRates``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(slots=True)
class TenantRates:
    """Per-tenant token buckets: each tenant may start ``rate`` requests a second, ``burst`` at once.

    Invariants: a tenant's tokens stay within [0, burst]; one tenant's requests
    never take another's tokens; ``rate`` <= 0 admits everything. Time comes
    from the caller (monotonic seconds).
    """

    rate: float
    burst: float
    _tokens: dict[str, float] = field(default_factory=dict)
    _stamp: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rate > 0 and self.burst < 1:
            raise ValueError(f"burst: must be >= 1 with a rate, got {self.burst}")

    def take(self, tenant: str, now: float) -> float:
        """0.0 and one token taken if ``tenant`` may start a request now, else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        tokens = min(self.burst, self._tokens.get(tenant, self.burst)
                     + (now - self._stamp.get(tenant, now)) * self.rate)
        self._stamp[tenant] = now
        if tokens >= 1.0:
            self._tokens[tenant] = tokens - 1.0
            return 0.0
        self._tokens[tenant] = tokens
        return (1.0 - tokens) / self.rate


OTHER_TENANTS = "other"


@dataclass(slots=True)
class TenantLabels:
    """Metric labels of tenants, bounded: the first ``limit`` tenants seen keep their
    name for good, every later one counts as ``"other"``.

    Invariants: at most ``limit + 1`` labels ever; a tenant's label never
    changes, so a per-tenant counter stays monotonic.
    """

    limit: int = 16
    _named: dict[str, None] = field(default_factory=dict)

    def label(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.limit and tenant != OTHER_TENANTS:
            self._named[tenant] = None
            return tenant
        return OTHER_TENANTS

    def totals(self, values: dict[str, int]) -> dict[str, int]:
        """``values`` by tenant summed by label; every label seen so far is present (0 when nothing)."""
        totals = dict.fromkeys(self._named, 0)
        for tenant, value in values.items():
            label = self.label(tenant)
            totals[label] = totals.get(label, 0) + value
        if len(self._named) >= self.limit:
            totals.setdefault(OTHER_TENANTS, 0)
        return totals
