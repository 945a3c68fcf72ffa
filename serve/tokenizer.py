"""Text ↔ token ids, and chat messages → prompt text.

Two tokenizers, one interface:
- `ByteTokenizer` for the course format (model_config.json + model.pt), which ships no
  tokenizer: a token id below 256 is that byte; ids ≥ 256 (the rest of the vocabulary, which
  a byte-level model never learned to mean anything) decode to nothing.
- `HFTokenizer` for a model folder with `tokenizer.json` (the `tokenizers` library), its
  special tokens and chat template from `tokenizer_config.json`.

Chat templates are model-supplied Jinja: they are rendered in jinja2's immutable sandbox, so a
template can neither reach Python internals nor mutate what it is given.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

BYTE_VOCAB = 256
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# The course format has no chat template: a plain transcript, ended by the assistant's turn.
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (a bad request, answered with 400)."""


class TokenizerFileError(ValueError):
    """A tokenizer file that cannot be read (bad JSON, a chat template that does not compile): the
    server's one-line start-up error names the file (a broken tokenizer.json had said only
    "expected ident at line 1 column 2", and a broken tokenizer_config.json "Expecting value")."""


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Whatever goes wrong inside, as a TokenizerFileError naming `path`."""
    try:
        yield
    except Exception as e:   # noqa: BLE001 - the tokenizers library raises plain Exception
        raise TokenizerFileError(f"{path} cannot be read: {e}") from e


class Tokenizer(Protocol):
    """What the server needs from a tokenizer."""

    eos_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids of `text`; add_special_tokens: the tokenizer's own (bos) around a raw prompt, off
        for a rendered chat template, which writes its special tokens as text."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence at the end decodes to U+FFFD (the
        incremental detokenizer holds such an end back until the next token completes it)."""
        ...

    def render_chat(self, messages: list[dict], options: dict[str, Any]) -> str: ...


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@dataclass
class ChatTemplate:
    """A chat template compiled once in the sandbox; `special` (bos_token, eos_token, ...) are
    the variables templates expect beside the messages."""

    source: str
    special: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(self.source)

    def render(self, messages: list[dict], options: dict[str, Any]) -> str:
        """`options` are the request's chat_template_kwargs (enable_thinking=False, ...)."""
        try:
            return self._template.render(**{**self.special, **options, "messages": messages,
                                            "add_generation_prompt": True})
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from e


class ByteTokenizer:
    """UTF-8 bytes are the token ids. No end-of-sequence token: generation ends at max_tokens,
    a stop string, or the context limit."""

    eos_ids: frozenset[int] = frozenset()

    def __init__(self) -> None:
        self.template = ChatTemplate(PLAIN_CHAT_TEMPLATE)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict], options: dict[str, Any]) -> str:
        return self.template.render(messages, options)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face tokenizer folder: tokenizer.json, and tokenizer_config.json (chat
    template, bos/eos) and generation_config.json (eos ids) when present."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as _Tokenizer

        with _reading(folder / TOKENIZER_FILE):
            self._tok = _Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        with _reading(folder / TOKENIZER_CONFIG_FILE):
            config = _read_json(folder / TOKENIZER_CONFIG_FILE)
            special = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                       if (t := _token_text(config.get(k))) is not None}
            eos = {self._tok.token_to_id(special["eos_token"])} if "eos_token" in special else set()
            source = config.get("chat_template")
            if isinstance(source, list):   # several named templates: the default one
                source = next((t.get("template") for t in source if t.get("name") == "default"), None)
            self.template = ChatTemplate(source if isinstance(source, str) else PLAIN_CHAT_TEMPLATE, special)
        with _reading(folder / GENERATION_CONFIG_FILE):
            generation_eos = _read_json(folder / GENERATION_CONFIG_FILE).get("eos_token_id")
        eos.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        self.eos_ids = frozenset(i for i in eos if isinstance(i, int))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch lets go of the GIL (encode holds it): the server tokenizes off its event loop,
        # and an 8 MB prompt had stalled every stream for seconds.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], options: dict[str, Any]) -> str:
        return self.template.render(messages, options)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def load_tokenizer(folders: list[Path]) -> Tokenizer:
    """The first folder holding tokenizer.json gives an HFTokenizer; none: the byte tokenizer."""
    for folder in folders:
        if (folder / TOKENIZER_FILE).is_file():
            return HFTokenizer(folder)
    return ByteTokenizer()
