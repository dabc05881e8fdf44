"""Window pins: what a sliding-window cache must keep so the last step can be undone.

llama.cpp lets a sliding-window cache hand a cell to any later token once the cell's
position has left its sequence's window (`is_masked_swa` in llama-kv-cache.cpp), but only
while the cell belongs to that one sequence. A step of n rows at `pos` moves the window
n positions on; undoing it (a rewind to any r >= pos) needs positions r+1-n_swa.. again,
so the n positions pos+1-n_swa..pos+n-n_swa must stay. Sharing them with a pin sequence
of their own (one per sequence) keeps llama.cpp from giving them away until the
sequence's next step, when the step they protect can no longer be undone.

`pin_range` is pure arithmetic; `WindowPins` applies it to a context and owns the pin
sequences' ids (base + seq).
"""

from __future__ import annotations

from typing import Protocol

LLAMA_MAX_SEQ = 256  # llama-cparams.h: sequence ids a context can have


class PinnableMemory(Protocol):
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...
    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool: ...


def pin_range(pos: int, n: int, window: int) -> tuple[int, int] | None:
    """Positions [lo, hi) that a step of `n` rows at `pos` pushes out of a `window`-wide window
    and that undoing it would need again; None when there are none."""
    if window <= 1 or n < 1:  # a window of one position: each token sees only itself
        return None
    lo, hi = max(0, pos + 1 - window), pos + n + 1 - window
    return (lo, hi) if hi > lo else None


def context_sequences(n_seq_max: int, window: int) -> int:
    """Sequence ids a context needs for `n_seq_max` sequences: twice as many on a sliding-window
    model (a pin sequence each), when llama.cpp allows that many."""
    return 2 * n_seq_max if window > 0 and 2 * n_seq_max <= LLAMA_MAX_SEQ else n_seq_max


class WindowPins:
    """Pins of one context's sequences 0..base-1, each under sequence base + seq."""

    def __init__(self, memory: PinnableMemory, base: int, window: int) -> None:
        self.memory = memory
        self.base = base
        self.window = window
        self.pinned: set[int] = set()

    def before(self, seq: int, pos: int, n: int, *, continues: bool = False) -> None:
        """A step of `n` rows at `pos` is about to run: the previous step's pin goes, this step's
        cells that exist already are pinned (a later micro-batch of the same call could take them).
        A later part of a step split over calls (`continues`) adds to the pin of its earlier parts."""
        if not continues:
            self.release(seq)
        span = pin_range(pos, n, self.window)
        if span is not None:
            self.memory.seq_cp(seq, self.base + seq, span[0], min(span[1], pos))
            self.pinned.add(seq)

    def after(self, seq: int, pos: int, n: int) -> None:
        """The step ran: pin what it wrote that its own window already left (n > window)."""
        span = pin_range(pos, n, self.window)
        if span is not None and span[1] > pos:
            self.memory.seq_cp(seq, self.base + seq, max(span[0], pos), span[1])
            self.pinned.add(seq)

    def release(self, seq: int) -> None:
        if seq in self.pinned:
            self.pinned.discard(seq)
            self.memory.seq_rm(self.base + seq, 0, -1)

    def forget(self) -> None:
        """The cache was cleared (a compaction): no pin is left to release."""
        self.pinned.clear()
