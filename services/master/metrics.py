"""Prometheus metrics of the pool master (names follow Mooncake's master_* set)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpool.core.pool.index import PoolIndex
from kvpool.core.tenancy.tenants import TenantLabels


class MasterMetrics:
    """Gauges refreshed from the index; counters advanced by deltas."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.capacity = Gauge("kvpool_pool_capacity_bytes", "Bytes of all mounted segments", registry=r)
        self.used = Gauge("kvpool_pool_used_bytes", "Bytes allocated (committed and in flight)", registry=r)
        self.objects = Gauge("kvpool_pool_objects", "Objects stored or being stored", registry=r)
        self.groups = Gauge("kvpool_pool_groups", "Groups with at least one member", registry=r)
        self.segments = Gauge("kvpool_pool_segments", "Mounted segments", registry=r)
        self.leases = Gauge("kvpool_pool_leases", "Read leases held", registry=r)
        self.in_flight = Gauge("kvpool_pool_puts_in_flight", "Puts started, not ended", registry=r)
        self.evicted_groups = Counter("kvpool_pool_evicted_groups", "Groups evicted", registry=r)
        self.evicted_bytes = Counter("kvpool_pool_evicted_bytes", "Bytes evicted (sizes aligned, as used bytes count them)", registry=r)
        self.revoked_puts = Counter("kvpool_pool_revoked_puts", "Puts revoked", registry=r)
        self.dropped_segments = Counter("kvpool_pool_dropped_segments", "Segments dropped for missed heartbeats", registry=r)
        self.failed_groups = Counter("kvpool_pool_failed_groups", "Groups dropped because a member failed to save",
                                     registry=r)
        self.adopted_objects = Counter("kvpool_pool_adopted_objects",
                                       "Objects made usable again from stores' block reports", registry=r)
        self.rejected_records = Counter("kvpool_pool_rejected_records",
                                        "Records in stores' block reports that did not become objects", registry=r)
        self.abandoned_groups = Counter("kvpool_pool_abandoned_groups",
                                        "Groups dropped for staying incomplete with nothing in flight", registry=r)
        self.corrupt_groups = Counter("kvpool_pool_corrupt_groups",
                                      "Groups dropped because a reader found a member failing its checksum",
                                      registry=r)
        self.unacked_changes = Gauge("kvpool_pool_unacked_changes",
                                     "Changes to committed objects not yet acknowledged by their stores", registry=r)
        # a master with standbys (--etcd)
        self.leading = Gauge("kvpool_master_leader", "1 while this master leads and answers (with --etcd)", registry=r)
        self.epoch = Gauge("kvpool_master_epoch", "The epoch of this master's last term as leader", registry=r)
        self.leader_terms = Counter("kvpool_master_leader_terms", "Terms this master won as leader", registry=r)
        self.lookup_groups = Counter("kvpool_pool_lookup_groups", "Groups asked for in lookups", registry=r)
        self.lookup_hit_groups = Counter("kvpool_pool_lookup_hit_groups", "Groups found complete in lookups", registry=r)
        # by tenant, bounded: the first 16 tenants by name, the rest as "other"
        self.tenant_labels = TenantLabels()
        self.tenant_bytes = Gauge("kvpool_pool_tenant_bytes", "Bytes each tenant holds in the pool "
                                  "(committed and in flight; sizes aligned, as used bytes count them)", ["tenant"], registry=r)
        self.tenant_evicted_groups = Counter("kvpool_pool_tenant_evicted_groups",
                                             "Groups evicted, by the tenant whose group it was", ["tenant"], registry=r)
        self._last = (0, 0, 0, 0, 0, 0, 0, 0, 0)
        self._last_evicted: dict[str, int] = {}

    def new_index(self) -> None:
        """A new leader's term starts a new index, whose counters start at zero: count from there."""
        self._last = (0,) * len(self._last)
        self._last_evicted = {}

    def observe_lookup(self, requested: int, hit: int) -> None:
        self.lookup_groups.inc(requested)
        self.lookup_hit_groups.inc(hit)

    def refresh(self, index: PoolIndex) -> None:
        self.capacity.set(index.capacity)
        self.used.set(index.used_bytes)
        self.objects.set(index.num_objects)
        self.groups.set(len(index.groups))
        self.segments.set(len(index.segments))
        self.leases.set(index.num_leases)
        self.in_flight.set(index.num_in_flight)
        self.unacked_changes.set(sum(s.journal.unacked for s in index.segments.values()))
        c = index.counters
        now = (c.evicted_groups, c.evicted_bytes, c.revoked_puts, c.dropped_segments, c.failed_groups,
               c.adopted_objects, c.rejected_records, c.abandoned_groups, c.corrupt_groups)
        counters = (self.evicted_groups, self.evicted_bytes, self.revoked_puts, self.dropped_segments,
                    self.failed_groups, self.adopted_objects, self.rejected_records, self.abandoned_groups,
                    self.corrupt_groups)
        for counter, before, after in zip(counters, self._last, now):
            if after > before:
                counter.inc(after - before)
        self._last = now
        labels = self.tenant_labels
        for label, value in labels.totals(index.tenant_bytes).items():
            self.tenant_bytes.labels(label).set(value)
        evicted = labels.totals(c.evicted_groups_by_tenant)
        for label, value in evicted.items():
            delta = value - self._last_evicted.get(label, 0)
            if delta > 0:
                self.tenant_evicted_groups.labels(label).inc(delta)
        self._last_evicted = evicted
