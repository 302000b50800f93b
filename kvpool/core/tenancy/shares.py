"""Tenants' shares of a capacity, and whose cached chunks an eviction may take. Pure.

One rule serves the pool (bytes, the master's group LRU) and the device
cache (blocks, stage 0's free list). Each tenant has a weight: configured
(``TENANT=WEIGHT``), else ``default_weight`` (1, equal shares). At a given
moment the **active** tenants are those holding something, plus the one
asking; a tenant's **share** is ``capacity × weight / Σ active weights``. A
tenant alone may fill everything (its share is the whole), so a cluster of
one tenant evicts in plain LRU order, exactly as without tenants; a second
tenant arriving halves the first's share at once. Shares are entitlements,
not reservations: nothing is evicted until the capacity is used.

**The rule** (``victim_order``): tenant T must evict to fit ``incoming``
units. T is *over* when ``usage(T) + incoming > share(T)``; another tenant U
is over when ``usage(U) > share(U)``. Victims are taken, one at a time:

1. if T is over: T's own least recently used evictable item first;
2. then the least recently used evictable item of the tenant furthest over
   its share (``usage - share`` largest; ties by name), re-ranked after each
   item, while any tenant other than T is over;
3. then, only if T is within its share and the caller allows it (the pool
   does when a put otherwise fails; the device cache always does, since a
   request must get its blocks), any evictable item in global LRU order.

So a tenant within its share never loses an item to a tenant over its share
(T over never reaches step 3, and step 2 takes only from tenants over).
Whether T is over is decided once, before its first victim, with the shares
of that moment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvpool.core.chunk_hash import DEFAULT_TENANT

MAX_TENANT_BYTES = 64


def tenant_name(tenant: str) -> str:
    """The tenant a request or object belongs to: "" is the default tenant."""
    return tenant or DEFAULT_TENANT


def parse_weights(entries: Iterable[str]) -> dict[str, float]:
    """``TENANT=WEIGHT`` entries (a weight > 0) into a mapping; raises ValueError naming the bad entry."""
    weights: dict[str, float] = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        name = name.strip()
        if not sep or not name or len(name.encode()) > MAX_TENANT_BYTES:
            raise ValueError(f"tenant_weights: {entry!r} is not TENANT=WEIGHT")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"tenant_weights: {entry!r}: the weight is not a number") from None
        if not weight > 0 or weight == float("inf"):
            raise ValueError(f"tenant_weights: {entry!r}: the weight must be a positive number")
        if name in weights:
            raise ValueError(f"tenant_weights: tenant {name!r} is given twice")
        weights[name] = weight
    return weights


@dataclass(slots=True, frozen=True)
class VictimOrder:
    """Whom an eviction may take from, in order: ``own`` (T itself, step 1), then the
    tenants over their share (step 2, re-ranked by ``TenantShares.most_over``), then,
    if ``then_any``, anyone in global LRU order (step 3)."""

    tenant: str
    own: bool
    then_any: bool
    shares: Mapping[str, float]


@dataclass(slots=True, frozen=True)
class TenantShares:
    """Weights by tenant; every tenant not named weighs ``default_weight``.

    Invariant: the shares of the active tenants sum to the capacity.
    """

    weights: Mapping[str, float] = field(default_factory=dict)
    default_weight: float = 1.0

    @classmethod
    def parse(cls, entries: Iterable[str]) -> TenantShares:
        return cls(parse_weights(entries))

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def shares(self, usage: Mapping[str, int], tenant: str, capacity: float) -> dict[str, float]:
        """Each active tenant's share of ``capacity`` (active: holding something, or ``tenant``)."""
        active = [t for t, used in usage.items() if used > 0 and t != tenant] + [tenant]
        total = sum(self.weight(t) for t in active)
        return {t: capacity * self.weight(t) / total for t in active}

    def victim_order(self, usage: Mapping[str, int], tenant: str, incoming: int, capacity: float,
                     any_allowed: bool) -> VictimOrder:
        """The rule (module doc) for ``tenant`` fitting ``incoming`` more units, with ``usage`` as it is now."""
        shares = self.shares(usage, tenant, capacity)
        over = usage.get(tenant, 0) + incoming > shares[tenant]
        return VictimOrder(tenant, over, any_allowed and not over, shares)

    @staticmethod
    def most_over(order: VictimOrder, usage: Mapping[str, int], skip: Iterable[str] = ()) -> list[str]:
        """Tenants other than ``order.tenant`` over their share now, furthest over first (ties by name)."""
        skipped = set(skip)
        over = [(usage.get(t, 0) - share, t) for t, share in order.shares.items()
                if t != order.tenant and t not in skipped and usage.get(t, 0) > share]
        return [t for _, t in sorted(over, key=lambda pair: (-pair[0], pair[1]))]
