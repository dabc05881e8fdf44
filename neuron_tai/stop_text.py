"""Stop strings on generated text, across token boundaries.

The model produces tokens; a stop string is text. It can begin in one token and end in
the next, so the matcher keeps the text and releases only what can no longer be the start
of a stop string: a streaming client never sees text that a later token turns into a stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopText:
    """Push the text of each reply; get back what may be shown and whether a stop string was hit."""

    stops: tuple[str, ...]
    text: str = ""  # the output so far, cut before the stop string once one is found
    shown: int = 0  # characters of `text` already released
    stopped: bool = field(default=False)

    def push(self, piece: str) -> str:
        """`piece` is the output's next text. Returns the newly releasable part."""
        if self.stopped or not piece:
            return ""
        self.text += piece
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            return self._release(cut)
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The end of the output: release whatever was held back."""
        return self._release(len(self.text))

    def _first_stop(self) -> int | None:
        found = [i for s in self.stops if s and (i := self.text.find(s, max(0, self.shown - len(s) + 1))) >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """The longest tail of the text that is a proper prefix of some stop string."""
        tail = self.text[self.shown :]
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(tail)), longest, -1):
                if tail.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _release(self, upto: int) -> str:
        out = self.text[self.shown : upto]  # empty unless `upto` is past what was shown
        self.shown = max(self.shown, upto)
        return out
