"""Domain errors of the core: plain exceptions, no transport.

Each names what is wrong and, for bad input, the field. The service edge
(``kvpool.status``) maps each class to one gRPC status code; nothing here
knows about gRPC.
"""

from __future__ import annotations


class KvpoolError(Exception):
    """Base of every domain error."""


class InvalidArgument(KvpoolError):
    """A request field is malformed; the message names the field."""


class NotFound(KvpoolError):
    """The named thing (segment, request, handle) does not exist."""


class FailedPrecondition(KvpoolError):
    """The request is well-formed but the system is in the wrong state for it."""


class ResourceExhausted(KvpoolError):
    """No room (pool space, device blocks, pages) now; the caller may retry later."""


class Unavailable(KvpoolError):
    """A dependency is down or the service is not ready yet."""
