"""Requests open at once per API key: one key's flood cannot take every place the router has.

Pure (no I/O): the HTTP gate (``auth.ApiGate``) and the gRPC gate (``grpc_auth.GrpcGate``) count into one
``OpenRequests``, so a key's HTTP and gRPC requests share its bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class OpenRequests:
    """How many requests each API key (by its digest) has open, at most ``max_per_key`` each.

    Invariant: ``open_by_key[key_id]`` is the number of ``open`` calls that returned True for ``key_id``
    and were not yet ``close``d, between 1 and ``max_per_key``; a key with none open has no entry.
    """

    max_per_key: int
    open_by_key: dict[bytes, int] = field(default_factory=dict)

    def open(self, key_id: bytes) -> bool:
        """Count one more request of ``key_id`` and return True, or False (nothing counted) at its bound."""
        now = self.open_by_key.get(key_id, 0)
        if now >= self.max_per_key:
            return False
        self.open_by_key[key_id] = now + 1
        return True

    def close(self, key_id: bytes) -> None:
        """A request ``open`` counted has ended."""
        left = self.open_by_key[key_id] - 1
        if left:
            self.open_by_key[key_id] = left
        else:
            del self.open_by_key[key_id]

    def refusal(self) -> str:
        return (f"this API key has {self.max_per_key} requests open, the most one key may "
                "(--max-requests-per-key); try again once one ends")
