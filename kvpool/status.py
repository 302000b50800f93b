"""The service edge: domain errors become gRPC status codes, in one place.

A domain error's ``field`` and ``retry_after_s`` travel as trailing metadata
(``kvpool-field``, ``kvpool-retry-after-s``) next to the status, so a caller
rebuilds the same error without ever parsing the message text.
"""

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
    NoRoomNow,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    RestoreFellShort,
    Unavailable,
)

_log = structlog.get_logger(__name__)
R = TypeVar("R")

FIELD_KEY = "kvpool-field"
RETRY_AFTER_KEY = "kvpool-retry-after-s"

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
_KINDS: dict[str, type[KvpoolError]] = {cls.__name__: cls
                                        for cls in (DeviceCacheLost, RestoreFellShort, NoRoomNow)}
# a RestoreFellShort's corrupt chunks, comma-separated
CORRUPT_CHUNKS_KEY = "kvpool-corrupt-chunks"
# a NoRoomNow's count of the shard's give-backs
ROOM_EPOCH_KEY = "kvpool-room-epoch"


def error_kind(exc: grpc.aio.AioRpcError) -> type[KvpoolError] | None:
    """The named domain error a downstream service raised, if it named one."""
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_KIND_KEY:
            return _KINDS.get(value)
    return None


def error_field(exc: grpc.aio.AioRpcError) -> str:
    """The field a downstream service's error named ("" when none)."""
    for key, value in exc.trailing_metadata() or ():
        if key == FIELD_KEY and isinstance(value, str):
            return value
    return ""


def status_code(error: KvpoolError) -> grpc.StatusCode:
    """The status a domain error maps to; its nearest mapped base class decides."""
    for cls in type(error).__mro__:
        code = _CODES.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def error_metadata(error: KvpoolError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries an error's field and retry hint."""
    metadata = []
    if type(error).__name__ in _KINDS:
        metadata.append((ERROR_KIND_KEY, type(error).__name__))
    if error.field:
        metadata.append((FIELD_KEY, error.field))
    if error.retry_after_s is not None:
        metadata.append((RETRY_AFTER_KEY, f"{error.retry_after_s:g}"))
    if isinstance(error, RestoreFellShort) and error.corrupt_chunk_indexes:
        metadata.append((CORRUPT_CHUNKS_KEY, ",".join(str(i) for i in error.corrupt_chunk_indexes)))
    if isinstance(error, NoRoomNow) and error.room_epoch is not None:
        metadata.append((ROOM_EPOCH_KEY, str(error.room_epoch)))
    return tuple(metadata)


def room_epoch(exc: grpc.aio.AioRpcError) -> int | None:
    """The give-back count a shard's ``NoRoomNow`` named (None: the answer was no such refusal, or named none
    that parses)."""
    for key, value in exc.trailing_metadata() or ():
        if key == ROOM_EPOCH_KEY and isinstance(value, str):
            return int(value) if value.isdigit() else None
    return None


def corrupt_chunks(exc: grpc.aio.AioRpcError) -> tuple[int, ...]:
    """The corrupt chunk indexes a downstream ``RestoreFellShort`` named (none when it named none, or they
    do not parse)."""
    for key, value in exc.trailing_metadata() or ():
        if key == CORRUPT_CHUNKS_KEY and isinstance(value, str):
            try:
                return tuple(int(i) for i in value.split(",") if i)
            except ValueError:
                return ()
    return ()


def rejected(error: KvpoolError, method: str = "") -> grpc.StatusCode:
    """The status a call ends with for ``error``, logged (``request_rejected``)."""
    code = status_code(error)
    _log.info("request_rejected", method=method, code=code.name, reason=str(error), field=error.field)
    return code


async def abort(context: grpc.aio.ServicerContext, error: KvpoolError, method: str = "") -> None:
    """End the call with the error's status, message and metadata (raises, as ``context.abort`` does)."""
    code = rejected(error, method)
    await context.abort(code, str(error), trailing_metadata=error_metadata(error))


def from_status(
    exc: grpc.aio.AioRpcError, where: str, passed_on: tuple[type[KvpoolError], ...]
) -> KvpoolError:
    """A downstream service's error as ours: the kinds in ``passed_on`` keep their meaning, message,
    field and retry hint (the caller's mistake stays the caller's, and ``where`` — an internal
    address — stays out of it); anything else means ``where`` is unavailable (keeping the field
    an UNAVAILABLE answer named)."""
    code = exc.code()
    metadata = {key: value for key, value in (exc.trailing_metadata() or ()) if isinstance(value, str)}
    retry_after = metadata.get(RETRY_AFTER_KEY)
    for kind in passed_on:
        if _CODES[kind] == code:
            return kind(exc.details() or code.name, field=metadata.get(FIELD_KEY) or "",
                        retry_after_s=float(retry_after) if retry_after else None)
    # an unavailable backend's own field says which part it could not reach (a prefill that
    # could not write to its decode ``target``), so the caller can blame the right one
    field = metadata.get(FIELD_KEY) if code == grpc.StatusCode.UNAVAILABLE else None
    return Unavailable(f"{where}: {code.name}: {exc.details()}", field=field or "")


def status_errors(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Decorate a servicer method: domain errors become gRPC status codes, in one place."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except KvpoolError as exc:
            await abort(context, exc, method.__name__)
            raise  # unreachable: abort raises

    return wrapper
