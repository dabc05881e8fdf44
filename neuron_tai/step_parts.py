"""Where a chain stage cuts a long step into parts it sends on one by one.

A stage with a next stage forwards a step's hidden states once it has computed them. A
prompt computed whole keeps the next stage idle until the last row is done here, then this
stage idle (for that session) while the next one computes it all. Sent on in parts, the next
stage computes part k while this one computes part k+1: a prompt's prefill is pipelined
across the chain like the decodes of the head's micro-batches. Parts are the step's rows
in order, each `rows` long but the last. Pure: the stage's step runner does the sending.
"""

from __future__ import annotations

__all__ = ["step_parts"]


def step_parts(pos: int, n: int, rows: int) -> list[tuple[int, int]]:
    """`(pos, n)` of each part of a step of `n` rows from `pos`; one part when `rows` is 0 or `n` fits."""
    if pos < 0 or n < 1 or rows < 0:
        raise ValueError(f"need pos >= 0, n >= 1 and rows >= 0, not {pos}, {n}, {rows}")
    if rows == 0 or n <= rows:
        return [(pos, n)]
    return [(pos + start, min(rows, n - start)) for start in range(0, n, rows)]
