"""The service edge: domain errors become gRPC status codes, in one place."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

from kvpool.core.errors import (
    DeviceCacheLost,
    FailedPrecondition,
    InvalidArgument,
    KvpoolError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

_log = structlog.get_logger(__name__)
R = TypeVar("R")

_CODES: dict[type[KvpoolError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


# errors a caller must tell apart from others of the same code travel by name in
# the trailing metadata (never parsed out of the message)
ERROR_KIND_KEY = "kvpool-error-kind"
_KINDS: dict[str, type[KvpoolError]] = {cls.__name__: cls for cls in (DeviceCacheLost,)}


def error_kind(exc: grpc.aio.AioRpcError) -> type[KvpoolError] | None:
    """The named domain error a downstream service raised, if it named one."""
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_KIND_KEY:
            return _KINDS.get(value)
    return None


def status_code(error: KvpoolError) -> grpc.StatusCode:
    """The status a domain error maps to; its nearest mapped base class decides."""
    for cls in type(error).__mro__:
        code = _CODES.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def from_status(
    exc: grpc.aio.AioRpcError, where: str, passed_on: tuple[type[KvpoolError], ...]
) -> KvpoolError:
    """A downstream service's error as ours: the kinds in ``passed_on`` keep their meaning
    (the caller's mistake stays the caller's); anything else means ``where`` is unavailable."""
    code = exc.code()
    for kind in passed_on:
        if _CODES[kind] == code:
            return kind(f"{where}: {exc.details()}")
    return Unavailable(f"{where}: {code.name}: {exc.details()}")


def status_errors(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Decorate a servicer method: domain errors become gRPC status codes, in one place."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except KvpoolError as exc:
            code = status_code(exc)
            _log.info("request_rejected", method=method.__name__, code=code.name, reason=str(exc))
            kind = type(exc).__name__
            metadata = ((ERROR_KIND_KEY, kind),) if kind in _KINDS else ()
            await context.abort(code, str(exc), trailing_metadata=metadata)
            raise  # unreachable: abort raises

    return wrapper
