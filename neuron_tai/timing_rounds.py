"""Timing several things on a machine whose speed drifts: rounds, and times read from them.

Pure (no Trio, no llama.cpp). A shared machine slows and speeds up over seconds (other
tenants, clocks). Timed one after another, each thing meets the machine in a different
state; timed in rounds, every thing once a round, they meet it alike, and comparing them
within a round cancels what the round's state did to all of them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from typing import TypeVar

__all__ = ["rotated", "same_round_times"]

T = TypeVar("T")


def rotated(rounds: int, sides: Sequence[T]) -> Iterator[tuple[int, T]]:
    """(round, side): every side once per round, the order rotated by one each round, so with
    more than two sides each takes every place in turn."""
    for k in range(rounds):
        shift = k % len(sides) if sides else 0
        for side in [*sides[shift:], *sides[:shift]]:
            yield k, side


def same_round_times(times: dict[str, list[float]], reference: str) -> dict[str, float]:
    """One time per thing from its rounds' times: the median of its ratio to `reference`'s time
    in the same round, times `reference`'s median. A slowdown that hits a whole round alike
    changes no ratio, and calls slowed alone do not move a median while they are fewer than
    half its rounds."""
    scale = statistics.median(times[reference])
    ratios = {name: [t / r for t, r in zip(ts, times[reference], strict=True)] for name, ts in times.items()}
    return {name: scale * statistics.median(rs) for name, rs in ratios.items()}
