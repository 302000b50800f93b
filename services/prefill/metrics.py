"""Prometheus metrics of a prefill stage (stage 0 fills the request figures)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvpool.core.prefill.fair_queue import FairQueue
from kvpool.core.tenancy.tenants import TenantLabels
from kvpool.services.prefill.stage0.prefill_result import PrefillFigures


class PoolClientFigures(Protocol):
    bytes_by_path: dict[tuple[str, str], int]

# Prometheus convention: base units, seconds
_SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class PrefillMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpool_prefill_requests", "Prefill requests served", registry=r)
        self.tokens = Counter("kvpool_prefill_prompt_tokens", "Prompt tokens by where they came from",
                              ["source"], registry=r)
        self.restores_fell_short = Counter(
            "kvpool_prefill_restores_fell_short", "Forwards a stage failed because it restored less than the "
            "forward was planned past (the request was planned again without the pool)", registry=r)
        self.lost_chunks = Counter("kvpool_prefill_pool_chunks_lost",
                                   "Pool chunks planned but not restorable (recomputed)", registry=r)
        self.restore_wait = Histogram("kvpool_prefill_restore_wait_seconds",
                                      "First stage restore start to last finish", buckets=_SECONDS_BUCKETS, registry=r)
        self.compute = Histogram("kvpool_prefill_compute_seconds", "Pipeline compute time per request",
                                 buckets=_SECONDS_BUCKETS, registry=r)
        # per pool object (a chunk of one stage's layers), on every stage (each its own registry): what a
        # benchmark reads to see lost saves, summed over the stages. Stage 0 counts every stage's objects when
        # it reserves for all of them (StageEnds.saves_together); the others then count none
        self.saves_skipped = Counter("kvpool_prefill_saves_skipped",
                                     "Pool objects of saves not stored, by reason (stage 0: every stage's, when "
                                     "it reserves them all)", ["reason"], registry=r)
        self.saves_stored = Counter("kvpool_prefill_saves_stored",
                                    "Pool objects of saves stored (or found there: exists); stage 0: every "
                                    "stage's, when it reserves them all", ["result"], registry=r)
        self.restored_bytes = Counter("kvpool_prefill_restored_bytes",
                                      "Bytes this stage restored from the pool straight into its pages", registry=r)
        self.corrupt_objects = Counter("kvpool_prefill_corrupt_objects",
                                       "Objects this stage read from the pool that failed their checksum "
                                       "(recomputed; their groups reported to the master)", registry=r)
        self.saved_bytes = Counter("kvpool_prefill_saved_bytes",
                                   "Bytes this stage wrote to the pool straight from its pages, for objects "
                                   "stored", registry=r)
        self.save_seconds = Histogram("kvpool_prefill_save_seconds",
                                      "One request's save on this stage, put start to end (stored ones)",
                                      buckets=_SECONDS_BUCKETS, registry=r)
        self.pieces_received = Counter("kvpool_prefill_pieces_received",
                                       "Pieces of requests this stage received from the stage before "
                                       "(ForwardPieces messages; a request passed on whole is one)", registry=r)
        self.work_scale = Gauge("kvpool_prefill_work_scale",
                                "Seconds this stage's forward pieces took per second their work estimate says "
                                "(the reference GPUs' speed; 1 until measured): what scales the queues' estimates",
                                registry=r)
        self.device_usage = Gauge("kvpool_prefill_device_cache_usage", "Share of device blocks referenced",
                                  registry=r)
        # stage 0: blocks each tenant holds (in use or cached); the first 16 tenants by name, the rest "other"
        self.tenant_labels = TenantLabels()
        self.tenant_blocks = Gauge("kvpool_prefill_tenant_device_blocks",
                                   "Device blocks each tenant holds, in use or cached", ["tenant"], registry=r)
        # every stage: its own share of each restore (read straight into the pages, verified as it lands)
        self.restore_seconds = Histogram("kvpool_prefill_restore_seconds",
                                         "One request's restore on this stage: read and verify into the pages",
                                         buckets=_SECONDS_BUCKETS, registry=r)
        # stage 0: the wait for free device blocks before a prefill may start (the prefill queue)
        self.admission_wait = Histogram("kvpool_prefill_admission_wait_seconds",
                                        "Wait for free device blocks before a prefill starts",
                                        buckets=_SECONDS_BUCKETS, registry=r)
        self.admission_waiting = Gauge("kvpool_prefill_admission_waiting",
                                       "Requests waiting for free device blocks now", registry=r)
        # stage 0: callers that went away before their answer, by where their request was
        self.cancelled = Counter("kvpool_prefill_cancelled",
                                 "Prefill requests whose caller went away (cancelled, or past its deadline), by "
                                 "where the request was: queued (the gate), admission (waiting for device blocks) "
                                 "or running (its blocks go back once the stages are done with them)",
                                 ["phase"], registry=r)
        for phase in ("queued", "admission", "running"):
            self.cancelled.labels(phase)
        # stage 0: the wait for a slot of the gate (--sched-slots), before the wait for blocks
        self.gate_wait = Histogram("kvpool_prefill_gate_wait_seconds",
                                   "Wait for a slot of stage 0's gate (--sched-slots) before a prefill starts",
                                   buckets=_SECONDS_BUCKETS, registry=r)

    def observe_tenants(self, tenant_blocks: dict[str, int]) -> None:
        for label, value in self.tenant_labels.totals(tenant_blocks).items():
            self.tenant_blocks.labels(label).set(value)

    def observe(self, figures: PrefillFigures, device_usage: float) -> None:
        self.requests.inc()
        self.tokens.labels("device").inc(figures.num_device_tokens)
        self.tokens.labels("pool").inc(figures.num_pool_tokens)
        self.tokens.labels("computed").inc(figures.num_computed_tokens)
        self.lost_chunks.inc(figures.num_pool_chunks_lost)
        if figures.restore:
            self.restore_wait.observe(figures.restore_wait_ms / 1e3)
        self.compute.observe(figures.compute_ms / 1e3)
        self.device_usage.set(device_usage)


class GatePopsCollector(Collector):
    """``kvpool_prefill_gate_pops_total{decided_by}``: pops of stage 0's gate that aging (``aging``: the
    oldest had waited ``--sched-max-wait-s``), the bypass budget (``budget``: the order's first choice
    was held back) or the backlog gate (``backlog``: ``--sched-reorder-below-s`` of work waited, so the
    oldest went) decided, read from the core's queue at each scrape: how often each bound binds."""

    def __init__(self, queue: FairQueue) -> None:
        self.queue = queue

    def collect(self) -> Iterator[CounterMetricFamily]:
        pops = CounterMetricFamily("kvpool_prefill_gate_pops", "Pops of stage 0's gate decided by aging, by "
                                   "the bypass budget or by the backlog gate", labels=["decided_by"])
        pops.add_metric(["aging"], self.queue.num_overdue_pops)
        pops.add_metric(["budget"], self.queue.num_budget_pops)
        pops.add_metric(["backlog"], self.queue.num_backlog_pops)
        yield pops


class PoolPathCollector(Collector):
    """``kvpool_prefill_pool_bytes_total{path,direction}``: the bytes this stage's pool client moved by each path
    (``memory``: a copy with a store on this host; ``engine``: the transfer engine), read and written."""

    def __init__(self, pool: PoolClientFigures) -> None:
        self.pool = pool

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("kvpool_prefill_pool_bytes", "Bytes the pool client moved, by path and direction",
                                     labels=["path", "direction"])
        for (path, direction), nbytes in sorted(self.pool.bytes_by_path.items()):
            family.add_metric([path, direction], nbytes)
        yield family
