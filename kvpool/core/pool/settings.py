"""The pool index's settings: watermarks, timeouts, alignment, striping, failed groups, store journals."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.setting import setting
from kvpool.core.tenancy.shares import parse_weights


@dataclass(slots=True)
class IndexSettings:
    """Checked on construction: ``0 < low_watermark <= high_watermark <= 1``, timeouts positive."""

    high_watermark: float = setting(0.90, help="evict when this share of capacity is used")
    low_watermark: float = setting(0.85, help="evict down to this share of capacity")
    put_timeout_s: float = setting(30.0, help="revoke puts not ended after this many seconds (their writer died)")
    lease_s: float = setting(5.0, help="default read lease in seconds")
    segment_ttl_s: float = setting(10.0, help="drop a store silent for this many seconds, with its objects")
    alignment: int = setting(64, help="byte alignment of every object in a segment (a power of two)")
    stripe_min_bytes: int = setting(
        8 << 20, help="a put batch of at least this many bytes is striped over its host's segments "
        "(parallel transfers); a smaller one stays on one segment (one transfer)",
    )

    failed_group_hold_s: float = setting(
        10.0, help="after a member of a group fails to save, refuse its other members for this many seconds "
        "(they would only make an incomplete group)",
    )
    incomplete_group_s: float = setting(
        30.0, help="drop a group still incomplete this many seconds after its last member arrived, with nothing "
        "in flight (its other writers died, or the stores holding its other members never came back)",
    )
    max_evictions_per_put: int = setting(
        256, help="a put batch that passes the high watermark evicts what keeps it under, then toward the low "
        "watermark at most this many groups more (evicting a twentieth of a pool of a million objects in one "
        "call held the master for about 0.1 s)",
    )
    max_changes_per_heartbeat: int = setting(
        4096, help="most changes to a segment's committed objects sent to its store in one heartbeat response "
        "(it asks again at once for the rest)",
    )
    tenant_weights: list[str] = setting(
        help="each tenant's weight in the pool, TENANT=WEIGHT (comma-separated); a tenant not named weighs 1. "
        "A tenant's share is its weight over the weights of the tenants holding chunks, of the bytes under the "
        "high watermark; a tenant over its share loses its own oldest chunks first and never evicts a tenant "
        "within its share (docs/security.md)", factory=list, metavar="TENANT=WEIGHT,...",
        default_text="none: equal shares",
    )
    eviction: str = setting(
        "group", choices=("group", "object"),
        help="group: evict a chunk's members together (never a partial group); object: evict each member on "
        "its own, as upstream Mooncake's best-effort groups do (a partial group is a miss; for comparisons)",
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(
                "watermarks must satisfy 0 < low_watermark <= high_watermark <= 1, "
                f"got low={self.low_watermark} high={self.high_watermark}"
            )
        for name in ("put_timeout_s", "lease_s", "segment_ttl_s", "failed_group_hold_s", "incomplete_group_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {self.alignment}")
        if self.stripe_min_bytes <= 0:
            raise ValueError(f"stripe_min_bytes must be positive, got {self.stripe_min_bytes}")
        if self.max_evictions_per_put <= 0:
            raise ValueError(f"max_evictions_per_put must be positive, got {self.max_evictions_per_put}")
        if self.max_changes_per_heartbeat <= 0:
            raise ValueError(f"max_changes_per_heartbeat must be positive, got {self.max_changes_per_heartbeat}")
        if isinstance(self.tenant_weights, str):
            self.tenant_weights = [w for w in self.tenant_weights.split(",") if w]
        parse_weights(self.tenant_weights)  # raises naming the bad entry
        if self.eviction not in ("group", "object"):
            raise ValueError(f"eviction must be 'group' or 'object', got {self.eviction!r}")
