"""OpenAI-compatible request bodies → one validated ``GenerationRequest``; errors in OpenAI's shape.

Every rejection is an ``ApiError`` (``kvpool.services.router.openai_errors``) with
the HTTP status, OpenAI's error type and ``param`` naming the field, so a
client's mistake is always a 4xx that says what to fix. The body arrives
parsed (``kvpool.services.router.json_body``). The generation fields themselves
(lengths, sampling, seeds, session keys) are checked by
``kvpool.core.api.generation_fields``, the same checks the gRPC ``Generate``
runs. Fields this server does not implement are refused by name when they
ask for something (``n`` > 1, ``logprobs``, ``response_format`` JSON, a
forced ``tool_choice``, ...) and taken as hints otherwise; ``tools`` are
rendered into the prompt through the chat template. docs/api.md lists every
field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvpool.core.errors import InvalidArgument
from kvpool.core.api.generation_fields import (
    OPENAI_FIELDS,
    check_length,
    check_prompt_text,
    check_sampling,
    check_session_key,
    check_token_ids,
)
from kvpool.core.sessions.table import check_expected_next_s
from kvpool.core.decode.stop_strings import StopMatcher
from kvpool.tokenizer import Tokenizer, tools_text
from kvpool.services.router.generation_request import GenerationRequest, ModelLimits
from kvpool.services.router.openai_errors import ApiError, api_error_of, invalid

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# a client's session, when the body names none: headers agent harnesses send
SESSION_HEADERS = ("x-session-id", "x-session-affinity")


def parse_completion(body: Mapping[str, Any], tokenizer: Tokenizer, limits: ModelLimits,
                     headers: Mapping[str, str] | None = None) -> GenerationRequest:
    _check_model(body, limits)
    _refuse_unsupported(body, ("echo", "logprobs", "suffix"), best_of=True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "must not be empty")
        _checked(check_prompt_text, len(prompt), tokenizer.max_token_bytes, limits.context, "prompt")
        prompt_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt_ids = [int(t) for t in prompt]
        _checked(check_token_ids, prompt_ids, limits.vocab_size, "prompt")
    elif isinstance(prompt, list) and not prompt:
        raise invalid("prompt", "must not be empty")
    elif prompt is None:
        raise invalid("prompt", "is required", "missing_required_parameter")
    else:
        raise invalid("prompt", "must be a string or a list of token ids (one prompt per request)")
    max_tokens = _int_field(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    assert max_tokens is not None
    return _finish(body, "completion", prompt_ids, "prompt", max_tokens, "max_tokens", tokenizer, limits, headers)


def parse_chat(body: Mapping[str, Any], tokenizer: Tokenizer, limits: ModelLimits, roles: frozenset[str],
               headers: Mapping[str, str] | None = None) -> GenerationRequest:
    _check_model(body, limits)
    _refuse_unsupported(body, ("logprobs", "top_logprobs", "audio", "prediction"))
    _check_tool_fields(body)
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "is required", "missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid("messages", "must be a list of message objects")
    if not messages:
        raise invalid("messages", "must not be empty")
    rendered = [_message(i, m, roles) for i, m in enumerate(messages)]
    tools = _tools(body)
    num_chars = sum(len(m["content"]) for m in rendered) + (len(tools_text(tools)) if tools else 0)
    _checked(check_prompt_text, num_chars, tokenizer.max_token_bytes, limits.context, "messages")
    try:
        prompt_ids = tokenizer.apply_chat_template(rendered, tools)
    except ValueError as exc:  # a model directory's template refusing the messages
        raise invalid("messages", str(exc).removeprefix("messages: ")) from None
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        name = "max_completion_tokens"
    else:
        name = "max_tokens"
    max_tokens = _int_field(body, name, None)
    if max_tokens is None:
        max_tokens = max(1, min(limits.default_max_tokens, limits.context - len(prompt_ids)))
    return _finish(body, "chat", prompt_ids, "messages", max_tokens, name, tokenizer, limits, headers)


# ---- shared fields ------------------------------------------------------------


def _finish(body: Mapping[str, Any], kind: str, prompt_ids: list[int], prompt_name: str, max_tokens: int,
            max_name: str, tokenizer: Tokenizer, limits: ModelLimits,
            headers: Mapping[str, str] | None) -> GenerationRequest:
    _checked(check_length, len(prompt_ids), max_tokens, limits.context, prompt_name, max_name)
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    top_k = _int_field(body, "top_k", 0)
    seed = _int_field(body, "seed", None)
    assert top_k is not None
    sampling = _checked(check_sampling, temperature, top_p, top_k, seed, limits.vocab_size, OPENAI_FIELDS)
    n = _int_field(body, "n", 1)
    if n != 1:
        raise invalid("n", "only n = 1 is supported", "unsupported_value")
    stream = _bool(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options", "must be an object")
        if not stream:
            raise invalid("stream_options", "is only allowed with stream: true")
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    session_key = _session_key(body, headers or {})
    session_end, expected_next_s = _session_hints(body, session_key)
    return GenerationRequest(
        kind=kind, model=limits.name, prompt_ids=prompt_ids, max_tokens=max_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
        stops=_stops(body), stop_token_ids=list(tokenizer.eos_token_ids), stream=stream,
        include_usage=include_usage, session_key=session_key, cache_salt=_cache_salt(body),
        session_end=session_end, expected_next_s=expected_next_s,
    )


def _checked(check: Any, *args: Any) -> Any:
    """A core check whose ``InvalidArgument`` becomes a 400 naming the field."""
    try:
        return check(*args)
    except InvalidArgument as exc:
        raise api_error_of(exc) from None


def _check_model(body: Mapping[str, Any], limits: ModelLimits) -> None:
    model = body.get("model")
    if model is None or model == "":
        return  # lenient, missing or empty alike: the one model served
    if not isinstance(model, str) or model != limits.name:
        raise ApiError(400, f"model: {_show(model)} is not served here; this server serves {limits.name!r}",
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


def _check_tool_fields(body: Mapping[str, Any]) -> None:
    """Tools are served as prompt text; what would need constrained output is refused by name."""
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise invalid("tool_choice", "only \"auto\" and \"none\" are supported: this server cannot force a tool "
                      "call", "unsupported_value")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", f"must be true or false, got {_show(parallel)}")
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise invalid("response_format", "must be an object such as {\"type\": \"text\"}")
        if response_format.get("type") != "text":
            raise invalid("response_format", f"type {response_format.get('type')!r} is not supported: only "
                          "\"text\" (this server does not constrain output to JSON)", "unsupported_value")


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid("tools", "must be a list of tool objects")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}]", "must be an object such as {\"type\": \"function\", \"function\": {...}}")
    return tools


def _message(i: int, message: Any, roles: frozenset[str]) -> dict[str, str]:
    if not isinstance(message, dict):
        raise invalid(f"messages[{i}]", "must be an object with role and content")
    role = message.get("role")
    if role not in roles:
        raise invalid(f"messages[{i}].role", f"must be one of {sorted(roles)}, got {_show(role)}")
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
    _checked(StopMatcher.of, stops)
    return stops


def _cache_salt(body: Mapping[str, Any]) -> str:
    """vLLM's field: only requests with the same salt share cached prefixes."""
    value = body.get("cache_salt")
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        raise invalid("cache_salt", "must be a non-empty string")
    return check_session_key(value, "cache_salt")


def _session_hints(body: Mapping[str, Any], session_key: str) -> tuple[bool, float | None]:
    """kvpool's extensions ``session_end`` and ``expected_next_s`` (docs/api.md): hints about the session
    the request belongs to, so each needs one, and they contradict each other."""
    session_end = _bool(body, "session_end", False)
    expected: float | None = None
    if body.get("expected_next_s") is not None:
        expected = _number(body, "expected_next_s", 0.0)
        _checked(check_expected_next_s, expected)
    for name, given in (("session_end", session_end), ("expected_next_s", expected is not None)):
        if given and not session_key:
            raise invalid(name, "needs a session: give prompt_cache_key (or user)")
    if session_end and expected is not None:
        raise invalid("expected_next_s", "not with session_end: true (no turn follows)")
    return session_end, expected


def _session_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    """The session: ``prompt_cache_key``, else ``user``, else a session header harnesses send."""
    for name in ("prompt_cache_key", "user"):
        value = body.get(name)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise invalid(name, "must be a string")
        return _checked(check_session_key, value, name)
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return _checked(check_session_key, value, name)
    return ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid(name, f"must be an integer, got {_show(value)}")
    return int(value)


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"must be a number, got {_show(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer past float's range
        raise invalid(name, "must be a number in range, got an integer too large for a float") from None


def _bool(body: Mapping[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(param or name, f"must be true or false, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
