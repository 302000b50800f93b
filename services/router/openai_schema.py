"""OpenAI-compatible request bodies → one validated ``GenerationRequest``; errors in OpenAI's shape.

Every rejection is an ``ApiError`` with the HTTP status, OpenAI's error type
and ``param`` naming the field, so a client's mistake is always a 4xx that
says what to fix. Fields this server does not implement are refused by name
when they ask for something (``n`` > 1, ``logprobs``, ``echo``, ...), and
ignored when they are only hints (``tools``, ``frequency_penalty`` = 0, ...).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.core.stop_strings import MAX_STOP_STRINGS
from kvpool.tokenizer import Tokenizer

MAX_SESSION_KEY_CHARS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param, code)


@dataclass(slots=True)
class GenerationRequest:
    """What the router needs to serve one completion, whatever API it came through."""

    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    session_key: str = ""


@dataclass(frozen=True, slots=True)
class ModelLimits:
    name: str
    context: int
    vocab_size: int
    default_max_tokens: int = 512  # chat, when the client gives no limit (capped by the context left)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    return body


def parse_completion(body: Mapping[str, Any], tokenizer: Tokenizer, limits: ModelLimits) -> GenerationRequest:
    _check_model(body, limits)
    _refuse_unsupported(body, ("echo", "logprobs", "suffix"), best_of=True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "must not be empty")
        prompt_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt_ids = [int(t) for t in prompt]
        for i, token in enumerate(prompt_ids):
            if not 0 <= token < limits.vocab_size:
                raise invalid("prompt", f"token id {token} at [{i}] is outside the vocabulary 0..{limits.vocab_size - 1}")
    elif isinstance(prompt, list) and not prompt:
        raise invalid("prompt", "must not be empty")
    elif prompt is None:
        raise invalid("prompt", "is required", "missing_required_parameter")
    else:
        raise invalid("prompt", "must be a string or a list of token ids (one prompt per request)")
    max_tokens = _int_field(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    return _finish(body, "completion", prompt_ids, max_tokens, "max_tokens", tokenizer, limits)


def parse_chat(body: Mapping[str, Any], tokenizer: Tokenizer, limits: ModelLimits, roles: frozenset[str]) -> GenerationRequest:
    _check_model(body, limits)
    _refuse_unsupported(body, ("logprobs", "top_logprobs", "audio", "prediction"))
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "is required", "missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid("messages", "must be a list of message objects")
    if not messages:
        raise invalid("messages", "must not be empty")
    rendered = [_message(i, m, roles) for i, m in enumerate(messages)]
    prompt_ids = tokenizer.apply_chat_template(rendered)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        name = "max_completion_tokens"
    else:
        name = "max_tokens"
    max_tokens = _int_field(body, name, None)
    if max_tokens is None:
        max_tokens = max(1, min(limits.default_max_tokens, limits.context - len(prompt_ids)))
    return _finish(body, "chat", prompt_ids, max_tokens, name, tokenizer, limits)


# ---- shared fields ------------------------------------------------------------


def _finish(body: Mapping[str, Any], kind: str, prompt_ids: list[int], max_tokens: int, max_name: str,
            tokenizer: Tokenizer, limits: ModelLimits) -> GenerationRequest:
    if max_tokens < 1:
        raise invalid(max_name, f"must be at least 1, got {max_tokens}")
    if len(prompt_ids) + max_tokens > limits.context:
        raise invalid(max_name, f"the prompt's {len(prompt_ids)} tokens plus {max_tokens} exceed the model's "
                      f"context of {limits.context} tokens", "context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise invalid("top_p", "must be in (0, 1]")
    top_k = _int_field(body, "top_k", 0)
    if top_k is None or top_k < 0:
        raise invalid("top_k", "must be >= 0 (0: off)")
    n = _int_field(body, "n", 1)
    if n != 1:
        raise invalid("n", "only n = 1 is supported", "unsupported_value")
    seed = _int_field(body, "seed", None)
    stream = _bool(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options", "must be an object")
        if not stream:
            raise invalid("stream_options", "is only allowed with stream: true")
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    return GenerationRequest(
        kind=kind, model=limits.name, prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, top_k=top_k, seed=seed, stops=_stops(body), stop_token_ids=list(tokenizer.eos_token_ids),
        stream=stream, include_usage=include_usage, session_key=_session_key(body),
    )


def _check_model(body: Mapping[str, Any], limits: ModelLimits) -> None:
    model = body.get("model")
    if model is None:
        return  # lenient: the one model served
    if not isinstance(model, str) or model != limits.name:
        raise ApiError(400, f"model: {model!r} is not served here; this server serves {limits.name!r}",
                       "model", "model_not_found")


def _refuse_unsupported(body: Mapping[str, Any], names: Sequence[str], best_of: bool = False) -> None:
    for name in names:
        value = body.get(name)
        if value not in (None, False, 0, ""):
            raise invalid(name, "is not supported by this server", "unsupported_parameter")
    if best_of and body.get("best_of") not in (None, 1):
        raise invalid("best_of", "only best_of = 1 is supported", "unsupported_value")
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise invalid(name, "is not supported by this server (only 0)", "unsupported_value")


def _message(i: int, message: Any, roles: frozenset[str]) -> dict[str, str]:
    if not isinstance(message, dict):
        raise invalid(f"messages[{i}]", "must be an object with role and content")
    role = message.get("role")
    if role not in roles:
        raise invalid(f"messages[{i}].role", f"must be one of {sorted(roles)}, got {role!r}")
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...})"
                              " are supported")
            parts.append(part["text"])
        text = "".join(parts)
    else:
        raise invalid(f"messages[{i}].content", "must be a string, a list of text parts, or null")
    calls = message.get("tool_calls")
    if calls:
        # the history the agent sends is the prompt: keep its tool calls as text
        text += json.dumps(calls, separators=(",", ":"), sort_keys=True)
    if role == "assistant" or calls or text:
        return {"role": role, "content": text}
    raise invalid(f"messages[{i}].content", "must not be empty")


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    return stops


def _session_key(body: Mapping[str, Any]) -> str:
    for name in ("prompt_cache_key", "user"):
        value = body.get(name)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise invalid(name, "must be a string")
        if len(value) > MAX_SESSION_KEY_CHARS:
            raise invalid(name, f"longer than {MAX_SESSION_KEY_CHARS} characters")
        return value
    return ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid(name, f"must be an integer, got {value!r}")
    return int(value)


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(name, f"must be a number, got {value!r}")
    if not low <= value <= high:
        raise invalid(name, f"must be between {low} and {high}, got {value}")
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(param or name, f"must be true or false, got {value!r}")
    return value
