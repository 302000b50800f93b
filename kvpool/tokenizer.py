"""Text ↔ token ids for the router: a byte-level tokenizer for the built-in models, ``tokenizers`` for a model directory.

Both give the same small interface: ``encode``, an incremental ``decoder``
(tokens arrive one at a time while streaming, and a UTF-8 character may span
several byte tokens), ``eos_token_ids`` and ``apply_chat_template``.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvpool.model.hf_checkpoint import chat_template

NUM_BYTES = 256


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # no token stands for more bytes of text than this: a text longer than context × this is refused untokenized
    max_token_bytes: int

    def encode(self, text: str) -> list[int]: ...

    def decoder(self) -> TokenDecoder: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            tools: Sequence[Mapping[str, Any]] = ()) -> list[int]: ...


class TokenDecoder(Protocol):
    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


# byte-level specials, right after the 256 byte ids
BOS, EOS, SYSTEM, USER, ASSISTANT, TOOL, END = range(NUM_BYTES, NUM_BYTES + 7)
_SPECIALS = {BOS: "<|bos|>", EOS: "<|eos|>", SYSTEM: "<|system|>", USER: "<|user|>", ASSISTANT: "<|assistant|>",
             TOOL: "<|tool|>", END: "<|end|>"}
_ROLES = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}


@dataclass(slots=True)
class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, seven specials follow; any other id of the model's vocabulary decodes to nothing.

    Chat template: ``<|bos|>``, then the tools (if any) as a system turn
    (``tools_text``), then per message its role token, the content's bytes and
    ``<|end|>``, then ``<|assistant|>`` for the reply.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...] = (EOS, END)
    max_token_bytes: int = 1  # a byte a token: the specials come from the template, never from text

    def __post_init__(self) -> None:
        if self.vocab_size < NUM_BYTES + len(_SPECIALS):
            raise ValueError(f"vocab_size: a byte-level tokenizer needs at least {NUM_BYTES + len(_SPECIALS)} ids")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self) -> _ByteDecoder:
        return _ByteDecoder()

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        ids = [BOS]
        if tools:
            ids.append(SYSTEM)
            ids.extend(self.encode(tools_text(tools)))
            ids.append(END)
        for message in messages:
            ids.append(_ROLES[message["role"]])
            ids.extend(self.encode(message["content"]))
            ids.append(END)
        ids.append(ASSISTANT)
        return ids

    @staticmethod
    def roles() -> frozenset[str]:
        return frozenset(_ROLES)


class _ByteDecoder:
    """Bytes through an incremental UTF-8 decoder: a split character is emitted once complete."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if 0 <= token_id < NUM_BYTES:
            return self._utf8.decode(bytes((token_id,)))
        return ""  # specials and ids past them carry no text

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class HFTokenizer:
    """A model directory's ``tokenizer.json`` through the ``tokenizers`` library, with its own chat template."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer  # only model directories need it

        self._tokenizer = _Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.vocab_size = self._tokenizer.get_vocab_size()
        # a vocabulary entry's UTF-8 length bounds the text its token stands for (byte-level and metaspace
        # alphabets spell a byte with a longer character, never a shorter one)
        self.max_token_bytes = max((len(t.encode("utf-8")) for t in self._tokenizer.get_vocab(with_added_tokens=True)),
                                   default=1)
        config = _read_json(model_dir / "tokenizer_config.json")
        self._template = chat_template(model_dir)
        eos_text = _token_text(config.get("eos_token"))
        eos_id = self._tokenizer.token_to_id(eos_text) if eos_text else None
        # generation stops at the tokenizer's EOS and at generation_config.json's (what transformers' generate
        # stops at), as the large servers do
        generation_eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        ids = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        self.eos_token_ids = tuple(dict.fromkeys(
            i for i in (eos_id, *ids) if isinstance(i, int) and not isinstance(i, bool)))
        self._bos_text = _token_text(config.get("bos_token"))

    def encode(self, text: str) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode does not: a 10 MB prompt held it 12 s here),
        # so the router's event loop runs on while a worker thread tokenizes
        return list(self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def decoder(self) -> _HFDecoder:
        return _HFDecoder(self._tokenizer)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        if not self._template:
            raise ValueError("model directory has no chat_template in tokenizer_config.json")
        from jinja2 import StrictUndefined, TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # a directory's template is code: sandboxed, as HF


        messages = list(messages)
        if tools and "tools" not in self._template:
            # a template that cannot show tools: they go first, as a system message
            messages = [{"role": "system", "content": tools_text(tools)}, *messages]
        env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            text = env.from_string(self._template).render(
                messages=messages, tools=list(tools) or None, add_generation_prompt=True, bos_token=self._bos_text
            )
        except TemplateError as exc:  # the template refuses these messages (or cannot render them): the caller's
            raise ValueError(f"messages: the model's chat template refused them: {exc}") from None
        return self.encode(text)


class _HFDecoder:
    """Emits each new token's text as soon as it is whole, decoding only a short window of ids.

    Decoding every id seen so far at each token cost O(n) a token, O(n²) a stream (4,000 tokens:
    0.94 s of the router's event loop here). The window holds the ids of the text emitted last
    (``_prefix`` to ``_read``), which give a token its context (a leading space, a byte-fallback
    character's first bytes), and the ids not emitted yet; the new text is what decoding the whole
    window adds to decoding its first part, once it does not end in an incomplete character.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here
        self._read = 0  # the text of the ids before this is emitted

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        emitted = self._tokenizer.decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        text = self._tokenizer.decode(self._ids[self._prefix:], skip_special_tokens=True)
        if len(text) <= len(emitted) or (text.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or an incomplete character: wait for its other bytes
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted):]


def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """Tool schemas as the prompt shows them: one JSON object a line, keys sorted, so the text (and its cache) is stable."""
    lines = [json.dumps(tool, separators=(",", ":"), sort_keys=True) for tool in tools]
    return "# Tools\nYou may call these functions:\n" + "\n".join(lines)


def load_tokenizer(model_dir: str | None, vocab_size: int) -> Tokenizer:
    """The model directory's tokenizer when it has a ``tokenizer.json``, else the byte-level one."""
    if model_dir:
        path = Path(model_dir)
        if (path / "tokenizer.json").is_file():
            tokenizer = HFTokenizer(path)
            if tokenizer.vocab_size > vocab_size:
                raise ValueError(
                    f"model_dir: tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary {vocab_size}"
                )
            return tokenizer
    return ByteTokenizer(vocab_size)


def _raise_template_error(message: str) -> None:
    """``raise_exception`` of Hugging Face chat templates."""
    from jinja2 import TemplateError

    raise TemplateError(message)


def _token_text(token: Any) -> str:
    """A special token as tokenizer_config.json gives it: its text, or an object with its ``content``."""
    text = token.get("content") if isinstance(token, dict) else token
    return text if isinstance(text, str) else ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
