"""The router's placement policy: which prefill pipeline and which decode shard serve a request.

Pure: no grpc, no I/O. The router feeds it what it sees (requests starting
and ending, health, each shard's free KV pages) and asks for decisions; each
decision carries its reason, which the router counts in metrics.

Rules:
- A session stays on the pipeline that served it last (its history is hot in
  that pipeline's device cache) while that pipeline's queue — requests the
  router has in flight on it — is below ``affinity_max_queue``. Otherwise, or
  for a new session, the least-loaded healthy pipeline takes it (fewest in
  flight, then fewest requests ever placed, then name), and the session moves
  there; the shared pool still serves its history.
- Decode goes to the healthy shard with the most free KV pages, counting the
  pages the router has promised to requests not yet admitted there.
- A pipeline or shard that fails its health check is out of rotation until it
  passes again; when none is healthy, placing raises ``Unavailable``.
- A retry excludes the pipelines that failed the request, for that request
  only; a session whose own pipeline is excluded moves with reason
  ``EXCLUDED_AFTER_FAILURE`` (``UNHEALTHY`` is only for a failed health check).
  Admission leaves out the pipelines whose device cache has no room for the
  request now; a session whose own is one moves with ``DEVICE_CACHE_FULL``.
- Session memory is bounded: the least recently used sessions are forgotten
  past ``max_sessions`` (a forgotten session is placed as a new one). Besides
  its pipeline, a session remembers its last few prompts as fingerprints
  (``session_prefixes``, ``kvpool.core.sessions.prefix``: admission's work
  estimate), forgotten with it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.core.sessions.prefix import PromptPrefix, remember_prompt


class PipelineReason(enum.Enum):
    AFFINITY = "affinity"  # the session's own pipeline, queue below the threshold
    NEW_SESSION = "new_session"  # no session key, or never seen (or forgotten)
    OVERLOADED = "overloaded"  # the session's pipeline queue reached the threshold
    UNHEALTHY = "unhealthy"  # the session's pipeline is out of rotation
    EXCLUDED_AFTER_FAILURE = "excluded_after_failure"  # a retry: the session's pipeline failed this request
    DEVICE_CACHE_FULL = "device_cache_full"  # the session's pipeline has no device blocks for it now


class ShardReason(enum.Enum):
    MOST_FREE_PAGES = "most_free_pages"


@dataclass(slots=True)
class Target:
    """A prefill pipeline or a decode shard the router places requests on: its health and its load."""

    name: str
    healthy: bool = True
    in_flight: int = 0
    placed: int = 0
    free_pages: int = 0  # shards: last reported
    promised_pages: int = 0  # shards: reserved by the router, not yet admitted


@dataclass(frozen=True, slots=True)
class Placement:
    pipeline: str
    pipeline_reason: PipelineReason
    shard: str
    shard_reason: ShardReason


@dataclass(slots=True)
class RoutingPolicy:
    """Placement state and decisions (see the module doc)."""

    affinity_max_queue: int = 4
    max_sessions: int = 100_000
    pipelines: dict[str, Target] = field(default_factory=dict)
    shards: dict[str, Target] = field(default_factory=dict)
    _sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _session_prefixes: dict[str, tuple[PromptPrefix, ...]] = field(default_factory=dict)  # keys: in _sessions

    def __post_init__(self) -> None:
        if self.affinity_max_queue < 1:
            raise InvalidArgument(f"affinity_max_queue: must be >= 1, got {self.affinity_max_queue}")
        if self.max_sessions < 1:
            raise InvalidArgument(f"max_sessions: must be >= 1, got {self.max_sessions}")

    @classmethod
    def of(cls, pipelines: Iterable[str], shards: Iterable[str], **settings: int) -> RoutingPolicy:
        policy = cls(**settings)
        for name in pipelines:
            policy.pipelines[name] = Target(name)
        for name in shards:
            policy.shards[name] = Target(name)
        if not policy.pipelines or not policy.shards:
            raise InvalidArgument("a router needs at least one prefill pipeline and one decode shard")
        return policy

    # ---- what the router sees -------------------------------------------

    def set_health(self, name: str, healthy: bool) -> bool:
        """Mark a pipeline or shard in or out of rotation; True when that changed its state."""
        target = self._target(name)
        changed = target.healthy != healthy
        target.healthy = healthy
        return changed

    def report_free_pages(self, shard: str, free_pages: int) -> None:
        self._shard(shard).free_pages = max(0, free_pages)

    # ---- decisions ------------------------------------------------------

    def place(self, session_key: str, num_pages: int, exclude: Collection[str] = ()) -> Placement:
        """Pick a pipeline and a shard and count the request as in flight on both.

        ``num_pages`` is what the request will hold on its shard. Pipelines in
        ``exclude`` (a retry's failed ones) are out of rotation for this
        request only. The caller must call ``finish`` with the returned
        placement when the request ends, however it ends.
        """
        shard = self._pick_shard()
        name, reason = self.place_pipeline(session_key, exclude)
        shard.in_flight += 1
        shard.placed += 1
        shard.promised_pages += num_pages
        return Placement(name, reason, shard.name, ShardReason.MOST_FREE_PAGES)

    def place_pipeline(self, session_key: str, exclude: Collection[str] = (),
                       full: Collection[str] = (), token_ids: Sequence[int] = ()) -> tuple[str, PipelineReason]:
        """Pick a pipeline alone (admission picks the shard) and count the request in flight on
        it; the caller must call ``finish_pipeline`` when the request ends there. Pipelines in
        ``full`` (no device blocks for this request now) are out for it, as excluded ones are.
        ``token_ids`` (the prompt, when given) join the session's ``session_prefixes``."""
        pipeline, reason = self._pick_pipeline(session_key, exclude, full)
        pipeline.in_flight += 1
        pipeline.placed += 1
        if session_key:
            self._sessions[session_key] = pipeline.name
            self._sessions.move_to_end(session_key)
            if token_ids:
                self._session_prefixes[session_key] = remember_prompt(
                    self._session_prefixes.get(session_key, ()), token_ids)
            while len(self._sessions) > self.max_sessions:
                forgotten, _ = self._sessions.popitem(last=False)
                self._session_prefixes.pop(forgotten, None)
        return pipeline.name, reason

    def finish_pipeline(self, name: str) -> None:
        pipeline = self._pipeline(name)
        pipeline.in_flight = max(0, pipeline.in_flight - 1)

    def admitted(self, placement: Placement, num_pages: int) -> None:
        """The shard took the request's pages: they now show in its own free-page reports."""
        shard = self._shard(placement.shard)
        shard.promised_pages = max(0, shard.promised_pages - num_pages)

    def finish(self, placement: Placement, num_pages_not_admitted: int = 0) -> None:
        """The request ended; ``num_pages_not_admitted`` are promised pages it never took."""
        pipeline = self._pipeline(placement.pipeline)
        shard = self._shard(placement.shard)
        pipeline.in_flight = max(0, pipeline.in_flight - 1)
        shard.in_flight = max(0, shard.in_flight - 1)
        shard.promised_pages = max(0, shard.promised_pages - num_pages_not_admitted)

    def session_pipeline(self, session_key: str) -> str | None:
        return self._sessions.get(session_key)

    def session_prefixes(self, session_key: str) -> tuple[PromptPrefix, ...]:
        """The session's last few placed prompts, newest last; none: unknown, forgotten or no key."""
        return self._session_prefixes.get(session_key, ()) if session_key else ()

    # ---- internals ------------------------------------------------------

    def _pick_pipeline(self, session_key: str, exclude: Collection[str],
                       full: Collection[str] = ()) -> tuple[Target, PipelineReason]:
        healthy = [p for p in self.pipelines.values() if p.healthy and p.name not in exclude and p.name not in full]
        if not healthy:
            raise Unavailable("no healthy prefill pipeline")
        own_name = self._sessions.get(session_key) if session_key else None
        own = self.pipelines.get(own_name) if own_name is not None else None
        if own is None:
            reason = PipelineReason.NEW_SESSION
        elif own.name in exclude:
            reason = PipelineReason.EXCLUDED_AFTER_FAILURE
        elif not own.healthy:
            reason = PipelineReason.UNHEALTHY
        elif own.name in full:
            reason = PipelineReason.DEVICE_CACHE_FULL
        elif own.in_flight >= self.affinity_max_queue:
            reason = PipelineReason.OVERLOADED
        else:
            return own, PipelineReason.AFFINITY
        return min(healthy, key=lambda p: (p.in_flight, p.placed, p.name)), reason

    def _pick_shard(self) -> Target:
        healthy = [s for s in self.shards.values() if s.healthy]
        if not healthy:
            raise Unavailable("no healthy decode shard")
        # most free pages (after promises), then fewest in flight, then name
        return min(healthy, key=lambda s: (s.promised_pages - s.free_pages, s.in_flight, s.name))

    def _target(self, name: str) -> Target:
        target = self.pipelines.get(name) or self.shards.get(name)
        if target is None:
            raise InvalidArgument(f"target: unknown pipeline or shard {name!r}")
        return target

    def _pipeline(self, name: str) -> Target:
        if name not in self.pipelines:
            raise InvalidArgument(f"pipeline: unknown pipeline {name!r}")
        return self.pipelines[name]

    def _shard(self, name: str) -> Target:
        if name not in self.shards:
            raise InvalidArgument(f"shard: unknown decode shard {name!r}")
        return self.shards[name]

