"""Draft tokens for speculative generation: prompt lookup, and how many to draft per session.

Pure (no Trio, no llama.cpp). A draft is a guess at the session's next tokens that the
model then verifies in one multi-row step; a wrong guess costs its rows and nothing else,
because only tokens the model itself produces are kept.

Prompt lookup: the last n tokens of the session's history (n from `max_ngram` down to
`min_ngram`) are looked for earlier in that history, most recent occurrence first, and
what followed them there is proposed. No second model: it pays on work that repeats its
own context (editing or continuing a given file, answering from a given document).

`DraftPolicy` adapts per session: full acceptance lengthens drafts, partial acceptance
trims them to what was accepted plus one, and passes that accept nothing shrink them and
finally pause drafting, for a pause that doubles while drafts keep failing and resets once
one is accepted. So a session that never repeats itself drafts rarely and short.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MAX_SPECULATE = 32  # most draft tokens per pass; a request asking for more gets this many


def window_room(room: int, pos: int, window: int) -> int:
    """Drafts a pass at `pos` may carry on a model whose sliding window is `window` (0: none).

    A pass at `pos` with d drafts takes positions pos..pos+d. llama.cpp may then hand the
    cell of any position p <= pos+d+1-window to another sequence, yet undoing rejected
    drafts (down to pos+1) needs every position from pos+2-window on. Only passes that
    reach no position the window has left behind can be undone: d <= window-2-pos.
    """
    if window <= 0:
        return room
    return max(0, min(room, window - 2 - pos))


def accepted(drafts: Sequence[int], rows: Sequence[int]) -> list[int]:
    """The tokens a verified pass yields: the drafts the model agrees with, then its own next.

    `rows[i]` is the token the model drew after the pass's first token and `drafts[:i]`
    (`out: "tokens"`). Draft i is kept while `rows[i] == drafts[i]`: drafts are
    deterministic, so this keeps draft i with exactly the model's probability of it, and
    at the first disagreement `rows[i]` is a draw from the model's distribution given
    that the draft was not drawn (the draft removed, the rest renormalised). The result
    is distributed as drafting-free sampling, and token-identical to it where the rows'
    distributions are bit-identical to one-row steps' (batch-invariant mode).
    """
    if len(rows) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} rows, got {len(rows)}")
    kept = 0
    while kept < len(drafts) and rows[kept] == drafts[kept]:
        kept += 1
    return [int(t) for t in rows[: kept + 1]]


@dataclass(frozen=True, slots=True)
class PromptLookup:
    """Propose what followed the most recent earlier occurrence of the history's last n-gram."""

    max_ngram: int = 3
    min_ngram: int = 1
    window: int = 8192  # the history's last tokens looked at: a pass's cost is bounded, not O(session)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({self.min_ngram}) <= max_ngram ({self.max_ngram})")
        if self.window < 2:
            raise ValueError(f"need window ({self.window}) >= 2")

    def propose(self, history: Sequence[int] | npt.NDArray[np.int32], k: int) -> list[int]:
        """Up to `k` tokens guessed to follow `history`; [] when its tail occurs nowhere before.

        The longest n-gram that matches wins; among its matches the latest, within the last
        `window` tokens. A continuation that runs into the tail goes on copying what it
        proposed (a repeat with a period shorter than `k` is proposed in full).
        """
        if k <= 0 or len(history) < 2:
            return []  # before the copy: a paused session's pass costs nothing here
        tokens = np.asarray(history[-self.window :], dtype=np.int64)
        size = len(tokens)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            start = _last_earlier_match(tokens, n)
            if start is not None:
                return _copy_on(tokens, start + n, k)
        return []


def _last_earlier_match(tokens: npt.NDArray[np.int64], n: int) -> int | None:
    """Start of the latest occurrence of the last `n` tokens that ends before the last token."""
    size = len(tokens)
    starts = size - n  # candidates i = 0 .. size-n-1: the window tokens[i:i+n] ends before the tail's end
    hit = np.ones(starts, dtype=bool)
    for j in range(n):
        hit &= tokens[j : j + starts] == tokens[size - n + j]
    found = np.flatnonzero(hit)
    return int(found[-1]) if found.size else None


def _copy_on(tokens: npt.NDArray[np.int64], source: int, k: int) -> list[int]:
    """`k` tokens copied from `source` on, reading back what is proposed once past the end."""
    out: list[int] = []
    size = len(tokens)
    for j in range(k):
        at = source + j
        out.append(int(tokens[at]) if at < size else out[at - size])
    return out


@dataclass(slots=True)
class DraftPolicy:
    """How many tokens one session drafts next, from how its drafts fared."""

    max_draft: int
    patience: int = 2  # passes in a row that accept nothing before drafting pauses
    first_pause: int = 4  # passes without drafts after the first such run
    max_pause: int = 64
    length: int = 0  # tokens the next draft may have (0 before the first observation: max_draft)
    misses: int = 0
    pause: int = 0  # passes left without drafting
    next_pause: int = 0

    def __post_init__(self) -> None:
        if self.max_draft < 0 or self.patience < 1 or not 1 <= self.first_pause <= self.max_pause:
            raise ValueError("need max_draft >= 0, patience >= 1 and 1 <= first_pause <= max_pause")
        self.length = self.max_draft
        self.next_pause = self.first_pause

    def budget(self) -> int:
        """Most tokens to draft for the next pass (0: a plain one-token pass)."""
        return 0 if self.pause > 0 else self.length

    def passed(self, drafted: int, accepted: int) -> None:
        """A pass ran with `drafted` draft tokens, of which the model agreed with `accepted`."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted")
        if drafted == 0:
            self.pause = max(0, self.pause - 1)
            return
        if accepted == drafted:
            self.length = min(self.max_draft, self.length + max(1, self.length // 2))
        else:
            self.length = max(1, accepted + 1 if accepted else self.length // 2)
        if accepted:
            self.misses, self.next_pause = 0, self.first_pause
            return
        self.misses += 1
        if self.misses >= self.patience:
            self.misses, self.pause = 0, self.next_pause
            self.next_pause = min(self.max_pause, 2 * self.next_pause)


@dataclass(slots=True)
class Drafter:
    """One generate's drafting: the session's tokens so far, the lookup, and its policy."""

    history: list[int]
    policy: DraftPolicy
    lookup: PromptLookup = PromptLookup()

    @classmethod
    def of(cls, prompt: Sequence[int] | npt.NDArray[np.int32], max_draft: int) -> Drafter:
        return cls([int(t) for t in prompt], DraftPolicy(max_draft))

    def draft(self, limit: int) -> list[int]:
        """Draft tokens for the next pass, at most `limit` (what the run still has room for)."""
        return self.lookup.propose(self.history, min(limit, self.policy.budget()))

    def passed(self, drafts: Sequence[int], kept: Sequence[int]) -> None:
        """A pass verified `drafts` and yielded `kept` (the accepted drafts, then the model's own)."""
        self.policy.passed(len(drafts), len(kept) - 1 if drafts else 0)
        self.history.extend(kept)
