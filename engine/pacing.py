"""How many prefill rows may ride along with an iteration's decodes: an adaptive budget.

Pure (no Trio, no ctypes): the engine reports each llama_decode call's rows and time and
asks for the next budget, telling it how many sessions decode and how many wait to
prefill. The policy (README, "How a node schedules"):

- **A target gap.** While sessions decode, every call is a gap between two of their
  tokens. Prefill rows beside the decodes may stretch that gap to the target:
  `itl_target_ms`, or by default `1 + prefill_share` undisturbed gaps (2 with the
  default share: the promise that prefill at most doubles an undisturbed gap). An
  undisturbed gap is a decode-only call: the 90th percentile of the recent ones, so the
  target follows the jitter a machine has anyway, not only the mean decode step.
- **Sized from measured costs, corrected by what the gaps do.** Rows are the target's room
  over a decode step divided by a prefill token's cost, times a gain that grows while
  the recent gaps' p99 stays under the target and shrinks when it does not. The cost
  of a token depends on the chunk's size, so the model alone is off; the gain is what
  holds the p99 at the target rather than the estimate.
- **Shared by who waits.** When more sessions wait to prefill than decode, the room is
  multiplied by their ratio: each session, prefilling or decoding, gets about the same
  share of the engine's time, so a wave of new sessions joins the decode batch within a
  few iterations instead of trickling in one prompt per many steps (a decode call costs
  nearly the same with 2 rows as with 8). Such boosted calls stretch the gaps of the few
  sessions decoding past the target: they are left out of the p99 the gain follows.
- A decode step's cost is only measured by an iteration without prefill; under steady
  traffic those stop happening on their own (some prompt is always waiting), so one is
  asked for when the estimate is missing or stale, never twice in a row.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

EMA = 0.2  # weight of the newest sample in the running cost estimates


@dataclass(frozen=True, slots=True)
class Demand:
    """Who an iteration serves: sessions with a decode step ready, sessions waiting to prefill."""

    decoding: int = 0
    prefilling: int = 0


@dataclass(slots=True)
class PrefillPace:
    """Running estimates of a decode step's and a prefill token's cost, recent gaps, and the gain."""

    decode_ms: float | None = None
    prefill_token_ms: float | None = None
    since_decode_sample: int = 0  # calls since a decode-only one was measured
    gain: float = 1.0  # on the target's room: grows while the gaps' p99 is under the target
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=PrefillPace.WINDOW))
    quiet: deque[float] = field(default_factory=lambda: deque(maxlen=PrefillPace.QUIET_WINDOW))  # decode-only
    undisturbed_ms: float | None = None  # the quiet calls' QUIET_QUANTILE, kept as they arrive
    target_ms: float | None = None  # the target the last budget was sized for
    boosted: bool = False  # the last budget was raised for sessions waiting to prefill
    budget_rows: int = 0  # the last budget: a call that carried fewer rows says nothing of more
    sized: bool = False  # the last budget came from the costs and the gain (not a probe, not 0)

    # Prefill rows beside decodes are never fewer than this (nor more than the prompt has
    # left). Small chunks cost far more per token than large ones: measured on gemma-3-270m
    # with 5 decodes, 6 prompt rows added 40 ms to a 34 ms step, while 117 rows cost 1.8 ms
    # each; sized from the former, budgets would shrink to a few rows and prefill crawl.
    MIN_CHUNK = 32
    REMEASURE_EVERY = 32  # a decode step's cost drifts with its rows and the context length
    WINDOW = 128  # recent gaps whose p99 the gain follows (one outlier in 128 is within p99)
    QUANTILE = 0.99
    # The undisturbed gap: the 90th percentile of recent decode-only calls (robust to one stall,
    # unlike a p99 of the few such calls busy traffic leaves).
    QUIET_WINDOW = 64
    QUIET_QUANTILE = 0.9
    GROW, SHRINK = 1.1, 0.7  # the gain after a mixed call, p99 under / over the target
    GROW_BELOW = 0.9  # grow only while the p99 is under this share of the target
    MIN_GAIN, MAX_GAIN = 0.25, 4.0

    def observe(self, decode_rows: int, prefill_rows: int, ms: float) -> None:
        """Record one call: `ms` for `decode_rows` single-token rows and `prefill_rows` prompt rows."""
        if decode_rows and not self.boosted:
            self.gaps.append(ms)
        if prefill_rows == 0:
            if decode_rows:
                self.decode_ms = _blend(self.decode_ms, ms)
                self.quiet.append(ms)
                self.undisturbed_ms = _quantile(self.quiet, self.QUIET_QUANTILE)
                self.since_decode_sample = 0
            return
        self.since_decode_sample += 1
        if decode_rows and self.decode_ms is None:
            return  # the prefill's share of this call's time is unknown
        base = self.decode_ms if decode_rows and self.decode_ms is not None else 0.0
        self.prefill_token_ms = _blend(self.prefill_token_ms, max(ms - base, 0.0) / prefill_rows)
        if decode_rows and self.sized and not self.boosted and self.target_ms is not None:
            self._adapt(self.target_ms, filled=prefill_rows >= self.budget_rows)

    def _adapt(self, target_ms: float, filled: bool) -> None:
        """Shrink while the gaps' p99 is over the target; grow while it is clearly under, and
        only after a call that used its whole budget (a prompt's short tail is no evidence
        that more fits). Growing by GROW from under GROW_BELOW of the target lands under it."""
        p99 = _quantile(self.gaps, self.QUANTILE)
        if p99 > target_ms:
            self.gain = max(self.gain * self.SHRINK, self.MIN_GAIN)
        elif filled and p99 < self.GROW_BELOW * target_ms:
            self.gain = min(self.gain * self.GROW, self.MAX_GAIN)

    def target(self, share: float, itl_target_ms: float | None) -> float | None:
        """The gap prefill may stretch a decode step to: the operator's, else `1 + share`
        undisturbed gaps (decode-only calls)."""
        if itl_target_ms is not None:
            return itl_target_ms
        return (1.0 + share) * self.undisturbed_ms if self.undisturbed_ms is not None else None

    def prefill_budget(self, share: float, itl_target_ms: float | None = None, demand: Demand | None = None) -> int:
        """Prefill rows for an iteration that also decodes (the scheduler caps them further).

        0 asks for a decode-only iteration, to measure a decode step; it is never asked
        twice in a row, so prefill keeps moving.
        """
        self.budget_rows = self._budget(share, itl_target_ms, demand or Demand())
        return self.budget_rows

    def _budget(self, share: float, itl_target_ms: float | None, demand: Demand) -> int:
        self.boosted = self.sized = False
        if self.decode_ms is None or self.since_decode_sample >= self.REMEASURE_EVERY:
            return 0
        self.target_ms = self.target(share, itl_target_ms)
        if self.prefill_token_ms is None or self.target_ms is None:
            return self.MIN_CHUNK  # the first prefill beside decodes: its cost is not known yet
        room = max(self.target_ms - self.decode_ms, 0.0) * self.gain
        if demand.prefilling > demand.decoding:
            room *= demand.prefilling / max(demand.decoding, 1)
            self.boosted = True
        self.sized = True
        return max(self.MIN_CHUNK, int(room / max(self.prefill_token_ms, 1e-6)))


def _quantile(values: deque[float], q: float) -> float:
    """Nearest rank; 0 of none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)
