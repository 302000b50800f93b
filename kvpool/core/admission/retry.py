"""Every retry the system makes, in one place: which failures, how many times, where the request goes next.

Pure. Two kinds, each applied in exactly one place per hop:

- **A call that did not reach its answer** (UNAVAILABLE: the peer was restarting, the connection
  was new and the host loaded) is tried again by gRPC itself, for the idempotent calls only
  (``IDEMPOTENT``): ``GRPC_RETRY`` is the channels' service config (``kvpool.service.channel``).
  The same calls made as messages on the master's session stream (``kvpool.pool.session_client``) are sent
  again on a new stream when theirs broke before answering, at most ``GRPC_RETRY``'s attempts in all
  (``session_attempts``). Nothing else resends a call by hand.
- **A request that failed part-way** goes somewhere else, decided here and applied by the one
  service that owns that hop:

  ====================  ==============================  =====================================
  hop                   failure                         next
  ====================  ==============================  =====================================
  router → decode       the pipeline failed (field      another pipeline, same shard, once
                        ``pipeline``), nothing sent     (``retry_move``)
  router → decode       the shard failed, or prefill    another shard, once
                        could not write to it
  stage 0 → stages      a stage lost its device cache   the same pipeline, no device hits,
                        (``DeviceCacheLost``)           once (``replan``)
  stage 0 → stages      a stage restored less than its  the same pipeline, without the pool,
                        forward was planned past        once (``replan``)
                        (``RestoreFellShort``)
  ====================  ==============================  =====================================

  Anything else fails the request, never silently: after a token reached the client nothing is
  retried, and the decode shard fails a Serve whose prefill failed up to the router.

Reconnection (a store mounting on a master that is down, a channel's backoff) is not a retry of a
request: each such loop says its own bounds where it runs.

The router's moves in detail:

Rules: a retry only for an UNAVAILABLE part and only before any token
reached the client: a failed prefill pipeline moves the request once to
another healthy pipeline whose device cache could hold it, keeping its shard;
a decode shard that is down or unreachable (a call to it failed, or prefill
could not write to it: the error names the field ``target``) moves it once to
another shard that takes tickets (``move_shard``), and the request is
prefilled again there: its prefix is in the device cache or the
pool by then, so little is computed twice. With no other pipeline, and
``health_wait_s`` > 0, a request its pipeline failed retries there once a
health round begun after the failure finds it serving
(``retry(failed_round=...)``, ``retry_may_wait``): a stage restarted behind it.
"""

from __future__ import annotations

import enum
import json

from kvpool.core.admission.room import Ticket
from kvpool.core.errors import DeviceCacheLost, KvpoolError, RestoreFellShort, Unavailable

# calls with no effect, or the same effect however often made: gRPC may send them again
IDEMPOTENT = {
    "kvpool.rpc.PoolMaster": ("Lookup", "ReleaseLease", "Exists", "Stats", "Demote"),
    "kvpool.rpc.Decode": ("Landed", "Stats"),
    "kvpool.rpc.PrefillStage": ("StageInfo",),
}
# how gRPC tries an idempotent call again: UNAVAILABLE only (the call never reached an answer), three
# tries in all, 0.1 s then 0.2 s apart (jittered by gRPC), so a loaded host's first connect or a peer's
# restart is ridden out in well under a second of waiting
GRPC_RETRY = {
    "maxAttempts": 3,
    "initialBackoff": "0.1s",
    "maxBackoff": "0.5s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


def session_attempts(kind: str) -> int:
    """How many times a call on the master's session stream (a ``SessionRequest.body`` kind) may be sent, as
    gRPC would try its unary method."""
    method = "".join(part.title() for part in kind.split("_"))
    attempts = int(GRPC_RETRY["maxAttempts"])  # type: ignore[call-overload]
    return attempts if method in IDEMPOTENT["kvpool.rpc.PoolMaster"] else 1


def session_backoff_s(attempt: int) -> float:
    """The wait before sending a session call the ``attempt``-th time (2, 3, ...), as ``GRPC_RETRY`` waits."""
    return min(0.5, 0.1 * 2 ** (attempt - 2))


MAX_REPLANS = 1  # stage 0 plans a request again once, then it fails


def service_config() -> str:
    """The channels' gRPC service config: ``GRPC_RETRY`` for every idempotent call."""
    names = [{"service": service, "method": method} for service, methods in IDEMPOTENT.items() for method in methods]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": GRPC_RETRY}]})

MAX_PREFILL_TRIES = 2  # the first try and one retry elsewhere
MAX_SHARD_TRIES = 2  # the first shard and one other
# the field a prefill error names when it is the decode target (not the pipeline) that failed
TARGET_FIELD = "target"
# the field decode's Serve names when the prefill pipeline it called failed (not the shard)
PIPELINE_FIELD = "pipeline"


class Move(enum.Enum):
    """Where a failed request may go (``retry_move``)."""

    PIPELINE = "pipeline"  # another pipeline; same shard, same room
    SHARD = "shard"  # another shard, its room instead; prefilled again


def may_retry(error: KvpoolError, num_tokens_sent: int, tries: int, max_tries: int = MAX_PREFILL_TRIES) -> bool:
    """Retry eligibility: only an unavailable part, only before anything reached the client
    (nothing it could have seen is repeated), and at most ``max_tries`` tries of a kind of part."""
    return isinstance(error, Unavailable) and num_tokens_sent == 0 and tries < max_tries


def retry_move(error: KvpoolError, num_tokens_sent: int, ticket: Ticket, at_decode: bool) -> Move | None:
    """Where the request may go after ``error``; None: it fails with it.

    ``at_decode``: the failed call was to the ticket's shard (Reserve, Generate).
    A prefill error naming ``target`` is the shard's too: prefill could not write to it.
    """
    if at_decode or error.field == TARGET_FIELD:
        return Move.SHARD if may_retry(error, num_tokens_sent, ticket.shard_tries, MAX_SHARD_TRIES) else None
    return Move.PIPELINE if may_retry(error, num_tokens_sent, ticket.tries) else None


class Replan(enum.Enum):
    """How stage 0 plans a request again after a stage failed its forward."""

    WITHOUT_DEVICE_HITS = "without_device_hits"  # a stage restarted: no device hit of this pipeline holds
    WITHOUT_POOL = "without_pool"  # a stage could not restore what it was given: compute it


def replan(error: KvpoolError, replans: int) -> Replan | None:
    """Whether (and how) stage 0 runs a request again after ``error`` failed its forward, having planned it
    again ``replans`` times already; None: the request fails."""
    if replans >= MAX_REPLANS:
        return None
    if isinstance(error, DeviceCacheLost):
        return Replan.WITHOUT_DEVICE_HITS
    if isinstance(error, RestoreFellShort):
        return Replan.WITHOUT_POOL
    return None
