"""OpenAI request bodies: what is accepted, and every refusal names its field."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.tokenizer import ASSISTANT, BOS, END, EOS, SYSTEM, USER, ByteTokenizer
from kvpool.services.router.generation_request import ModelLimits
from kvpool.services.router.json_body import parse_json
from kvpool.services.router.openai_errors import ApiError
from kvpool.services.router.openai_schema import parse_chat, parse_completion

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
        ({"top_k": -2}, "top_k"),
        ({"n": 2}, "n"),
        ({"stop": ["a", ""]}, "stop[1]"),
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
    ]}, TOK, LIMITS, ROLES)
    text = bytes(t for t in req.prompt_ids if t < 256).decode()
    assert text == 'run[{"id":"1","type":"function"}]ok'


# ---- issue 18: every field range-checked, harness fields, sessions ------------------------------------------

WIDE = ModelLimits("tiny", context=4096, vocab_size=1024, default_max_tokens=20)


def wide_chat(headers: dict[str, str] | None = None, **body: Any) -> Any:
    return parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}, TOK, WIDE, ROLES,
                      headers)


def test_tools_are_rendered_into_the_prompt_as_a_system_turn() -> None:
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
    plain = wide_chat()
    with_tools = wide_chat(tools=[tool], tool_choice="auto", parallel_tool_calls=True)
    assert with_tools.prompt_ids[:2] == [BOS, SYSTEM]
    text = bytes(t for t in with_tools.prompt_ids if t < 256).decode()
    assert text == ('# Tools\nYou may call these functions:\n{"function":{"name":"read_file","parameters":'
                    '{"type":"object"}},"type":"function"}hi')
    assert with_tools.prompt_ids[-len(plain.prompt_ids) + 1:] == plain.prompt_ids[1:]  # the conversation follows
    assert wide_chat(tools=[tool], tool_choice="none").prompt_ids == with_tools.prompt_ids
    assert wide_chat(tools=[]).prompt_ids == plain.prompt_ids


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"n": 3}, "n"),
        ({"tools": "read_file"}, "tools"),
        ({"tools": ["read_file"]}, "tools[0]"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"temperature": 10**400}, "temperature"),
        ({"stop": ["x" * 257]}, "stop[0]"),
        ({"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
    ],
)
def test_harness_fields_and_ranges_are_served_or_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        wide_chat(**body)
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(param)


def test_served_values_at_the_edges() -> None:
    assert wide_chat(seed=-1).seed == 2**64 - 1  # a signed seed keeps its 64-bit pattern
    assert wide_chat(seed=2**64 - 1).seed == 2**64 - 1
    assert wide_chat(top_k=2**40).top_k == 0  # past the vocabulary: off
    assert wide_chat(top_k=-1).top_k == 0
    assert wide_chat(top_k=5).top_k == 5
    assert wide_chat(temperature=1e-30).temperature == 0.0  # float32 cannot carry it: greedy
    assert wide_chat(top_p=1e-300).top_p == 1e-6
    assert wide_chat(response_format={"type": "text"}, logprobs=False, n=1).max_tokens == 20
    assert wide_chat(model="").model == wide_chat().model == "tiny"  # missing and empty alike


def test_over_the_context_names_the_field_and_the_numbers() -> None:
    with pytest.raises(ApiError) as info:
        wide_chat(max_tokens=4091)
    assert info.value.param == "max_tokens"
    assert "4096" in info.value.message and "at most 4090" in info.value.message
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": "y" * 4096}, TOK, WIDE)
    assert info.value.param == "prompt" and "4096 characters" in info.value.message  # refused untokenized
    assert "at most 4095 prompt tokens" in info.value.message


def test_session_key_from_body_then_headers() -> None:
    headers = {"x-session-id": "hdr", "x-session-affinity": "aff"}
    assert wide_chat(headers, prompt_cache_key="pck", user="u").session_key == "pck"
    assert wide_chat(headers, user="u").session_key == "u"
    assert wide_chat(headers).session_key == "hdr"
    assert wide_chat({"x-session-affinity": "aff"}).session_key == "aff"
    assert wide_chat().session_key == ""


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "a\\ud800b"}', "prompt"),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
        (b'{"prompt_cache_key": "\\ud800"}', "prompt_cache_key"),
        (b'{"metadata": {"\\ud800": 1}}', "metadata"),
    ],
)
def test_lone_surrogates_are_400s_naming_where(raw: bytes, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_json(raw)
    assert (info.value.status, info.value.param) == (400, param)


def test_deep_or_huge_json_is_a_400() -> None:
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}",
                b'{"seed": ' + b"9" * 5000 + b"}"):
        with pytest.raises(ApiError) as info:
            parse_json(raw)
        assert info.value.status == 400
    nested = parse_json(b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}")["a"]  # 64 levels with the body: served
    for _ in range(62):
        nested = nested[0]
    assert nested == []


def test_session_keys_are_counted_in_utf8_bytes_as_prefill_counts_them() -> None:
    assert wide_chat(prompt_cache_key="é" * 128).session_key == "é" * 128  # 256 bytes
    with pytest.raises(ApiError) as info:
        wide_chat(prompt_cache_key="é" * 129)
    assert info.value.param == "prompt_cache_key" and "258" in info.value.message


def test_session_hints_are_served() -> None:
    req = completion(prompt_cache_key="s1", expected_next_s=12.5)
    assert (req.session_end, req.expected_next_s) == (False, 12.5)
    req = chat(prompt_cache_key="s1", session_end=True)
    assert (req.session_end, req.expected_next_s) == (True, None)
    assert completion(prompt_cache_key="s1", expected_next_s=0).expected_next_s == 0.0
    assert (completion().session_end, completion().expected_next_s) == (False, None)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_cache_key": "s", "session_end": "yes"}, "session_end"),
        ({"prompt_cache_key": "s", "session_end": 1}, "session_end"),
        ({"prompt_cache_key": "s", "expected_next_s": -1}, "expected_next_s"),
        ({"prompt_cache_key": "s", "expected_next_s": 86_401}, "expected_next_s"),
        ({"prompt_cache_key": "s", "expected_next_s": "5"}, "expected_next_s"),
        ({"prompt_cache_key": "s", "expected_next_s": True}, "expected_next_s"),
        ({"session_end": True}, "session_end"),  # a hint needs a session
        ({"expected_next_s": 3}, "expected_next_s"),
        ({"prompt_cache_key": "s", "session_end": True, "expected_next_s": 3}, "expected_next_s"),
    ],
)
def test_session_hints_refused_by_name(body: dict[str, Any], param: str) -> None:
    for parse in (completion, chat):
        with pytest.raises(ApiError) as exc:
            parse(**body)
        assert exc.value.status == 400 and exc.value.param == param


class CountingTokenizer(ByteTokenizer):
    """The byte-level tokenizer, counting the characters it was asked to tokenize."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.chars = 0

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return super().encode(text)


def test_text_past_what_the_context_could_hold_is_refused_before_it_is_tokenized() -> None:
    """The byte-level tokenizer: a token a byte, so 63 characters at most for a 64-token context."""
    tok = CountingTokenizer(1024)
    assert len(parse_completion({"prompt": "a" * 63, "max_tokens": 1}, tok, LIMITS).prompt_ids) == 63
    tok.chars = 0
    for body, param in (({"prompt": "a" * 64}, "prompt"),
                        ({"prompt": "a" * 10_000_000}, "prompt"),
                        ({"messages": [{"role": "user", "content": "a" * 40}, {"role": "user", "content": "b" * 24}]},
                         "messages"),
                        ({"messages": [{"role": "user", "content": "a"}],
                          "tools": [{"type": "function", "function": {"name": "f" * 64}}]}, "messages")):
        with pytest.raises(ApiError) as info:
            (parse_chat(body, tok, LIMITS, ROLES) if "messages" in body else parse_completion(body, tok, LIMITS))
        assert info.value.status == 400 and info.value.param == param
        assert "characters;" in info.value.message and "at most 63 prompt tokens" in info.value.message
    assert tok.chars == 0  # none of them was tokenized
