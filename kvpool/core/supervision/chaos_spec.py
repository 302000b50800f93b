"""A chaos run's faults: ``kvpool replay --chaos SPEC``, parsed and checked before anything starts.

Pure: no I/O. SPEC is a comma-separated list of ``KIND:TARGET[=ARG]@TIME``::

    kill:store0@30s,kill:master@60s,kill:p1-stage2@90s,kill:decode1@120s,slow:store1=200ms@150s,corrupt:store0@180s

- ``kill:NAME@T`` — the process is killed with SIGKILL at T (the supervisor restarts it).
- ``slow:STORE=D@T`` — from T on, for ``SLOW_WINDOW_S``, the store answers D late: it is held
  stopped D out of every 2·D (see the tool for how).
- ``corrupt:STORE@T`` — the bytes of the store's segment are overwritten at T.

Times are ``30s``, ``1.5s``, ``500ms`` or ``2m`` after the run starts; durations the same.
Names: ``master``, ``router``, ``storeN``, ``decodeN``, ``pP-stageS``; ``check_targets`` holds
them against the cluster's own. Every error names the part at fault.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection
from dataclasses import dataclass

from kvpool.core.errors import InvalidArgument

SLOW_WINDOW_S = 20.0  # how long a ``slow:`` fault lasts
_NAME = re.compile(r"^(master|router|store\d+|decode\d+|p\d+-stage\d+)$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0}


class FaultKind(enum.Enum):
    KILL = "kill"
    SLOW = "slow"
    CORRUPT = "corrupt"


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: what, to whom, when (seconds after the run starts); ``delay_s`` for ``slow`` only."""

    kind: FaultKind
    target: str
    at_s: float
    delay_s: float = 0.0

    @property
    def label(self) -> str:
        arg = f"={self.delay_s * 1000:g}ms" if self.kind is FaultKind.SLOW else ""
        return f"{self.kind.value}:{self.target}{arg}@{self.at_s:g}s"


class ChaosSpecError(InvalidArgument):
    """A SPEC that cannot be run; the message quotes the bad part."""

    def __init__(self, part: str, why: str) -> None:
        super().__init__(f"chaos: {part!r}: {why}", field="chaos")


def parse_duration(text: str) -> float:
    """``30s``, ``1.5s``, ``500ms``, ``2m`` as seconds; ValueError otherwise."""
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a duration such as 30s, 500ms or 2m")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def parse_chaos(spec: str) -> list[Fault]:
    """The faults of SPEC in time order (ties keep SPEC's order); ChaosSpecError naming the bad part."""
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip():
        raise ChaosSpecError(spec, "empty: give at least one fault such as kill:store0@30s")
    faults = [_parse_part(part) for part in parts]
    return sorted(faults, key=lambda f: f.at_s)


def _parse_part(part: str) -> Fault:
    if not part:
        raise ChaosSpecError(part, "an empty fault (two commas in a row, or one at an end)")
    head, at, when = part.rpartition("@")
    if not at:
        raise ChaosSpecError(part, "no time: write KIND:TARGET@TIME, e.g. kill:store0@30s")
    try:
        at_s = parse_duration(when)
    except ValueError as exc:
        raise ChaosSpecError(part, f"time: {exc}") from None
    kind_text, colon, target = head.partition(":")
    if not colon:
        raise ChaosSpecError(part, "no kind: write KIND:TARGET@TIME with KIND one of kill, slow, corrupt")
    try:
        kind = FaultKind(kind_text)
    except ValueError:
        raise ChaosSpecError(part, f"kind {kind_text!r}: one of kill, slow, corrupt") from None
    target, eq, arg = target.partition("=")
    if not _NAME.match(target):
        raise ChaosSpecError(part, f"target {target!r}: one of master, router, storeN, decodeN, pP-stageS")
    if kind is FaultKind.SLOW:
        if not eq:
            raise ChaosSpecError(part, "slow needs its delay: slow:STORE=200ms@TIME")
        try:
            delay_s = parse_duration(arg)
        except ValueError as exc:
            raise ChaosSpecError(part, f"delay: {exc}") from None
        if delay_s <= 0:
            raise ChaosSpecError(part, "delay: must be more than 0")
    elif eq:
        raise ChaosSpecError(part, f"{kind.value} takes no '=' argument")
    else:
        delay_s = 0.0
    if kind is not FaultKind.KILL and not target.startswith("store"):
        raise ChaosSpecError(part, f"{kind.value} applies to a store only, not {target!r}")
    return Fault(kind, target, at_s, delay_s)


def check_targets(faults: Collection[Fault], names: Collection[str]) -> None:
    """ChaosSpecError unless every fault's target is one of the cluster's processes ``names``."""
    for fault in faults:
        if fault.target not in names:
            raise ChaosSpecError(fault.label, f"no process {fault.target!r} in this cluster "
                                              f"(it has {', '.join(sorted(names))})")
