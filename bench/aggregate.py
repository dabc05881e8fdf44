"""Figures derived from a run's raw rows: means over repetitions and the saturation point."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

SATURATION_SHARE = 0.90  # saturated at the first concurrency within 10% of the best aggregate tok/s


def mean_by(runs: list[dict[str, Any]], key: str) -> dict[str, dict[int, float]]:
    """system -> concurrency -> mean of `key` over repetitions."""
    acc: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r.get(key) is not None:
            acc[r["system"]][r["concurrency"]].append(float(r[key]))
    return {s: {c: sum(v) / len(v) for c, v in sorted(cs.items())} for s, cs in acc.items()}


def saturation(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system: the first concurrency whose aggregate tok/s is within 10% of the best of the sweep.

    Past it, more concurrent sessions buy less than 10% more throughput (and cost latency).
    Measured against the best level rather than as gain per doubling because aggregate
    throughput is not monotonic here (it dips at 2 sessions, the bare loop's too).
    """
    out = {}
    for system, points in mean_by(runs, "tok_s").items():
        cs = list(points)
        gains = {f"{a}->{b}": round(points[b] / points[a] - 1, 3) for a, b in itertools.pairwise(cs)}
        best = max(points.values())
        at = next(c for c in cs if points[c] >= SATURATION_SHARE * best) if len(cs) > 1 else None
        out[system] = {
            "tok_s": {str(c): round(v, 2) for c, v in points.items()},
            "gains": gains,
            "saturates_at": at,
            "best_tok_s": round(best, 2),
        }
    return out
