"""Prometheus metrics of the router: requests, placement decisions with their reasons, latency, target health."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpool_router_requests", "Requests by API and outcome", ["api", "outcome"],
                                registry=r)
        self.placements = Counter("kvpool_router_placements", "Placement decisions by kind, target and reason",
                                  ["kind", "target", "reason"], registry=r)
        self.prompt_tokens = Counter("kvpool_router_prompt_tokens", "Prompt tokens by where their KV came from",
                                     ["source"], registry=r)
        self.completion_tokens = Counter("kvpool_router_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("kvpool_router_ttft_seconds", "Time to first token", buckets=_SECONDS, registry=r)
        self.decode = Histogram("kvpool_router_decode_seconds", "First token to last", buckets=_SECONDS,
                                registry=r)
        self.in_flight = Gauge("kvpool_router_in_flight", "Requests in flight", registry=r)
        self.work_scale = Gauge("kvpool_router_work_scale",
                                "The known pipelines' mean measured seconds per second of estimated work (their "
                                "StageInfo's work_scale): what the queue's estimates and budget are scaled by",
                                registry=r)
        self.healthy = Gauge("kvpool_router_target_healthy",
                             "1 while a target (prefill pipeline or decode shard) passes its health check",
                             ["target"], registry=r)
        self.prefetch_calls = Counter("kvpool_router_prefetch_calls",
                                      "Session hints sent to a pipeline at a turn's end, by kind", ["kind"],
                                      registry=r)
        self.http_refused = Counter("kvpool_router_http_refused",
                                    "HTTP connections turned away before the API served them, by reason: "
                                    "connections (--http-max-connections open), client_connections "
                                    "(--http-max-connections-per-client open from its address without a key), "
                                    "unauthenticated_connections (3/4 of --http-max-connections open without a "
                                    "key), evicted (an idle keyless one closed to make room), head_timeout, "
                                    "body_timeout (--http-read-timeout-s)", ["reason"], registry=r)
        for reason in ("connections", "client_connections", "unauthenticated_connections", "evicted",
                       "head_timeout", "body_timeout"):
            self.http_refused.labels(reason)
        self.http_connections = Gauge("kvpool_router_http_connections",
                                      "HTTP connections open now (at most --http-max-connections)", registry=r)
        self.queued = Counter("kvpool_router_queued", "Requests that waited in the admission queue", registry=r)
        self.queue_expired = Counter("kvpool_router_queue_expired",
                                     "Queued requests refused at their deadline (429)", registry=r)
        self.queue_order = Gauge("kvpool_router_queue_order", "1 for the admission queue's order (--sched: fifo "
                                 "or work)", ["order"], registry=r)
        self.queue_overdue = Counter("kvpool_router_queue_overdue",
                                     "Queued requests ticketed first because they waited --sched-max-wait-s (session "
                                     "order's aging)", registry=r)
        self.queue_backlog = Counter("kvpool_router_queue_backlog",
                                     "Queued requests ticketed in arrival order because --sched-reorder-below-s of "
                                     "estimated work was queued (the session order's backlog gate)", registry=r)
        self.queue_budget = Counter("kvpool_router_queue_budget",
                                    "Queued requests ticketed where the bypass budget (--sched-max-bypass-s) held "
                                    "back the session order's first choice", registry=r)
        self.queue_length = Gauge("kvpool_router_queue_length", "Requests waiting for a ticket (decode room)",
                                  registry=r)
        self.queue_seconds = Histogram("kvpool_router_queue_seconds", "Wait for admission (0 when room was free)",
                                       buckets=(0.0, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        self.admitted = Gauge("kvpool_router_admitted", "Requests holding a ticket (placed on a pipeline and a "
                              "decode shard, which holds their room)", registry=r)
        self.shard_full = Gauge("kvpool_router_shard_full", "1 while a decode shard said it has no room and has "
                                "not said room came back (it takes no ticket meanwhile)", ["shard"], registry=r)
        self.room_refusals = Counter("kvpool_router_room_refusals", "Serve calls a decode shard answered with no "
                                     "room now (the request queued again)", ["shard"], registry=r)
        self.room_watch = Gauge("kvpool_router_room_watch", "1 while a decode shard's WatchRoom stream is open "
                                "(it tells when room comes back)", ["shard"], registry=r)
        self.handoff_bytes = Counter("kvpool_router_handoff_bytes",
                                     "Handoff bytes by link: within the pipeline's server, or across servers",
                                     ["link"], registry=r)
        self.retries = Counter("kvpool_router_retries", "Requests retried on another pipeline before any token",
                               registry=r)
        self.shard_moves = Counter("kvpool_router_shard_moves",
                                   "Requests moved to another decode shard before any token", registry=r)
