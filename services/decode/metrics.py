"""Prometheus metrics of a decode shard (base units)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)
_SECONDS_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60)


class DecodeMetrics:
    def __init__(self, num_pages: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.pages_used = Gauge("kvpool_decode_pages_used", "KV pages held by sequences", registry=r)
        self.pages_total = Gauge("kvpool_decode_pages_total", "KV pages of the shard", registry=r)
        self.pages_total.set(num_pages)
        self.queue_length = Gauge("kvpool_decode_admission_queue_length",
                                  "Sequences waiting for pages or a batch slot", registry=r)
        self.running = Gauge("kvpool_decode_running_sequences", "Sequences in the decode batch", registry=r)
        self.step_seconds = Histogram("kvpool_decode_step_seconds", "One batched decode step",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("kvpool_decode_step_batch_size", "Sequences per decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.tokens = Counter("kvpool_decode_tokens", "Tokens streamed", registry=r)
        self.requests = Counter("kvpool_decode_requests", "Generate calls ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.queue_seconds = Histogram("kvpool_decode_queue_seconds", "Wait in the admission queue",
                                       buckets=_SECONDS_BUCKETS, registry=r)
        self.pages_reserved = Gauge("kvpool_decode_reserved_sequences",
                                    "Sequences holding pages before their Generate (reserved before prefill)",
                                    registry=r)
        self.regions = Gauge("kvpool_decode_regions", "Receive regions reserved or being scattered", registry=r)
        self.region_bytes_used = Gauge("kvpool_decode_region_bytes_used", "Receive arena bytes held by regions",
                                       registry=r)
        self.landed = Counter("kvpool_decode_landed_scatters", "Landed parts of regions scattered into pages, by how "
                              "decode learned of them (doorbell: a same-host stage's control record; call: "
                              "Decode.Landed; generate: the rest of a region, at its Generate)", ["by"], registry=r)
        for by in ("doorbell", "call", "generate"):
            self.landed.labels(by)
        self.room_waits = Counter("kvpool_decode_room_waits", "Times a Serve call of an older router found no "
                                  "room and waited for some to be given back", registry=r)
        self.room_refusals = Counter("kvpool_decode_room_refusals", "Serve calls answered at once that there is "
                                     "no room now (the router queues them and asks again when told)", registry=r)
        self.early_starts = Counter("kvpool_decode_early_starts", "Serve calls whose decoding began once their "
                                    "whole region landed, before the prefill's answer came back along the "
                                    "stages (first_token_early)", registry=r)
        self.prefill_failed_after_landing = Counter(
            "kvpool_decode_prefill_failed_after_landing", "Serve calls decoding from a whole region whose prefill "
            "then failed (the tokens stand; the prefill's figures are lost)", registry=r)
        self.regions_expired = Counter("kvpool_decode_regions_expired",
                                       "Receive regions reclaimed at their deadline", registry=r)
