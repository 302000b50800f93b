"""What the replay reads from the services besides the answers: Prometheus text and the pool master's stats.

``ClusterProbes`` names the admin endpoints; ``snapshot`` reads every one once
(a service that does not answer is left out, never an error: the report then
says what is missing); ``DecodeSampler`` polls decode KV page use while the
replay runs (a gauge, so only sampling sees its peak).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

import httpx

Metrics = dict[str, float]  # "name{labels}" -> value, as the exposition writes it


@dataclass(slots=True, frozen=True)
class ClusterProbes:
    """Where to read figures: ``name -> http://host:port`` admin roots (``/metrics`` is appended)."""

    router: str = ""
    stages: dict[str, str] = field(default_factory=dict)  # "p0-stage1" -> root
    decode: dict[str, str] = field(default_factory=dict)
    master: str = ""  # gRPC address of the pool master

    def all(self) -> dict[str, str]:
        named = {"router": self.router} if self.router else {}
        return {**named, **self.stages, **self.decode}


def parse_prometheus(text: str) -> Metrics:
    """Samples of a Prometheus text exposition; comments and unparsable lines are skipped."""
    samples: Metrics = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            samples[name] = float(value)
        except ValueError:
            continue
    return samples


def total(metrics: Metrics, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0.0 when there are none)."""
    found = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            found += value
    return found


async def scrape(client: httpx.AsyncClient, root: str) -> Metrics | None:
    try:
        response = await client.get(f"{root}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    return parse_prometheus(response.text) if response.status_code == 200 else None


async def pool_stats(master: str) -> dict[str, Any] | None:
    """The master's Stats as a dict, or None when there is no master or it does not answer."""
    if not master:
        return None
    from kvpool.pool.stats_client import fetch_stats

    try:
        return await fetch_stats(master)
    except SystemExit:  # fetch_stats' way of saying the master did not answer
        return None


async def snapshot(client: httpx.AsyncClient, probes: ClusterProbes) -> dict[str, Metrics]:
    """Every endpoint's metrics now; those that did not answer are absent."""
    names = probes.all()
    results = await asyncio.gather(*(scrape(client, root) for root in names.values()))
    return {name: m for name, m in zip(names, results) if m is not None}


def buckets(metrics: Metrics, name: str) -> dict[float, float]:
    """Histogram ``name``'s cumulative counts by upper bound (``le``), summed over its other labels."""
    found: dict[float, float] = {}
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != f"{name}_bucket":
            continue
        le = rest.partition('le="')[2].partition('"')[0]
        bound = math.inf if le == "+Inf" else float(le)
        found[bound] = found.get(bound, 0.0) + value
    return found


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float:
    """The ``q`` quantile of a histogram's observations, as Prometheus's ``histogram_quantile`` estimates it.

    The bucket holding rank ``q × count`` is found and the value interpolated linearly within it (from
    0, or the bound below); a rank in the ``+Inf`` bucket gives the highest finite bound. An estimate, as
    fine as the buckets; nan without observations.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q: must be in [0, 1], got {q}")
    bounds = sorted(cumulative)
    count = cumulative.get(math.inf, cumulative[bounds[-1]] if bounds else 0.0)
    if count <= 0:
        return math.nan
    rank = q * count
    lower, below = 0.0, 0.0
    for bound in bounds:
        here = cumulative[bound]
        if here >= rank and here > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (here - below)
        lower, below = bound, here
    return lower


def delta(after: Metrics, before: Metrics) -> Metrics:
    """Counters and histogram sums advanced during the run (gauges: the value after)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


@dataclass(slots=True)
class DecodeSampler:
    """Polls ``kvpool_decode_pages_used / _total`` of every shard; keeps each sample's utilization."""

    client: httpx.AsyncClient
    shards: dict[str, str]
    interval_s: float = 0.5
    samples: list[float] = field(default_factory=list)

    async def run(self) -> None:
        while True:
            for metrics in await asyncio.gather(*(scrape(self.client, r) for r in self.shards.values())):
                if metrics is None:
                    continue
                pages = total(metrics, "kvpool_decode_pages_total")
                if pages > 0:
                    self.samples.append(total(metrics, "kvpool_decode_pages_used") / pages)
            await asyncio.sleep(self.interval_s)

    def peak(self) -> float:
        return max(self.samples) if self.samples else math.nan

    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else math.nan
