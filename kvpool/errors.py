"""Domain errors and the one place they become gRPC status codes."""

from __future__ import annotations

import grpc


class KvpoolError(Exception):
    """Base of every domain error; ``code`` is the gRPC status it maps to."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(KvpoolError):
    """A request field is malformed; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KvpoolError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KvpoolError):
    """The request is well-formed but the system is in the wrong state for it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KvpoolError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvpoolError):
    code = grpc.StatusCode.UNAVAILABLE


async def abort_with(context: grpc.aio.ServicerContext, error: KvpoolError) -> None:
    """Turn a domain error into a gRPC status; never returns."""
    await context.abort(error.code, str(error))
