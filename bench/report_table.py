"""Markdown tables for the bench's reports: one way to write a value and a table."""

from __future__ import annotations

from typing import Any


def fmt(v: Any, digits: int = 1) -> str:
    """`v` as the reports show it: floats to `digits` places, a missing value as a dash."""
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(x) if not isinstance(x, str) else x for x in row) + " |" for row in rows]
    return "\n".join(lines)
