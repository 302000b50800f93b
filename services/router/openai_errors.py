"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status.

Every rejection is an ``ApiError`` with the HTTP status, OpenAI's error type
and ``param`` naming the field, so a client's mistake is always a 4xx that
says what to fix; a domain error from behind the router maps to one here
(``api_error_of``), for the HTTP API and its request checks alike. A request
model's refusal (``FieldError`` inside a pydantic validator) maps here too
(``api_error_of_validation``): where pydantic found it (its ``loc``) becomes
the field's name as the API spells it (``param_of``: ``messages[0].content``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

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


class FieldError(ValueError):
    """A request model's refusal, raised in a validator: ``message`` says what is wrong with the value where
    pydantic found it (``at`` goes deeper, e.g. ``("content",)`` from a message's own check); ``error``, when
    given, is the whole answer (a core check's, which names its own field)."""

    def __init__(self, message: str, code: str | None = "invalid_value", at: Sequence[str | int] = (),
                 error: ApiError | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.at = tuple(at)
        self.error = error

    @classmethod
    def of(cls, exc: KvpoolError) -> FieldError:
        error = api_error_of(exc)
        return cls(error.message, error.code, error=error)


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param, code)


def param_of(loc: Sequence[str | int]) -> str:
    """A location in the body as the API names the field: ``("messages", 0, "content")`` → ``messages[0].content``."""
    text = ""
    for key in loc:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text


def api_error_of_validation(exc: ValidationError) -> ApiError:
    """The first refusal of a request model's validation (fields are checked in the order they are declared)."""
    first = exc.errors(include_url=False)[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):
        if cause.error is not None:
            return cause.error
        return invalid(param_of((*first["loc"], *cause.at)), cause.message, cause.code)
    return invalid(param_of(first["loc"]) or None, first["msg"])  # pydantic's own check: a shape no field declares


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
