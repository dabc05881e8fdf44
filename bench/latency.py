"""What one request saw (token arrival times) and what a run of many adds up to."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class Trace:
    """Tokens one request produced and when each arrived (perf_counter seconds).

    `times` has one entry per generated token. `tokens` may be shorter where a peer does
    not report every token id (llama-server holds back tokens that end inside a UTF-8
    character); such a trace is left out of token comparisons.
    """

    rid: int
    start: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def add(self, token: int) -> None:
        self.tokens.append(token)
        self.times.append(time.perf_counter())

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


def summarize(traces: Sequence[Trace], wall_s: float) -> dict[str, Any]:
    """Aggregate tokens per second over the run's wall time, TTFT and inter-token latency percentiles."""
    generated = sum(len(t.times) for t in traces)
    ttfts = [t.ttft for t in traces if t.times]
    gaps = [g for t in traces for g in t.gaps]
    return {
        "requests": len(traces),
        "tokens": generated,
        "wall_s": round(wall_s, 3),
        "tok_s": round(generated / wall_s, 2) if wall_s > 0 else None,
        "ttft_p50_ms": percentile_ms(ttfts, 50),
        "ttft_p99_ms": percentile_ms(ttfts, 99),
        "itl_p50_ms": percentile_ms(gaps, 50),
        "itl_p99_ms": percentile_ms(gaps, 99),
    }
