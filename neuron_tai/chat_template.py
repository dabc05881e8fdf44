"""Chat prompts rendered with the model's own template, as llama.cpp renders them.

The template is `tokenizer.chat_template` from the GGUF file, a Jinja2 program run in a
sandbox with the globals llama.cpp's and llama-cpp-python's formatters give it
(`raise_exception`, `strftime_now`, `bos_token`, `eos_token`, `add_generation_prompt`).
Rendered text holds special tokens as text (`<start_of_turn>`); `SpecialTokens` maps
them back to their ids, so the prompt is tokenized as llama.cpp does with special-token
parsing on. The header is read with the lean GGUF reader: no vocabulary is decoded
beyond the few control tokens.

Without a model file the gateway uses `FALLBACK_TEMPLATE`: one `role: content` line per
message and a closing `assistant:`. A model has no end-of-turn token for that plain form,
so it would go on writing the next `user:` turn itself: `turn_stops` gives the gateway
the next turn's marker (a new line and a role) as stop strings.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.gguf_header import Entry, read_header

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PLAIN_ROLES = (
    "system",
    "user",
    "assistant",
    "tool",
)  # a turn of any of these, or of the chat's own roles, ends the answer
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types whose text is parsed as the token


class ChatTemplateError(ValueError):
    """The template refused the messages (its own `raise_exception`) or failed to render."""


_Trie = dict[str, "_Trie"]


def _trie_pattern(names: Iterable[str]) -> str:
    """A regular expression matching any of `names`, the longest at each place, as a trie of
    nested groups: a place is tested against the next characters the names share, never
    against each name in turn (a model may have thousands of control tokens beginning `<`)."""
    trie: _Trie = {}
    for name in names:
        node = trie
        for char in name:
            node = node.setdefault(char, {})
        node[""] = {}  # a name ends here

    def group(node: _Trie) -> str:
        branches = [re.escape(char) + group(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        alternatives = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{alternatives})?" if "" in node else alternatives  # greedy: longer names first

    return group(trie)


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Text of the model's control tokens and their ids; `add_bos` as the model's tokenizer does."""

    ids: dict[str, int]
    bos: str
    eos: str
    bos_id: int | None
    add_bos: bool
    _pattern: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [n for n in self.ids if n]
        object.__setattr__(self, "_pattern", re.compile(_trie_pattern(names)) if names else None)

    def split(self, text: str) -> list[str | int]:
        """`text` as plain pieces and special-token ids, the longest token text matched first."""
        if self._pattern is None:
            return [text] if text else []
        out: list[str | int] = []
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                out.append(text[start : match.start()])
            out.append(self.ids[match.group()])
            start = match.end()
        if start < len(text):
            out.append(text[start:])
        return out


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Template:
    """A template compiled once, not per request: compiling is most of a short render's time."""
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)


NO_SPECIALS = SpecialTokens({}, "", "", None, add_bos=True)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    specials: SpecialTokens

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        try:
            return _compiled(self.source).render(
                messages=list(messages),
                bos_token=self.specials.bos,
                eos_token=self.specials.eos,
                add_generation_prompt=True,
                raise_exception=raise_exception,
                strftime_now=strftime_now,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None
        except Exception as exc:  # the messages' own values broke it (a `tool_calls` of 5 iterated)
            raise ChatTemplateError(f"chat template: {type(exc).__name__}: {exc}") from None

    def turn_stops(self, messages: Sequence[dict[str, Any]]) -> tuple[str, ...]:
        """Text that starts another turn, for the plain fallback only (a model's own template ends
        its turns with an end-of-generation token)."""
        if self.source != FALLBACK_TEMPLATE:
            return ()
        roles = dict.fromkeys([*PLAIN_ROLES, *(str(m["role"]) for m in messages)])
        return tuple(f"\n{role}:" for role in roles)


def _strings_at(entry: Entry, wanted: set[int]) -> dict[int, str]:
    """Items of a GGUF string array by index, read from the entry's raw bytes (key, type, count, items)."""
    raw = entry.raw
    (key_len,) = struct.unpack_from("<Q", raw, 0)
    pos = 8 + key_len + 4 + 4 + 8  # key, value type, element type, count
    out: dict[int, str] = {}
    last = max(wanted, default=-1)
    for i in range(min(entry.count, last + 1)):
        (n,) = struct.unpack_from("<Q", raw, pos)
        if i in wanted:
            out[i] = raw[pos + 8 : pos + 8 + n].decode("utf-8", "replace")
        pos += 8 + n
    return out


def load_chat_template(model: Path | None) -> ChatTemplate:
    """The model's template and special tokens; the fallback template when there is no model or it has none."""
    if model is None:
        return ChatTemplate(FALLBACK_TEMPLATE, NO_SPECIALS)
    header = read_header(model)
    source = header.get("tokenizer.chat_template")
    types = header.get("tokenizer.ggml.token_type")
    tokens = header.entries.get("tokenizer.ggml.tokens")
    bos_id = header.get("tokenizer.ggml.bos_token_id")
    eos_id = header.get("tokenizer.ggml.eos_token_id")
    special_ids = {i for i, t in enumerate(types if types is not None else []) if int(t) in (CONTROL, USER_DEFINED)}
    wanted = special_ids | {int(x) for x in (bos_id, eos_id) if x is not None}
    texts = _strings_at(tokens, wanted) if tokens is not None else {}
    specials = SpecialTokens(
        ids={texts[i]: i for i in sorted(special_ids) if i in texts},
        bos=texts.get(int(bos_id), "") if bos_id is not None else "",
        eos=texts.get(int(eos_id), "") if eos_id is not None else "",
        bos_id=int(bos_id) if bos_id is not None else None,
        add_bos=bool(header.get("tokenizer.ggml.add_bos_token", True)),
    )
    return ChatTemplate(str(source) if source else FALLBACK_TEMPLATE, specials)
