"""The settings of the queue both the router's admission queue and stage 0's gate run
(``kvpool.core.prefill.queue``, shared between tenants by ``kvpool.core.prefill.fair_queue``), declared
once: their defaults, their checks, and what they mean.

Each role names what its queue holds (``whose``) and in whose seconds the estimates are (the
pipelines' measured speed at the router, the stage's own at stage 0); the rest is the same.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from kvpool.core.prefill.queue import QueueOrder
from kvpool.core.setting import setting

SCHEDS = ("fifo", "session")


def sched_setting(whose: str) -> Any:
    """``--sched``: the order of ``whose`` queue."""
    return setting("fifo", help=f"the order of {whose}: fifo, arrival order; session, the core's work-aware "
                   "queue (least estimated work first: the prompt's tokens beyond the session's last prompt it "
                   "extends, all of them when none), one waiting --sched-max-wait-s going before every other",
                   choices=SCHEDS)


def sched_max_wait_setting() -> Any:
    return setting(4.0, help="--sched session: one waiting this long goes first (oldest first), and nothing later "
                   "passes it (inf: no aging)")


def sched_max_bypass_setting(seconds: str) -> Any:
    return setting(math.inf, help="--sched session: the bypass budget, seconds of estimated work that later ones "
                   "may overtake a waiting one by; it then waits at most what arrival order would make it wait "
                   f"plus this (kvpool.core.prefill.queue). In {seconds}: the estimates are scaled by the measured "
                   "speed (kvpool.core.prefill.work_scale)", default_text="none")


def sched_reorder_below_setting(seconds: str) -> Any:
    return setting(math.inf, help="--sched session: the backlog gate: while this many seconds of estimated work "
                   "wait, they go in arrival order, and below it in the session order (kvpool.core.prefill.queue); "
                   f"in {seconds}, as for --sched-max-bypass-s", default_text="none")


def tenant_fair_setting(also: str = "") -> Any:
    """``--tenant-fair``: share the queue between tenants by weight (the default), or not; ``also``: what else
    the role shares between tenants."""
    return setting(True, help="share the queue's order between tenants (API keys) by --tenant-weights: "
                   "start-time fair queuing over estimated work, so no tenant waits behind more than its weighted "
                   f"share of another's work (kvpool.core.prefill.fair_queue); --sched orders each tenant's own "
                   f"requests{also}. --no-tenant-fair: every request as if of one tenant")


class QueueSettings(Protocol):
    sched: str
    sched_max_wait_s: float
    sched_max_bypass_s: float
    sched_reorder_below_s: float


def check_queue_settings(settings: QueueSettings) -> None:
    """ValueError naming the field unless the four settings hold."""
    if settings.sched not in SCHEDS:
        raise ValueError(f"sched: {settings.sched!r} is not one of {', '.join(SCHEDS)}")
    if not settings.sched_max_wait_s > 0:
        raise ValueError(f"sched_max_wait_s: must be positive, got {settings.sched_max_wait_s}")
    if not settings.sched_max_bypass_s >= 0:
        raise ValueError(f"sched_max_bypass_s: must be >= 0, got {settings.sched_max_bypass_s}")
    if not settings.sched_reorder_below_s > 0:
        raise ValueError(f"sched_reorder_below_s: must be positive, got {settings.sched_reorder_below_s}")


def queue_order(settings: QueueSettings) -> QueueOrder:
    """The queue's order (``--sched``)."""
    return QueueOrder.WORK if settings.sched == "session" else QueueOrder.FIFO
