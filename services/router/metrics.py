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
        self.healthy = Gauge("kvpool_router_target_healthy",
                             "1 while a target (prefill pipeline or decode shard) passes its health check",
                             ["target"], registry=r)
        self.retries = Counter("kvpool_router_retries", "Requests retried on another pipeline before any token",
                               registry=r)
