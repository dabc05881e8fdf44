"""How many prefill rows may ride along with an iteration's decodes: sized from measured costs.

Pure (no Trio, no ctypes): the engine reports each llama_decode call's rows and time and
asks for the next budget. A decode step's cost is only measured by an iteration without
prefill; under steady traffic such iterations stop happening on their own (some prompt
is always waiting), so one is scheduled when the estimate is missing or stale. Without
it the estimate would never form and prefill would stay at its first, smallest size: on
prompt-heavy traffic the first token would wait seconds while decode batches run short
of sessions.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA = 0.2  # weight of the newest sample in the running estimates


@dataclass(slots=True)
class PrefillPace:
    """Running estimates of a decode step's cost and of one prefill token's."""

    decode_ms: float | None = None
    prefill_token_ms: float | None = None
    since_decode_sample: int = 0  # iterations since a decode-only one was measured

    # Prefill rows beside decodes are never fewer than this (nor more than the prompt has
    # left). Small chunks cost far more per token than large ones: measured on gemma-3-270m
    # with 5 decodes, 6 prompt rows added 40 ms to a 34 ms step, while 117 rows cost 1.8 ms
    # each; sized from the former, budgets would shrink to a few rows and prefill crawl.
    MIN_CHUNK = 32
    REMEASURE_EVERY = 32  # a decode step's cost drifts with its rows and the context length

    def observe(self, decode_rows: int, prefill_rows: int, ms: float) -> None:
        """Record one call: `ms` for `decode_rows` single-token rows and `prefill_rows` prompt rows."""
        if prefill_rows == 0:
            if decode_rows:
                self.decode_ms = _blend(self.decode_ms, ms)
                self.since_decode_sample = 0
            return
        self.since_decode_sample += 1
        if decode_rows and self.decode_ms is None:
            return  # the prefill's share of this call's time is unknown
        base = self.decode_ms if decode_rows and self.decode_ms is not None else 0.0
        self.prefill_token_ms = _blend(self.prefill_token_ms, max(ms - base, 0.0) / prefill_rows)

    def prefill_budget(self, share: float) -> int:
        """Prefill rows for an iteration that also decodes: about `share` decode steps' time.

        0 asks for a decode-only iteration, to measure a decode step; it is never asked
        twice in a row, so prefill keeps moving.
        """
        if self.decode_ms is None or self.since_decode_sample >= self.REMEASURE_EVERY:
            return 0
        if self.prefill_token_ms is None:
            return self.MIN_CHUNK  # the first prefill beside decodes: its cost is not known yet
        return max(self.MIN_CHUNK, int(share * self.decode_ms / max(self.prefill_token_ms, 1e-6)))


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)
