"""The OpenAI-compatible request bodies as pydantic models: what each field may hold, checked by validation.

Each field's type is what the OpenAPI schema shows (``openapi.py``); its
validator is the check, and a refusal is a ``FieldError`` that the one mapping
in ``openai_errors.api_error_of_validation`` turns into a 400 naming the
field where pydantic found it (``messages[0].content``). Fields are declared
in the order they are checked, so the first refusal is the one answered. The
generation fields' ranges are the core's (``kvpool.core.api.generation_fields``,
shared with gRPC); what needs the served model (roles, vocabulary, context)
comes in the validation context (``Served``). Checks that need the prompt's
tokens (the context left for ``max_tokens``) run after validation, in
``openai_schema``. Fields this server does not implement are refused by name
when they ask for something, and taken as hints otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, PlainValidator, PrivateAttr, ValidationInfo, model_validator

from kvpool.core.api.generation_fields import (
    OPENAI_FIELDS,
    Sampling,
    check_prompt_text,
    check_sampling,
    check_session_key,
    check_token_ids,
)
from kvpool.core.decode.stop_strings import StopMatcher
from kvpool.core.errors import InvalidArgument
from kvpool.core.sessions.table import check_expected_next_s
from kvpool.tokenizer import Tokenizer, tools_text
from kvpool.services.router.generation_request import ModelLimits
from kvpool.services.router.openai_errors import FieldError

# a client's session, when the body names none: headers agent harnesses send
SESSION_HEADERS = ("x-session-id", "x-session-affinity")


@dataclass(frozen=True, slots=True)
class Served:
    """What the checks read from the server (the validation context): its model, tokenizer, chat roles, and
    the request's headers (a session may come from them)."""

    tokenizer: Tokenizer
    limits: ModelLimits
    roles: frozenset[str] = frozenset()
    headers: Mapping[str, str] = field(default_factory=dict)


def _served(info: ValidationInfo) -> Served:
    served = info.context
    assert isinstance(served, Served), "validate with context=Served(...)"
    return served


def _core(check: Callable[..., Any], *args: Any) -> Any:
    """A core check whose ``InvalidArgument`` refuses the field it names."""
    try:
        return check(*args)
    except InvalidArgument as exc:
        raise FieldError.of(exc) from None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _checked(check: Callable[..., Any], shown: Any) -> Any:
    """A field checked by ``check`` alone; the schema shows ``shown``."""
    return PlainValidator(check, json_schema_input_type=shown)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- field kinds ------------------------------------------------------------------------------------------


def _integer(value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise FieldError(f"must be an integer, got {_show(value)}")
    return int(value)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(f"must be a number, got {_show(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer past float's range
        raise FieldError("must be a number in range, got an integer too large for a float") from None


def _flag(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise FieldError(f"must be true or false, got {_show(value)}")
    return value


def _unsupported(value: Any) -> Any:
    if value not in (None, False, 0, ""):
        raise FieldError("is not supported by this server", "unsupported_parameter")
    return None


def _zero_penalty(value: Any) -> Any:
    if value not in (None, 0, 0.0):
        raise FieldError("is not supported by this server (only 0)", "unsupported_value")
    return None


def _best_of(value: Any) -> Any:
    if value not in (None, 1):
        raise FieldError("only best_of = 1 is supported", "unsupported_value")
    return None


def _n(value: Any) -> int:
    n = _integer(value)
    if n not in (None, 1):
        raise FieldError("only n = 1 is supported", "unsupported_value")
    return 1


def _model(value: Any, info: ValidationInfo) -> str:
    name = _served(info).limits.name
    if value is None or value == "":
        return name  # lenient, missing or empty alike: the one model served
    if not isinstance(value, str) or value != name:
        raise FieldError(f"{_show(value)} is not served here; this server serves {name!r}", "model_not_found")
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise FieldError("must be a string or a list of strings")
    _core(StopMatcher.of, stops)
    return stops


def _session_key(value: Any, info: ValidationInfo) -> str | None:
    if value is None or value == "" or info.data.get("prompt_cache_key"):
        return None  # prompt_cache_key given: user is not the session, so not read
    if not isinstance(value, str):
        raise FieldError("must be a string")
    assert info.field_name is not None
    return _core(check_session_key, value, info.field_name)


def _cache_salt(value: Any) -> str:
    """vLLM's field: only requests with the same salt share cached prefixes."""
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        raise FieldError("must be a non-empty string")
    return _core(check_session_key, value, "cache_salt")


def _session_end(value: Any, info: ValidationInfo) -> bool:
    session_end = bool(_flag(value))
    if session_end and not _session_of(info):
        raise FieldError("needs a session: give prompt_cache_key (or user)")
    return session_end


def _expected_next_s(value: Any, info: ValidationInfo) -> float | None:
    """kvpool's hint: the session's next turn in about this many seconds; it needs a session, and no turn
    follows one that ends."""
    expected = _number(value)
    if expected is None:
        return None
    _core(check_expected_next_s, expected)
    if not _session_of(info):
        raise FieldError("needs a session: give prompt_cache_key (or user)")
    if info.data.get("session_end"):
        raise FieldError("not with session_end: true (no turn follows)")
    return expected


def _session_of(info: ValidationInfo) -> str:
    return _core(session_of, info.data.get("prompt_cache_key"), info.data.get("user"), _served(info).headers)


def session_of(prompt_cache_key: str | None, user: str | None, headers: Mapping[str, str]) -> str:
    """The session: ``prompt_cache_key``, else ``user``, else a session header harnesses send (checked here:
    an ``InvalidArgument`` naming the header)."""
    if prompt_cache_key or user:
        return prompt_cache_key or user or ""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return check_session_key(value, name)
    return ""


def _stream_options(value: Any, info: ValidationInfo) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError("must be an object")
    if not info.data.get("stream"):
        raise FieldError("is only allowed with stream: true")
    return value


Integer = Annotated[int | None, _checked(_integer, int | None)]
Number = Annotated[float | None, _checked(_number, float | None)]
Flag = Annotated[bool | None, _checked(_flag, bool | None)]
Unsupported = Annotated[Any, _checked(_unsupported, Any)]
ZeroPenalty = Annotated[float | None, _checked(_zero_penalty, float | None), Field(description="only 0")]
SessionKey = Annotated[str | None, _checked(_session_key, str | None), Field(description="at most 256 bytes of UTF-8")]


def _prompt(value: Any, info: ValidationInfo) -> str | list[int]:
    """A completion's prompt: text, or token ids in the vocabulary; a batch of one is that one prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    served = _served(info)
    if isinstance(value, str):
        if not value:
            raise FieldError("must not be empty")
        _core(check_prompt_text, len(value), served.tokenizer.max_token_bytes, served.limits.context, "prompt")
        return value
    types = set(map(type, value)) if isinstance(value, list) else set()
    if value and types and all(issubclass(t, int) and t is not bool for t in types):
        token_ids = value if types == {int} else [int(t) for t in value]
        if not 0 <= min(token_ids) <= max(token_ids) < served.limits.vocab_size:
            _core(check_token_ids, token_ids, served.limits.vocab_size, "prompt")
        return token_ids
    if isinstance(value, list) and not value:
        raise FieldError("must not be empty")
    if value is None:
        raise FieldError("is required", "missing_required_parameter")
    raise FieldError("must be a string or a list of token ids (one prompt per request)")


def _tool_choice(value: Any) -> str | None:
    if value not in (None, "none", "auto"):
        raise FieldError("only \"auto\" and \"none\" are supported: this server cannot force a tool call",
                         "unsupported_value")
    return value


def _response_format(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError("must be an object such as {\"type\": \"text\"}")
    if value.get("type") != "text":
        raise FieldError(f"type {value.get('type')!r} is not supported: only \"text\" (this server does not "
                         "constrain output to JSON)", "unsupported_value")
    return value


def _tools(value: Any) -> list[dict[str, Any]]:
    """Tools are served as prompt text, rendered through the chat template."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise FieldError("must be a list of tool objects")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise FieldError("must be an object such as {\"type\": \"function\", \"function\": {...}}", at=(i,))
    return value


def _messages(value: Any, info: ValidationInfo) -> list[dict[str, str]]:
    """The conversation as the chat template takes it. One check over the whole list, not a model per message:
    a 32 MiB body holds a million messages."""
    if value is None:
        raise FieldError("is required", "missing_required_parameter")
    if not isinstance(value, list):
        raise FieldError("must be a list of message objects")
    if not value:
        raise FieldError("must not be empty")
    roles = _served(info).roles
    return [_message(i, message, roles) for i, message in enumerate(value)]


def _message(i: int, message: Any, roles: frozenset[str]) -> dict[str, str]:
    """A ``ChatMessage`` checked; its tool calls kept in its text as JSON."""
    if not isinstance(message, dict):
        raise FieldError("must be an object with role and content", at=(i,))
    role = message.get("role")
    if role not in roles:
        raise FieldError(f"must be one of {sorted(roles)}, got {_show(role)}", at=(i, "role"))
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise FieldError("only text parts ({\"type\": \"text\", \"text\": ...}) are supported",
                                 at=(i, "content", j))
            parts.append(part["text"])
        text = "".join(parts)
    else:
        raise FieldError("must be a string, a list of text parts, or null", at=(i, "content"))
    calls = message.get("tool_calls")
    if calls:
        # the history the agent sends is the prompt: keep its tool calls as text
        text += json.dumps(calls, separators=(",", ":"), sort_keys=True)
    if role == "assistant" or calls or text:
        return {"role": role, "content": text}
    raise FieldError("must not be empty", at=(i, "content"))


def _chat_max_tokens(value: Any, info: ValidationInfo) -> int | None:
    if info.data.get("max_completion_tokens") is not None:
        return None  # the newer name wins; this one is not read
    return _integer(value)


class TextPart(BaseModel):
    """One part of a message's content: only text is served."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn, as the schema shows it; ``_message`` checks it (roles are the served template's)."""

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the usage and no choices."""

    include_usage: Flag = None


StreamOptionsField = Annotated[StreamOptions | None, BeforeValidator(_stream_options)]


class _Generation(BaseModel):
    """The checks across fields that both routes share; each route's model declares its fields in the order
    they are checked (a route's own first, then ``temperature`` ... ``cache_salt``)."""

    _sampling: Sampling | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_sampling(self, info: ValidationInfo) -> _Generation:
        fields: dict[str, Any] = self.__dict__
        temperature, top_p = fields["temperature"], fields["top_p"]
        self._sampling = _core(check_sampling, 1.0 if temperature is None else temperature,
                               1.0 if top_p is None else top_p, fields["top_k"] or 0, fields["seed"],
                               _served(info).limits.vocab_size, OPENAI_FIELDS)
        return self

    @property
    def sampling(self) -> Sampling:
        assert self._sampling is not None
        return self._sampling


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt, text or token ids."""

    model: Annotated[str | None, _checked(_model, str | None)] = None
    echo: Unsupported = None
    logprobs: Unsupported = None
    suffix: Unsupported = None
    best_of: Annotated[int | None, _checked(_best_of, int | None), Field(description="only 1")] = None
    frequency_penalty: ZeroPenalty = None
    presence_penalty: ZeroPenalty = None
    prompt: Annotated[str | list[int] | list[str] | list[list[int]],
                      _checked(_prompt, str | list[int] | list[str] | list[list[int]])] = Field(
        default=None, validate_default=True, description="one prompt: text or token ids (a batch of one)")
    max_tokens: Integer = None
    temperature: Number = None
    top_p: Number = None
    top_k: Integer = None
    seed: Integer = None
    n: Annotated[int | None, _checked(_n, int | None), Field(description="only 1")] = None
    stream: Flag = None
    stream_options: StreamOptionsField = None
    prompt_cache_key: SessionKey = None
    user: SessionKey = None
    session_end: Annotated[bool | None, _checked(_session_end, bool | None)] = None
    expected_next_s: Annotated[float | None, _checked(_expected_next_s, float | None)] = None
    stop: Annotated[str | list[str] | None, _checked(_stop, str | list[str] | None)] = None
    cache_salt: Annotated[str | None, _checked(_cache_salt, str | None)] = None


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``: the conversation, rendered through the model's chat template."""

    model: Annotated[str | None, _checked(_model, str | None)] = None
    logprobs: Unsupported = None
    top_logprobs: Unsupported = None
    audio: Unsupported = None
    prediction: Unsupported = None
    frequency_penalty: ZeroPenalty = None
    presence_penalty: ZeroPenalty = None
    tool_choice: Annotated[Literal["none", "auto"] | None, _checked(_tool_choice, Literal["none", "auto"] | None)] = None
    parallel_tool_calls: Flag = None
    response_format: Annotated[dict[str, Any] | None, _checked(_response_format, dict[str, Any] | None)] = None
    messages: Annotated[list[dict[str, str]], _checked(_messages, list[ChatMessage])] = Field(
        default=None, validate_default=True)  # type: ignore
    tools: Annotated[list[dict[str, Any]] | None, _checked(_tools, list[dict[str, Any]] | None)] = None
    max_completion_tokens: Integer = None
    max_tokens: Annotated[int | None, _checked(_chat_max_tokens, int | None)] = None
    temperature: Number = None
    top_p: Number = None
    top_k: Integer = None
    seed: Integer = None
    n: Annotated[int | None, _checked(_n, int | None), Field(description="only 1")] = None
    stream: Flag = None
    stream_options: StreamOptionsField = None
    prompt_cache_key: SessionKey = None
    user: SessionKey = None
    session_end: Annotated[bool | None, _checked(_session_end, bool | None)] = None
    expected_next_s: Annotated[float | None, _checked(_expected_next_s, float | None)] = None
    stop: Annotated[str | list[str] | None, _checked(_stop, str | list[str] | None)] = None
    cache_salt: Annotated[str | None, _checked(_cache_salt, str | None)] = None

    @model_validator(mode="after")
    def _prompt_text(self, info: ValidationInfo) -> ChatCompletionRequest:
        """Text past what the context could hold is refused before it is tokenized."""
        served = _served(info)
        num_chars = sum(len(m["content"]) for m in self.messages)
        num_chars += len(tools_text(self.tools)) if self.tools else 0
        _core(check_prompt_text, num_chars, served.tokenizer.max_token_bytes, served.limits.context, "messages")
        return self

