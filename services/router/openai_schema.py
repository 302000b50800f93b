"""OpenAI-compatible request bodies → one validated ``GenerationRequest``; errors in OpenAI's shape.

The body arrives parsed (``kvpool.services.router.json_body``) and is
validated by its route's pydantic model (``openai_models``), whose every
refusal becomes an ``ApiError`` (``openai_errors.api_error_of_validation``)
with the HTTP status, OpenAI's error type and ``param`` naming the field, so a
client's mistake is always a 4xx that says what to fix. What needs the
prompt's tokens is checked here, after tokenizing: the prompt and
``max_tokens`` within the context the cluster serves
(``kvpool.core.api.generation_fields.check_length``, as gRPC's ``Generate``).
docs/api.md lists every field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from kvpool.core.api.generation_fields import check_length
from kvpool.core.errors import InvalidArgument
from kvpool.tokenizer import Tokenizer
from kvpool.services.router.generation_request import GenerationRequest, ModelLimits
from kvpool.services.router.openai_errors import api_error_of, api_error_of_validation, invalid
from kvpool.services.router.openai_models import (
    SESSION_HEADERS,
    ChatCompletionRequest,
    CompletionRequest,
    Served,
    session_of,
)

__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "SESSION_HEADERS", "parse_chat", "parse_completion"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def parse_completion(body: Mapping[str, Any], tokenizer: Tokenizer, limits: ModelLimits,
                     headers: Mapping[str, str] | None = None) -> GenerationRequest:
    request = _validated(CompletionRequest, body, Served(tokenizer, limits, headers=headers or {}))
    assert isinstance(request, CompletionRequest)
    prompt = request.prompt
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    return _finish(request, "completion", prompt_ids, "prompt", max_tokens, "max_tokens", tokenizer, limits,
                   headers)


def parse_chat(body: Mapping[str, Any], tokenizer: Tokenizer, limits: ModelLimits, roles: frozenset[str],
               headers: Mapping[str, str] | None = None) -> GenerationRequest:
    request = _validated(ChatCompletionRequest, body, Served(tokenizer, limits, roles, headers or {}))
    assert isinstance(request, ChatCompletionRequest)
    try:
        prompt_ids = tokenizer.apply_chat_template(request.messages, request.tools or [])
    except ValueError as exc:  # a model directory's template refusing the messages
        raise invalid("messages", str(exc).removeprefix("messages: ")) from None
    name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(limits.default_max_tokens, limits.context - len(prompt_ids)))
    return _finish(request, "chat", prompt_ids, "messages", max_tokens, name, tokenizer, limits, headers)


def _validated(model: type[BaseModel], body: Mapping[str, Any], served: Served) -> BaseModel:
    try:
        return model.model_validate(body, context=served)
    except ValidationError as exc:
        raise api_error_of_validation(exc) from None


def _finish(request: CompletionRequest | ChatCompletionRequest, kind: str, prompt_ids: list[int],
            prompt_name: str, max_tokens: int, max_name: str, tokenizer: Tokenizer, limits: ModelLimits,
            headers: Mapping[str, str] | None) -> GenerationRequest:
    _checked(check_length, len(prompt_ids), max_tokens, limits.context, prompt_name, max_name)
    sampling = request.sampling
    session_key = _checked(session_of, request.prompt_cache_key, request.user, headers or {})
    return GenerationRequest(
        kind=kind, model=limits.name, prompt_ids=prompt_ids, max_tokens=max_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
        stops=request.stop or [], stop_token_ids=list(tokenizer.eos_token_ids), stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        session_key=session_key, cache_salt=request.cache_salt or "",
        session_end=bool(request.session_end), expected_next_s=request.expected_next_s,
    )


def _checked(check: Callable[..., Any], *args: Any) -> Any:
    """A core check whose ``InvalidArgument`` becomes a 400 naming the field."""
    try:
        return check(*args)
    except InvalidArgument as exc:
        raise api_error_of(exc) from None
