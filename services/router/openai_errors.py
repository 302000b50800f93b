"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status.

Every rejection is an ``ApiError`` with the HTTP status, OpenAI's error type
and ``param`` naming the field, so a client's mistake is always a 4xx that
says what to fix; a domain error from behind the router maps to one here
(``api_error_of``), for the HTTP API and its request checks alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.core.errors import InvalidArgument, KvpoolError, ResourceExhausted, Unavailable

DEFAULT_RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, plus its headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param, code)


def api_error_of(exc: KvpoolError) -> ApiError:
    """A domain error as the HTTP API answers it: bad input 400, no room now 429 (+ Retry-After), else 503."""
    if isinstance(exc, InvalidArgument):
        param = exc.field if exc.field is not None else _leading_field(str(exc))
        return ApiError(400, str(exc), param, "invalid_value")
    if isinstance(exc, ResourceExhausted):
        retry_after = getattr(exc, "retry_after_s", None) or DEFAULT_RETRY_AFTER_S
        return ApiError(429, str(exc), None, "overloaded", "rate_limit_error",
                        {"Retry-After": str(max(1, round(retry_after)))})
    code = "unavailable" if isinstance(exc, Unavailable) else "backend_error"
    return ApiError(503, str(exc), None, code, "server_error")


def _leading_field(message: str) -> str | None:
    head = message.split(":", 1)[0]
    return head if head and " " not in head else None
