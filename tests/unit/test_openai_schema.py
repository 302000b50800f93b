"""OpenAI request bodies: what is accepted, and every refusal names its field."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.tokenizer import ASSISTANT, BOS, END, EOS, SYSTEM, USER, ByteTokenizer
from services.router.openai_schema import ApiError, ModelLimits, parse_chat, parse_completion, parse_json

TOK = ByteTokenizer(1024)
LIMITS = ModelLimits("tiny", context=64, vocab_size=1024, default_max_tokens=20)
ROLES = ByteTokenizer.roles()


def completion(**body: Any) -> Any:
    return parse_completion({"model": "tiny", "prompt": "hi", **body}, TOK, LIMITS)


def chat(**body: Any) -> Any:
    return parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}, TOK, LIMITS, ROLES)


def test_completion_defaults_and_fields() -> None:
    req = completion()
    assert (req.prompt_ids, req.max_tokens, req.temperature, req.top_p, req.stream) == ([104, 105], 16, 1.0, 1.0, False)
    assert req.stop_token_ids == [EOS, END]
    req = completion(prompt=[1, 2, 3], max_tokens=5, temperature=0, top_p=0.5, seed=7, stop="\n", stream=True,
                     stream_options={"include_usage": True}, prompt_cache_key="s1", user="u")
    assert (req.prompt_ids, req.max_tokens, req.temperature, req.top_p, req.seed) == ([1, 2, 3], 5, 0.0, 0.5, 7)
    assert (req.stops, req.include_usage, req.session_key) == (["\n"], True, "s1")
    assert completion(user="u").session_key == "u"  # falls back to user
    assert completion(prompt=["hi"]).prompt_ids == [104, 105]  # a batch of one


def test_chat_template_and_limits() -> None:
    req = parse_chat({"messages": [{"role": "system", "content": "a"},
                                   {"role": "user", "content": [{"type": "text", "text": "b"}]}]}, TOK, LIMITS, ROLES)
    assert req.prompt_ids == [BOS, SYSTEM, 97, END, USER, 98, END, ASSISTANT]
    assert req.max_tokens == 20  # the server's default, within the context
    assert chat(max_completion_tokens=3, max_tokens=9).max_tokens == 3
    assert parse_chat({"messages": [{"role": "user", "content": "x" * 50}]}, TOK, LIMITS, ROLES).max_tokens == 10  # 64 - 54


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 1024]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 63}, "max_tokens"),  # 2 + 63 > 64
        ({"model": "gpt-5"}, "model"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"n": 2}, "n"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"prompt_cache_key": 5}, "prompt_cache_key"),
    ],
)
def test_completion_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        completion(**body)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.body()["error"]["param"] == param
    assert info.value.message.startswith(param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": None}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_chat_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        chat(**body)
    assert (info.value.status, info.value.param) == (400, param)


def test_bodies_that_are_not_json_objects() -> None:
    for raw in (b"{", b"[1, 2]", b"\xff"):
        with pytest.raises(ApiError) as info:
            parse_json(raw)
        assert (info.value.status, info.value.code) == (400, "invalid_json")
    assert parse_json(b'{"a": 1}') == {"a": 1}


def test_assistant_tool_calls_stay_in_the_prompt() -> None:
    req = parse_chat({"messages": [
        {"role": "user", "content": "run"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "content": "ok"},
    ], "tools": [{"type": "function"}]}, TOK, LIMITS, ROLES)
    text = bytes(t for t in req.prompt_ids if t < 256).decode()
    assert text == 'run[{"id":"1","type":"function"}]ok'
