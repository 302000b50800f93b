"""Domain errors and the one place they become gRPC status codes."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

_log = structlog.get_logger(__name__)
R = TypeVar("R")


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


def status_errors(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Decorate a servicer method: domain errors become gRPC status codes, in one place."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except KvpoolError as exc:
            _log.info("request_rejected", method=method.__name__, code=exc.code.name, reason=str(exc))
            await context.abort(exc.code, str(exc))
            raise  # unreachable: abort raises

    return wrapper
