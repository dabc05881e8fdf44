"""A `llama_batch` whose arrays are owned by numpy, so a batch is filled with vector copies.

`llama_batch_init` mallocs one `seq_id` array per row, which forces a Python loop
per row to fill; here every row's seq-id pointer aims into one contiguous int32
array, so positions, sequence ids and inputs are each one slice assignment.
"""

from __future__ import annotations

import ctypes

import llama_cpp as lc
import numpy as np
import numpy.typing as npt


class BatchBuffer:
    """Room for `capacity` rows of token ids (n_embd == 0) or hidden states."""

    def __init__(self, capacity: int, n_embd: int = 0) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, np.int32)
        self.embd = np.zeros((capacity, max(n_embd, 1)), np.float32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq_id = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        row_ptr = ctypes.POINTER(ctypes.c_int32)
        base = self.seq_id.ctypes.data
        self._seq_ptrs = (row_ptr * capacity)(*(ctypes.cast(base + 4 * i, row_ptr) for i in range(capacity)))
        f32, i32 = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int32)
        self.batch = lc.llama_batch(
            0,
            None if n_embd else self.token.ctypes.data_as(i32),
            self.embd.ctypes.data_as(f32) if n_embd else None,
            self.pos.ctypes.data_as(i32),
            self.n_seq_id.ctypes.data_as(i32),
            ctypes.cast(self._seq_ptrs, ctypes.POINTER(row_ptr)),
            self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self.n_tokens = 0

    def clear(self) -> None:
        self.n_tokens = 0

    def add(
        self,
        seq: int,
        pos: int,
        *,
        tokens: npt.NDArray[np.int32] | None = None,
        hidden: npt.NDArray[np.float32] | None = None,
        outputs: bool | npt.NDArray[np.bool_] = False,
    ) -> range:
        """Append a run of consecutive positions of one sequence; returns its row indices."""
        n = len(tokens) if tokens is not None else len(hidden) if hidden is not None else 0
        a, b = self.n_tokens, self.n_tokens + n
        if b > self.capacity:
            raise ValueError(f"batch holds at most {self.capacity} rows")
        if tokens is not None:
            self.token[a:b] = tokens
        elif hidden is not None:
            self.embd[a:b] = hidden
        self.pos[a:b] = np.arange(pos, pos + n, dtype=np.int32)
        self.seq_id[a:b] = seq
        self.logits[a:b] = outputs
        self.n_tokens = b
        return range(a, b)

    def view(self) -> lc.llama_batch:
        self.batch.n_tokens = self.n_tokens
        return self.batch
