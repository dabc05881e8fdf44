"""Telemetry: counters, recent-window rates and a step-time histogram (DESIGN.md names)."""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field

from protocol.errors import Fault

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class RateWindow:
    """Events per second over the last `seconds`."""

    seconds: float = 10.0
    events: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, now: float, n: int) -> None:
        self.events.append((now, n))
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        if not self.events:
            return 0.0
        span = max(now - self.events[0][0], 1e-3)
        return sum(n for _, n in self.events) / max(span, min(self.seconds, 1.0))

    def _trim(self, now: float) -> None:
        while self.events and self.events[0][0] < now - self.seconds:
            self.events.popleft()


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram in the Prometheus layout."""

    bounds: tuple[float, ...] = STEP_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1


@dataclass(slots=True)
class Telemetry:
    """Counters the engine updates (read through `Engine.statistics`)."""

    admissions_total: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    quota_refused: Counter[str] = field(default_factory=Counter)  # by the engine's per-connection quota (queued)
    errors: Counter[str] = field(default_factory=Counter)
    batches_total: int = 0
    batch_rows_last: int = 0
    batch_rows_sum: int = 0
    decode_batches_total: int = 0
    decode_rows_sum: int = 0
    kv_reserved_peak: int = 0
    linger_seconds_total: float = 0.0  # waiting for answered sessions' next steps
    late_sessions_total: int = 0  # answered sessions whose next step missed the next batch (first stage)
    cleanups_total: int = 0  # close/rollback/gone-connection requests taken on the cleanup path
    no_kv_slot_total: int = 0  # llama_decode calls that found no KV slot (retried split, or `busy`)
    halved_total: int = 0  # iterations whose decodes ran as two calls of half the rows (engine/call_split.py)
    padding_rows_total: int = 0  # rows added to calls: batch-invariant padding, or fillers (engine/row_blocks.py)
    kv_compactions_total: int = 0  # KV cache compactions that freed held cells (batch-invariant mode)
    kv_compactions_failed_total: int = 0  # compactions that could not copy a session out (nothing changed)
    kv_compaction_seconds_total: float = 0.0
    kv_cells_reclaimed_total: int = 0  # held cells freed, by compactions or when no session was left
    kv_cells_moved_total: int = 0  # open sessions' cells copied out and back by compactions
    kv_sessions_lost_total: int = 0  # sessions closed because a compaction could not put their cells back
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    prefill_window: RateWindow = field(default_factory=RateWindow)
    decode_window: RateWindow = field(default_factory=RateWindow)
    step_seconds: Histogram = field(default_factory=Histogram)

    def record_batch(self, now: float, rows: int, prefill: int, decode: int, seconds: float) -> None:
        self.batches_total += 1
        self.batch_rows_last = rows
        self.batch_rows_sum += rows
        if decode:
            self.decode_batches_total += 1
            self.decode_rows_sum += decode
        self.prefill_tokens_total += prefill
        self.decode_tokens_total += decode
        self.prefill_window.add(now, prefill)
        self.decode_window.add(now, decode)
        self.step_seconds.observe(seconds)

    def counted(self, fault: Fault) -> Fault:
        """Count an error the engine answers (`errors_total`), and pass it on."""
        self.errors[fault.code] += 1
        return fault

    def occupancy(self, max_rows: int) -> float:
        """Mean rows per batch over the maximum rows a batch may carry."""
        return 0.0 if not self.batches_total else self.batch_rows_sum / self.batches_total / max_rows
