"""Comparing sessions' outputs between runs: bit-exact checks and default-mode agreement."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

Tokens = Mapping[int, Sequence[int]]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A session whose tokens differ from its reference in a check that must be bit-exact."""

    check: str
    rid: int
    step: int  # first generated token that differs
    expected: tuple[int, ...]
    got: tuple[int, ...]

    def describe(self) -> str:
        at = slice(self.step, self.step + 4)
        return (
            f"MISMATCH {self.check}: request {self.rid} parts at step {self.step}: "
            f"expected {list(self.expected[at])}, got {list(self.got[at])}"
        )


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def exact(check: str, reference: Tokens, got: Tokens) -> list[Mismatch]:
    """Every session in `got` must equal its reference token for token."""
    out = []
    for rid, tokens in got.items():
        step = first_difference(reference[rid], tokens)
        if step is not None:
            out.append(Mismatch(check, rid, step, tuple(reference[rid]), tuple(tokens)))
    return out


def agreement(solo: Tokens, batched: Tokens) -> list[dict[str, Any]]:
    """Per session: share of tokens equal to its solo run, and the first step where they part."""
    rows = []
    for rid, tokens in batched.items():
        ref = solo[rid]
        if len(tokens) != len(ref):
            continue  # a peer that did not report every token id
        same = sum(x == y for x, y in zip(ref, tokens, strict=True))
        rows.append({"rid": rid, "agree": round(same / len(ref), 4), "parts_at": first_difference(ref, tokens)})
    return rows


@dataclass(slots=True)
class LogitsGap:
    """Teacher-forced logits of the same session solo and batched, compared step by step.

    Both runs feed the same tokens, so any difference is the kernels' arithmetic, not
    a different history. `margin` is the solo run's top-1 minus top-2 logit: where it
    is below the gap, greedy choices may legitimately part.
    """

    solo: dict[tuple[int, int], npt.NDArray[np.float32]] = field(default_factory=dict)
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)

    def keep_solo(self, rid: int, step: int, logits: npt.NDArray[np.float32]) -> None:
        self.solo[(rid, step)] = logits

    def compare(self, rid: int, step: int, logits: npt.NDArray[np.float32]) -> None:
        ref = self.solo.pop((rid, step))
        diff = np.abs(ref.astype(np.float64) - logits)
        top2 = np.partition(ref, -2)[-2:]
        row = self.rows.setdefault(
            rid,
            {
                "rid": rid,
                "steps": 0,
                "max_abs": 0.0,
                "sum_abs": 0.0,
                "scale": 0.0,
                "min_margin": float("inf"),
                "argmax_differs": 0,
                "margins": [],
            },
        )
        row["steps"] += 1
        row["max_abs"] = max(row["max_abs"], float(diff.max()))
        row["sum_abs"] += float(diff.mean())
        row["scale"] = max(row["scale"], float(np.std(ref)))
        row["min_margin"] = min(row["min_margin"], float(top2[1] - top2[0]))
        row["margins"].append(float(f"{top2[1] - top2[0]:.4g}"))
        row["argmax_differs"] += int(np.argmax(ref) != np.argmax(logits))

    def summary(self) -> list[dict[str, Any]]:
        out = []
        for row in sorted(self.rows.values(), key=lambda r: r["rid"]):
            out.append(
                {
                    "rid": row["rid"],
                    "steps": row["steps"],
                    "max_abs_diff": float(f"{row['max_abs']:.3g}"),
                    "mean_abs_diff": float(f"{row['sum_abs'] / row['steps']:.3g}"),
                    "logit_std": round(row["scale"], 3),
                    "min_top2_margin": float(f"{row['min_margin']:.3g}"),
                    "argmax_differs": row["argmax_differs"],
                    "top2_margins": row["margins"],
                }
            )
        return out
