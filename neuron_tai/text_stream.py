"""Generated tokens to text as they arrive, at a cost that does not grow with the answer.

The node detokenizes for us (`detokenize` in PROTOCOL.md), and returns text, not bytes.
Two things make "detokenize only the new tokens" wrong on its own:
- a token can end inside a UTF-8 character (byte-fallback tokens carry one byte each):
  alone, its bytes come back as U+FFFD;
- a SentencePiece vocabulary drops the leading space of the first token it is given, so a
  lone "▁the" comes back as "the".
Detokenizing everything generated so far on every reply gets both right, but costs the
node a growing prefix each time: quadratic in the answer's length.

`TextStream` keeps a short window of recent tokens and the node's text for it. New tokens
are detokenized together with the window, and what follows the window's text is theirs:
the window gives the first new token its left context (its space, the start of a split
character), exactly as in a whole-sequence detokenize. This rests on detokenizing being a
concatenation of the tokens' bytes (true of llama.cpp's SentencePiece and byte-level BPE
vocabularies; a tokenizer that rewrites spaces across tokens, GPT-2's "clean up spaces",
could differ by those spaces).

Only the last character of a text can still change, and only if it is U+FFFD (the start
of a character whose rest has not come): that one is held back until the next tokens or
`flush`. Every earlier U+FFFD is final (bytes that can never form a character).

The window slides when it reaches `WINDOW` tokens: it keeps the last `CONTEXT` (more than
a character's bytes, so the held character and the next token's left context stay in it)
and asks the node for their text once. A stream of N tokens therefore costs the node at
most one detokenize per `push` plus N / (WINDOW - CONTEXT) for the slides, each of at most
WINDOW tokens plus the pushed ones.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

from neuron_tai.stop_text import StopText

WINDOW = 64
CONTEXT = 8
REPLACEMENT = "\ufffd"

Detokenize = Callable[[list[int]], Awaitable[str]]


@dataclass(slots=True)
class TextStream:
    """`push` the tokens of each reply, get the text they add; `flush` at the end."""

    detokenize: Detokenize
    window: list[int] = field(default_factory=list)
    text: str = ""  # the node's text for `window`
    shown: int = 0  # characters of `text` already returned

    async def push(self, tokens: Sequence[int]) -> str:
        if not tokens:
            return ""
        if len(self.window) >= WINDOW:
            await self._slide()
        self.window += tokens
        self.text = await self.detokenize(self.window)
        return self._release(len(self.text) - self.text.endswith(REPLACEMENT))

    def flush(self) -> str:
        """The end of the stream: a held U+FFFD is final now."""
        return self._release(len(self.text))

    async def _slide(self) -> None:
        held = len(self.text) - self.shown  # 0, or 1 for a held U+FFFD (its bytes are among the kept tokens)
        self.window = self.window[-CONTEXT:]
        self.text = await self.detokenize(self.window)
        self.shown = max(0, len(self.text) - held)

    def _release(self, upto: int) -> str:
        out = self.text[self.shown : upto]  # empty unless `upto` is past what was shown
        self.shown = max(self.shown, upto)
        return out


async def answer_piece(
    tokens: Sequence[int], text: TextStream, stop: StopText, hidden: Collection[int]
) -> tuple[str, int]:
    """The text one reply's `tokens` make safe to show (`hidden` tokens, end-of-generation,
    add none), and how many of them the answer keeps. With stop strings, a reply of several
    tokens goes one token at a time: none after the one that completes a stop string is shown
    or counted in `usage`. That costs a `detokenize` a token, not a reply; replies carry several
    tokens only when the gateway falls behind the node's stream."""
    pieces = [[t] for t in tokens] if stop.stops and len(tokens) > 1 else [list(tokens)]
    shown, kept = "", 0
    for piece in pieces:
        kept += len(piece)
        shown += stop.push(await text.push([t for t in piece if t not in hidden]))
        if stop.stopped:
            break
    return shown, kept
