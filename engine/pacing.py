"""How many prefill rows may ride along with an iteration's decodes: an adaptive budget.

Pure (no Trio, no ctypes): the engine reports each llama_decode call's rows and time and
asks for the next budget, telling it how many sessions decode and how many wait to
prefill. The policy (README, "How a node schedules"):

- **A target gap.** While sessions decode, every call is a gap between two of their
  tokens. Prefill rows beside the decodes may stretch that gap to the target:
  `itl_target_ms`, or by default `1 + prefill_share` undisturbed gaps (2 with the
  default share: the promise that prefill at most doubles an undisturbed gap). An
  undisturbed gap is a decode-only call of as many rows as decode now (engine/step_costs.py),
  times the 90th percentile of recent decode-only calls over their size's cost, so the
  target follows the rows and the jitter a machine has anyway, not only the mean step.
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
- **Prefill grows with the prompts waiting.** An iteration's prefill is never fewer than
  `MIN_CHUNK` rows for each session waiting to prefill (the scheduler's `max_prefill_tokens`
  caps it, and hands the rows out in its round robin: a long prompt at the front may take
  them all, and the next iteration starts with the next prompt). Held to the target alone,
  a burst of prompts beside a few sessions decoding would trickle in one smallest chunk an
  iteration while the decoders finish: each extra call costs a pass over all the weights,
  and the prompts' first tokens wait for the decoders' last. With one prompt waiting this
  changes nothing (the promise above); with k, the gaps of the sessions decoding may
  stretch to k smallest chunks, and a call that carried more prefill rows than the target
  allows is left out of the p99 the gain follows (a few rows of draft verification, which
  wait in the same round robin, are not).
- A decode step's cost is only measured by an iteration without prefill; under steady
  traffic those stop happening on their own (some prompt is always waiting), so one is
  asked for when the estimate is missing or stale, or no measured size is within a factor
  of 2 of the rows decoding now (sessions joined), never twice in a row; not while more
  sessions wait to prefill than decode: their calls are not held to the target, and
  measuring would only delay their joining.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engine.step_costs import DecodeStepCosts

EMA = 0.2  # weight of the newest sample in the running cost estimates


@dataclass(frozen=True, slots=True)
class Demand:
    """Who an iteration serves: sessions with a decode step ready, sessions waiting to prefill,
    and the decode rows of its largest call (`call_rows`; a micro-batched engine runs each
    group's decodes in a call of their own, and its prefill rides beside one group)."""

    decoding: int = 0
    prefilling: int = 0
    largest_call: int | None = None  # None: all the decodes in one call

    @property
    def call_rows(self) -> int:
        return self.decoding if self.largest_call is None else self.largest_call


@dataclass(slots=True)
class PrefillPace:
    """Running estimates of a decode step's and a prefill token's cost, recent gaps, and the gain."""

    steps: DecodeStepCosts = field(default_factory=DecodeStepCosts)  # decode-only iterations, by rows
    prefill_token_ms: float | None = None
    since_decode_sample: int = 0  # calls since a decode-only one was measured
    gain: float = 1.0  # on the target's room: grows while the gaps' p99 is under the target
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=PrefillPace.WINDOW))  # / their target
    quiet: deque[float] = field(default_factory=lambda: deque(maxlen=PrefillPace.QUIET_WINDOW))  # / their cost
    jitter: float = 1.0  # the quiet calls' QUIET_QUANTILE: an undisturbed gap over its size's cost
    target_ms: float | None = None  # the target the last budget was sized for
    # This iteration's gaps are no evidence for the gain: its budget was raised for a wave, or a
    # call carried more prefill than the target allows (`held_to`).
    boosted: bool = False
    # With several prompts waiting, the prefill rows the target allows: a call that carries
    # more was pushed past the target by the floor (None: one prompt, the floor is the promise).
    held_to: int | None = None
    budget_rows: int = 0  # the last budget: a call that carried fewer rows says nothing of more
    sized: bool = False  # the last budget came from the costs and the gain (not a probe, not 0)
    row_multiple: int = 1  # the scheduler leaves fewer than this many rows of a budget to align a call

    # Prefill rows beside decodes are never fewer than this for each prompt waiting (nor more
    # than the prompts have left). Small chunks cost far more per token than large ones:
    # measured on gemma-3-270m with 5 decodes, 6 prompt rows added 40 ms to a 34 ms step,
    # while 117 rows cost 1.8 ms each; sized from the former, budgets would shrink to a few
    # rows and prefill crawl.
    MIN_CHUNK = 32
    REMEASURE_EVERY = 32  # a decode step's cost drifts with the context length
    WINDOW = 128  # recent gaps whose p99 the gain follows (one outlier in 128 is within p99)
    QUANTILE = 0.99
    # The undisturbed gap: decode-only calls over their size's cost, at the 90th percentile
    # (robust to one stall, unlike a p99 of the few such calls busy traffic leaves).
    QUIET_WINDOW = 64
    QUIET_QUANTILE = 0.9
    GROW, SHRINK = 1.1, 0.7  # the gain after a mixed call, p99 under / over the target
    GROW_BELOW = 0.9  # grow only while the p99 is under this share of the target
    MIN_GAIN, MAX_GAIN = 0.25, 4.0

    def observe(self, decode_rows: int, prefill_rows: int, ms: float) -> None:
        """Record one call: `ms` for `decode_rows` single-token rows and `prefill_rows` prompt rows."""
        self.boosted = self.boosted or (self.held_to is not None and prefill_rows > self.held_to)
        if decode_rows and not self.boosted and self.target_ms:
            self.gaps.append(ms / self.target_ms)
        if prefill_rows == 0:
            if decode_rows:
                self._observe_decode(decode_rows, ms)
            return
        self.since_decode_sample += 1
        base = self.steps.estimate(decode_rows) if decode_rows else 0.0
        if base is None:
            return  # the prefill's share of this call's time is unknown
        self.prefill_token_ms = _blend(self.prefill_token_ms, max(ms - base, 0.0) / prefill_rows)
        if decode_rows and self.sized and not self.boosted and self.target_ms:
            self._adapt(over=ms > self.target_ms, filled=prefill_rows + self.row_multiple > self.budget_rows)

    def _observe_decode(self, rows: int, ms: float) -> None:
        before = self.steps.observe(rows, ms)
        self.quiet.append(ms / before if before else 1.0)
        self.jitter = _quantile(self.quiet, self.QUIET_QUANTILE)
        self.since_decode_sample = 0

    def _adapt(self, over: bool, filled: bool) -> None:
        """Shrink after a gap over its target while the gaps' p99 is over; grow while it is
        clearly under, and only after a call that used its whole budget (a prompt's short tail
        is no evidence that more fits). Growing by GROW from under GROW_BELOW of the target
        lands under it. Only a gap over the target shrinks: one outlier stays in the p99's
        window for WINDOW calls, and must not shrink the gain on every one of them."""
        p99 = _quantile(self.gaps, self.QUANTILE)
        if over and p99 > 1.0:
            self.gain = max(self.gain * self.SHRINK, self.MIN_GAIN)
        elif filled and p99 < self.GROW_BELOW:
            self.gain = min(self.gain * self.GROW, self.MAX_GAIN)

    def target(self, share: float, itl_target_ms: float | None, decode_ms: float) -> float:
        """The gap prefill may stretch a decode step of `decode_ms` to: the operator's, else
        `1 + share` undisturbed gaps (decode-only calls of that size)."""
        if itl_target_ms is not None:
            return itl_target_ms
        return (1.0 + share) * decode_ms * self.jitter

    def prefill_budget(self, share: float, itl_target_ms: float | None = None, demand: Demand | None = None) -> int:
        """Prefill rows for an iteration that also decodes (the scheduler caps them further).

        0 asks for a decode-only iteration, to measure a decode step: when none is measured,
        the last is stale, or no measured size is within a factor of 2 of the rows decoding
        now (unless more sessions wait to prefill). It is never asked twice in a row, so
        prefill keeps moving.
        """
        self.budget_rows = self._budget(share, itl_target_ms, demand or Demand())
        return self.budget_rows

    def _budget(self, share: float, itl_target_ms: float | None, demand: Demand) -> int:
        self.boosted = self.sized = False
        self.held_to = None
        rows = max(demand.call_rows, 1)
        stale = self.since_decode_sample >= self.REMEASURE_EVERY
        wave = demand.prefilling > demand.decoding  # boosted, not held to the target: join first
        unknown = not self.steps.near(rows) and self.since_decode_sample > 0 and not wave
        decode_ms = self.steps.estimate(rows)
        if decode_ms is None or stale or unknown:
            return 0
        self.target_ms = self.target(share, itl_target_ms, decode_ms)
        floor = self.MIN_CHUNK * max(demand.prefilling, 1)  # prefill grows with the prompts waiting
        several = demand.prefilling > 1
        if self.prefill_token_ms is None:  # the first prefill beside decodes: its cost is not known yet
            self.held_to = self.MIN_CHUNK if several else None  # more is for the prompts' sake
            return floor
        room = max(self.target_ms - decode_ms, 0.0) * self.gain
        if wave:
            room *= demand.prefilling / max(demand.decoding, 1)
            self.boosted = True
        self.sized = True
        rows = int(room / max(self.prefill_token_ms, 1e-6))
        self.held_to = rows if several else None  # more is for the prompts' sake: no evidence for the gain
        return max(floor, rows)


def _quantile(values: deque[float], q: float) -> float:
    """Nearest rank; 0 of none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)
