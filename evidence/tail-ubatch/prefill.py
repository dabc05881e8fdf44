"""A last stage's prefill calls with n_ubatch 512 against 128: the cost of smaller micro-batches.

For each shard given, one process per n_ubatch (bench.stage_cost's context otherwise, one
thread), alternating 512 and 128, ROUNDS rounds: each process runs one warm call, then CALLS
calls of ROWS hidden-state rows in fresh sequences, and prints their median seconds and its RSS.
Usage: python prefill.py ROUNDS CALLS ROWS SHARD...
"""

import dataclasses
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.stage_cost import CONTEXT
from engine.backend import Output, Segment, StageBackend
from engine.process_memory import resident_memory


def prefill_s(path: Path, n_ubatch: int, calls: int, rows: int) -> tuple[float, float]:
    backend = StageBackend(path, dataclasses.replace(CONTEXT, n_ubatch=n_ubatch))
    rng = np.random.default_rng(7)
    hidden = rng.standard_normal((rows, backend.info.n_embd)).astype(np.float32)
    seconds = []
    for k in range(calls + 1):
        seq = backend.open_sequence()
        start = time.perf_counter()
        backend.decode([Segment(seq, 0, hidden=hidden, output=Output.TOKEN)])
        seconds.append(time.perf_counter() - start)
        backend.close_sequence(seq)
    rss = resident_memory().rss / 2**20
    backend.close()
    return statistics.median(seconds[1:]), rss


if __name__ == "__main__":
    rounds, calls, rows = (int(x) for x in sys.argv[1:4])
    spawn = multiprocessing.get_context("spawn")
    for shard in sys.argv[4:]:
        for r in range(rounds):
            for ub in (512, 128):
                with spawn.Pool(1) as pool:
                    s, rss = pool.apply(prefill_s, (Path(shard), ub, calls, rows))
                print(f"{Path(shard).name} round {r + 1} n_ubatch {ub}: {rows}-row call median {s:.3f} s, RSS {rss:.1f} MiB", flush=True)
