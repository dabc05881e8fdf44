"""What a decode-only iteration costs, by its rows: measured, and robust to one stall.

Pure (no Trio, no ctypes). A decode step's cost grows with its rows: llama.cpp reads every
weight once per call, then does each row's attention and output head on top (gemma-3-270m on
2 AVX2 cores: 16 ms for 1 row, 57 for 5, 70 for 10). A prefill budget sized from a step of
another size is wrong: sized from the 1-row step of a first session while ten decode, the
target was 4x too small and every gap looked far over it. So each size keeps
its own recent calls, and its cost is their lower median: one stall of the machine (a
page-in, the host's hiccup, a stopped process) is never a size's cost while another call of
that size was measured. A size not measured yet is interpolated between the nearest measured
ones, or taken as the nearest. The same costs, over fewer calls, choose a call's shape
(engine/call_split.py, engine/row_blocks.py).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class DecodeStepCosts:
    """Recent decode-only iterations' milliseconds, by decode rows (at most n_batch sizes)."""

    keep: int = 8  # calls per size whose lower median is its cost
    samples: dict[int, deque[float]] = field(default_factory=dict)

    def observe(self, rows: int, ms: float) -> float | None:
        """Record a decode-only iteration; returns its size's cost before it (None: first)."""
        before = self.cost(rows) if rows in self.samples else None
        self.samples.setdefault(rows, deque(maxlen=self.keep)).append(ms)
        return before

    def forget(self, rows: int) -> None:
        """Drop a size's calls: its next ones are measured afresh."""
        self.samples.pop(rows, None)

    def __contains__(self, rows: int) -> bool:
        return rows in self.samples

    def count(self, rows: int) -> int:
        """Calls of this size kept (at most `keep`)."""
        return len(self.samples.get(rows, ()))

    def measured(self) -> bool:
        return bool(self.samples)

    def near(self, rows: int) -> bool:
        """Whether a size within a factor of 2 of `rows` is measured. Beyond that the nearest
        size's cost may be off by half or more (1 row 16 ms, 5 rows 57: gemma-3-270m above);
        within it, off by a sixth at most in the costs measured here (5 rows 57 ms, 8 rows 69)."""
        return any(max(rows, size) <= 2 * min(rows, size) for size in self.samples)

    def estimate(self, rows: int) -> float | None:
        """A decode-only iteration's cost at `rows`; None before any was measured."""
        if not self.samples:
            return None
        if rows in self.samples:
            return self.cost(rows)
        below = max((size for size in self.samples if size < rows), default=None)
        above = min((size for size in self.samples if size > rows), default=None)
        if below is None or above is None:
            return self.cost(below if above is None else above)  # type: ignore[arg-type]  # one is set
        low, high = self.cost(below), self.cost(above)
        return low + (high - low) * (rows - below) / (above - below)

    def cost(self, size: int) -> float:
        """A measured size's cost: the lower median of its recent calls."""
        return statistics.median_low(self.samples[size])
