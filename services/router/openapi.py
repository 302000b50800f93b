"""``GET /openapi.json``: an OpenAPI 3.1 document of every route the HTTP API serves, built once at app start.

Request bodies are the request models' own JSON schemas (``openai_models``);
success bodies are the small models below, written to match what
``http_api`` answers (permissive: unknown keys are allowed, optional parts
may be absent); every error is OpenAI's shape (``ErrorResponse``). Each
model's nested ``$defs`` are hoisted into ``components/schemas`` so every
``$ref`` is ``#/components/schemas/NAME``. ``build`` refuses a route that has
no entry in ``OPERATIONS``, so the document cannot fall behind the app.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvpool.services.router.openai_models import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
OPENAPI_VERSION = "3.1.0"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- response bodies (what http_api.py answers) ----------------------------------------------------------


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Open):
    """OpenAI's error shape, for every refusal (``openai_errors.ApiError.body``)."""

    error: ErrorDetail


class PromptTokensDetails(_Open):
    cached_tokens: int


class KvpoolUsage(_Open):
    """kvpool's extension: where the prompt's cache came from, and the timings."""

    device_tokens: int
    pool_tokens: int
    computed_tokens: int
    handoff_transfers: int
    handoff_bytes: int
    ttft_seconds: float
    decode_seconds: float
    pipeline: str
    shard: str


class CompletionUsage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    kvpool: KvpoolUsage


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(_Open):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class ChatCompletionMessage(_Open):
    role: str
    content: str | None


class ChatCompletionChoice(_Open):
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(_Open):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Open):
    """``GET /v1/models``: the one served model."""

    object: str
    data: list[ModelCard]


class Health(_Open):
    """``GET /health``: 200 when every target is healthy, else 503 (the same body). ``targets`` and ``supervisor``
    only with a valid API key, or when the API has no keys."""

    status: str
    targets: dict[str, bool] | None = None
    supervisor: dict[str, Any] | None = None


# ---- operations -------------------------------------------------------------------------------------------

_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
    "description": ("one server-sent event: `data` is a chunk in OpenAI's chunk format as JSON (the last chunk "
                    "carries `usage` when `stream_options.include_usage`), a failure after the first token as "
                    "`{\"error\": ...}`, and the stream ends with `data: [DONE]`")}}}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": REF.format(model=name)}}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": _json("ErrorResponse")}


_FORBIDDEN = _error("a request with an `Origin` other than the server's own or a configured one")
_UNAUTHORIZED = _error("with API keys configured: a missing or unknown `Authorization: Bearer KEY`")
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds to wait"}}


def _generation(summary: str, request: str, answer: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": "the answer: one JSON object, or server-sent events with `stream: true`",
                    "content": {**_json(answer), **_SSE}},
            "400": _error("a field refused (`error.param` names it), a model not served, or a body that is "
                          "not a JSON object"),
            "401": _UNAUTHORIZED,
            "403": _FORBIDDEN,
            "408": _error("the body did not all arrive within the read timeout"),
            "413": _error("the body is larger than the limit"),
            "429": {**_error("no room now (the router's queue, or the tenant's request rate)"),
                    "headers": _RETRY_AFTER},
            "500": _error("a server bug (still OpenAI's shape)"),
            "503": _error("no prefill pipeline or decode shard can take the request"),
        },
    }


def _get(summary: str, answer: dict[str, Any], *, gated: bool = True) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": answer}
    if gated:
        responses["401"] = _UNAUTHORIZED
    responses["403"] = _FORBIDDEN
    return {"summary": summary, "responses": responses}


OPERATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "/v1/completions": {"post": _generation("a completion of one prompt", "CompletionRequest", "Completion")},
    "/v1/chat/completions": {"post": _generation("a chat completion", "ChatCompletionRequest", "ChatCompletion")},
    "/v1/models": {"get": _get("the served model", {"description": "the model list", "content": _json("ModelList")})},
    "/health": {"get": {**_get("every target's health", {
        "description": "every target is healthy", "content": _json("Health")}, gated=False)}},
    "/openapi.json": {"get": _get("this document", {"description": "the OpenAPI 3.1 document", "content": {
        "application/json": {"schema": {"type": "object"}}}})},
}
OPERATIONS["/health"]["get"]["responses"]["503"] = {"description": "some target is unhealthy (or none is known)",
                                                    "content": _json("Health")}

_REQUIRED = {CompletionRequest: ("prompt",), ChatCompletionRequest: ("messages",)}
_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, ErrorResponse, Completion,
                                        ChatCompletion, ModelList, Health)


def _schemas() -> dict[str, Any]:
    """Every model's schema under its name, nested ``$defs`` hoisted beside it."""
    schemas: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(ref_template=REF)
        for name, nested in schema.pop("$defs", {}).items():
            assert schemas.get(name, nested) == nested, f"two schemas named {name}"
            schemas[name] = nested
        # a field the validator requires but that pydantic sees with a default (to word the refusal itself)
        for name in _REQUIRED.get(model, ()):  # type: ignore[call-overload]
            schema["properties"][name].pop("default", None)
            schema["required"] = sorted({*schema.get("required", ()), name})
        schemas[model.__name__] = schema
    return schemas


def build(routes: Iterable[tuple[str, Iterable[str]]], title: str = "kvpool") -> dict[str, Any]:
    """The document for ``routes`` (path, methods); a route without an entry in ``OPERATIONS`` is a bug."""
    paths: dict[str, Any] = {}
    for path, methods in routes:
        for method in methods:
            method = method.lower()
            if method == "head":
                continue  # Starlette adds HEAD beside each GET
            operation = OPERATIONS.get(path, {}).get(method)
            if operation is None:
                raise ValueError(f"{method.upper()} {path} is served but not documented in openapi.OPERATIONS")
            paths.setdefault(path, {})[method] = operation
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": f"{title} OpenAI-compatible API", "version": "1"},
        "paths": paths,
        "components": {"schemas": _schemas()},
    }
