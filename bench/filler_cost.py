"""What filler rows save: a decode call of n sessions against the same call with the fillers
engine/row_blocks.py offers, through the node's own backend, the two interleaved.

The sessions hold 64 tokens of context each; the fillers are rows of a sequence of their own
without outputs, removed after each call, as the engine runs them. For each thread count and
size it reports the median milliseconds of both calls and their ratio.

    NEURON_TAI_BENCH_MODEL=llama-3.2-1b python -m bench.filler_cost [--threads 1,2] [--reps 9]
    python -m bench.filler_cost --quick     # the tiny test model, under .bench/: checks that it runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import bench_model, shown, write_result
from engine.backend import ContextConfig, Segment, StageBackend
from engine.kernels import CALL_ROW_BLOCKS
from engine.messages import Output
from engine.row_blocks import filler_rows

CONTEXT_TOKENS = 64
SESSIONS = 16
REPACK_BLOCKS = CALL_ROW_BLOCKS["repack"]


class Calls:
    """One backend with SESSIONS sessions of CONTEXT_TOKENS tokens each and a filler sequence."""

    def __init__(self, model: Path, threads: int) -> None:
        config = ContextConfig(n_seq_max=SESSIONS + 1, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=threads)
        self.backend = StageBackend(model, config)
        self.kernel_path = self.backend.model.kernel_path.value
        self.blocks = CALL_ROW_BLOCKS[self.kernel_path] or REPACK_BLOCKS  # what fillers would do on a path without
        self.seqs = [self.backend.open_sequence() for _ in range(SESSIONS)]
        self.filler = self.backend.open_sequence()
        rng = np.random.default_rng(3)
        for seq in self.seqs:
            ids = rng.integers(10, min(1000, self.backend.info.n_vocab), CONTEXT_TOKENS).astype(np.int32)
            self.backend.decode([Segment(seq, 0, tokens=ids, output=Output.NONE)])

    def ms(self, rows: int, fillers: int) -> float:
        """One call of `rows` decodes (a token each) and `fillers` filler rows, then undone."""
        segments = [Segment(s, CONTEXT_TOKENS, tokens=np.array([100 + s], np.int32), output=Output.LOGITS)
                    for s in self.seqs[:rows]]  # fmt: skip
        if fillers:
            segments.append(Segment(self.filler, 0, tokens=np.zeros(fillers, np.int32), output=Output.NONE))
        started = time.perf_counter()
        self.backend.decode(segments)
        elapsed = (time.perf_counter() - started) * 1000
        for seq in self.seqs[:rows]:
            self.backend.rewind(seq, CONTEXT_TOKENS)
        self.backend.rewind(self.filler, 0)
        return elapsed

    def close(self) -> None:
        self.backend.close()


def measure(model: Path, threads: int, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Per size: the fillers offered and both calls' median ms, the two alternating in order."""
    calls = Calls(model, threads)
    try:
        offered = {n: filler_rows(n, calls.blocks, 512) for n in sizes}
        runs: dict[tuple[int, int], list[float]] = {}
        for rep in range(reps):
            for n in sizes:
                for k in (0, offered[n]) if rep % 2 == 0 else (offered[n], 0):
                    runs.setdefault((n, k), []).append(calls.ms(n, k))
    finally:
        calls.close()
    rows = []
    for n in sizes:
        bare, filled = (statistics.median(runs[(n, k)]) for k in (0, offered[n]))
        rows.append({"threads": threads, "kernel_path": calls.kernel_path, "blocks": list(calls.blocks),
                     "rows": n, "fillers": offered[n], "bare_ms": round(bare, 2),
                     "filled_ms": round(filled, 2), "filled_over_bare": round(filled / bare, 3)})  # fmt: skip
        print(f"threads {threads}  {n:2d} rows: {bare:7.1f} ms, with {offered[n]} filler(s) {filled:7.1f} ms "
              f"({filled / bare:.3f})", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="llama.cpp thread counts, comma-separated")
    parser.add_argument("--sizes", default="3,7,11,14,15", help="decode rows per call, comma-separated")
    parser.add_argument("--reps", type=int, default=9, help="calls of each shape (median)")
    parser.add_argument("--quick", action="store_true", help="the tiny test model: checks that it runs")
    args = parser.parse_args()
    model = bench_model(args.quick)
    sizes = [int(x) for x in args.sizes.split(",")]
    if not sizes or not all(1 <= n <= SESSIONS for n in sizes):
        parser.error(f"sizes must be 1-{SESSIONS}")
    rows = [r for t in args.threads.split(",") for r in measure(model, int(t), sizes, args.reps)]
    payload = {"model": model.name, "context_tokens": CONTEXT_TOKENS, "reps": args.reps, "rows": rows}
    print(f"wrote {shown(write_result('filler_cost.json', payload, args.quick))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
