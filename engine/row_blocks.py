"""Filler rows that make a llama_decode call cheaper on a kernel that takes rows in blocks.

Pure (no Trio, no ctypes). ggml-cpu's repacked matrix product (x86 and ARM) takes a call's
rows 16 at a time, then 4 at a time, and runs each row left over as a matrix-vector product
of its own; every block and every leftover row reads the whole weight matrix once. A call's
cost is therefore about a part per row plus a part per pass over the weights, and the
second is the larger where decoding is bound by memory. On the Llama-3.2-1B shape, one call,
2 threads: 3 rows 121 ms and 4 rows 106; 15 rows 296 and 16 rows 258; 31 rows 450 and 32
rows 361. With 1 thread: 3 rows 258 ms and 4 rows 212; 15 rows 589 and 16 rows 481.

The offer counts a filler row as dear as a pass: fillers only where they save more passes
than their number (3 rows run as 4, 14 or 15 as 16), never more than `blocks[-1] - 1` of
them. Passes do not tell the whole cost: on the same machine 7 rows took 180 ms and 8 rows
190. So a call of only decodes, whose shapes recur, takes the offer only while it measures
cheaper (`MeasuredFillers`); a call that carries prefill takes it as offered. Fillers are
rows of a sequence of their own, without outputs, removed after the call: they change no
session's result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.call_split import Recheck, recent_costs, rechecked
from engine.step_costs import DecodeStepCosts


def weight_passes(rows: int, blocks: tuple[int, ...]) -> int:
    """Passes over a weight matrix for `rows` rows: as many of each block as fit, largest
    first, then one per row left over."""
    passes = 0
    for block in blocks:
        passes += rows // block
        rows %= block
    return passes + rows


def filler_rows(rows: int, blocks: tuple[int, ...], limit: int) -> int:
    """Rows to add to a call of `rows` rows (at most `limit` in all) so that its rows plus its
    passes over the weights are fewest; 0 without blocks or when nothing is saved."""
    if not blocks or rows <= 0:
        return 0
    most = min(blocks[-1] - 1, limit - rows)
    best = 0
    for extra in range(1, most + 1):
        if extra + weight_passes(rows + extra, blocks) < best + weight_passes(rows + best, blocks):
            best = extra
    return best


@dataclass(slots=True)
class MeasuredFillers:
    """Whether a call of `rows` decodes takes the fillers offered: both shapes measured (with
    fillers first), the cheaper kept, the other tried again now and then (`Recheck`)."""

    filled_ms: DecodeStepCosts = field(default_factory=recent_costs)  # cost by decode rows, with fillers
    bare_ms: DecodeStepCosts = field(default_factory=recent_costs)  # and without
    rechecks: dict[int, Recheck] = field(default_factory=dict)

    def observe(self, rows: int, filled: bool, ms: float) -> None:
        """Record one call of `rows` decodes and nothing else, run with fillers or without."""
        (self.filled_ms if filled else self.bare_ms).observe(rows, ms)

    def pays(self, rows: int) -> bool:
        """Whether a call of `rows` decodes, offered fillers, takes them."""
        if rows not in self.filled_ms:
            return True
        if rows not in self.bare_ms:
            return False
        return rechecked(self.rechecks, rows, self.filled_ms.cost(rows) < self.bare_ms.cost(rows))
