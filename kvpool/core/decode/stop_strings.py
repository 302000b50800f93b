"""Stop strings over streamed text: emit as early as possible, never a byte of a stop string.

Pure. Text arrives in pieces (one token's worth at a time); a stop string may
span pieces. ``StopMatcher`` emits everything that cannot be the start of a
stop string and holds back the rest until the next piece decides it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.core.errors import InvalidArgument

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256


@dataclass(slots=True)
class StopMatcher:
    """Invariant: the text emitted so far never contains a stop string, nor ends inside one."""

    stops: tuple[str, ...]
    _held: str = ""
    stopped: bool = field(default=False)

    @classmethod
    def of(cls, stops: Sequence[str], field_name: str = "stop") -> StopMatcher:
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"{field_name}: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for i, stop in enumerate(stops):
            if not stop:
                raise InvalidArgument(f"{field_name}[{i}]: must not be empty")
            if len(stop) > MAX_STOP_CHARS:
                raise InvalidArgument(f"{field_name}[{i}]: longer than {MAX_STOP_CHARS} characters")
        return cls(tuple(stops))

    def push(self, text: str) -> str:
        """The text safe to emit now; sets ``stopped`` when a stop string completed."""
        if self.stopped:
            return ""
        buffer = self._held + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end without a stop: the held-back text was never a stop string after all."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
