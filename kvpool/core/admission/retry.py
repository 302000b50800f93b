"""Where a request may go after a part failed it: another pipeline, another decode shard, or nowhere.

Pure. ``Admission`` (``kvpool.core.admission.admission``) asks ``retry_move`` before
it moves a ticket (``Admission.retry``, ``retry_may_wait``, ``move_shard``).

Rules: a retry only for an UNAVAILABLE part and only before any token
reached the client: a failed prefill pipeline moves the request once to
another healthy pipeline, keeping its shard and room (when none has device
room now, the request waits for some: ``retry_may_wait``); a decode shard
that is down or unreachable (a call to it failed, or prefill could not write
to it: the error names the field ``target``) moves it once to another healthy
shard with room, whose room it takes instead (``move_shard``), and the
request is prefilled again there: its prefix is in the device cache or the
pool by then, so little is computed twice. With no other pipeline, and
``health_wait_s`` > 0, a request its pipeline failed retries there once a
health round begun after the failure finds it serving
(``retry(failed_round=...)``): a stage restarted behind it.
"""

from __future__ import annotations

import enum

from kvpool.core.admission.room import Ticket
from kvpool.core.errors import KvpoolError, Unavailable

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
