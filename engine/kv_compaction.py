"""Compaction: free the KV cells closed sessions left among live ones, keeping each live
sequence's cells in their order.

Batch-invariant mode keeps a closed session's cells occupied (engine/backend.py
`retire_sequence`): llama.cpp puts new tokens in the first usable cells from its search
head, so a hole below a live sequence's cells would take that sequence's next token
ahead of its earlier ones, and flash attention sums a query row's visible cells in cell
order (below 64 query rows, which batch-invariant mode never exceeds).

Compaction empties the holes without reordering anything. Every live sequence's cells
are copied out (`llama_state_seq_get_data` writes them in cell order), the whole cache
is emptied, and each copy is put back (`llama_state_seq_set_data` takes the first run of
contiguous free cells from the search head, fills it in the copy's order and leaves the
head after it). The sequences end up packed from cell 0, one after another, each in its
own order, with every free cell above them, so each sequence's next tokens again land
above its cells: its attention sums see the same cells in the same order, bit for bit.

A sliding-window model's second cache goes along in the same copies; llama.cpp copies
only the cells still in a sequence's window (the last `n_swa` positions), so after a
compaction such a sequence can go back no further than its window reaches
(engine/backend.py `can_rewind`).

The copies are held in memory while the cache is empty: at most the live sequences' KV.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine.llama_handles import LlamaContext, SeqState


@dataclass(frozen=True, slots=True)
class Compaction:
    """What a compaction did. With `failure` set nothing changed: a copy could not be taken."""

    kept: tuple[int, ...] = ()  # sequences put back, in the order they were
    cells: int = 0  # positions they hold (one cell each in the full-attention cache)
    bytes: int = 0  # the size of their copies
    lost: tuple[int, ...] = ()  # sequences whose copy llama.cpp would not put back: now empty
    failure: str | None = None


def compact(ctx: LlamaContext, lengths: Mapping[int, int]) -> Compaction:
    """Repack the cache while no decode runs. `lengths`: every sequence whose cells must be
    kept, with its length; every other sequence's cells are dropped."""
    copies: dict[int, npt.NDArray[np.uint8]] = {}
    for seq, length in lengths.items():
        if length == 0:
            continue
        outcome, blob = ctx.seq_state(seq)
        if outcome is not SeqState.DONE:
            return Compaction(failure=f"llama.cpp's copy of sequence {seq} {outcome.value} ({blob.size} bytes)")
        copies[seq] = blob
    lost: list[int] = []
    while True:
        # A copy refused after it claimed cells leaves a hole below the sequences placed after
        # it: start again from an empty cache without it.
        ctx.memory_clear()
        refused = next((seq for seq, blob in copies.items() if not _put_back(ctx, seq, blob, lengths[seq])), None)
        if refused is None:
            cells, size = sum(lengths[seq] for seq in copies), sum(blob.size for blob in copies.values())
            return Compaction(tuple(copies), cells, size, tuple(lost))
        lost.append(refused)
        del copies[refused]


def _put_back(ctx: LlamaContext, seq: int, blob: npt.NDArray[np.uint8], length: int) -> bool:
    return ctx.set_seq_state(seq, blob) is SeqState.DONE and ctx.seq_pos_max(seq) == length - 1
