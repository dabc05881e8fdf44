"""A last stage's 512-row prefill calls and resident memory, by n_ubatch and glibc's mmap threshold.

For each shard given, ROUNDS rounds; in each, one fresh process per (n_ubatch, threshold)
pair, in the order given: it sets glibc's M_MMAP_THRESHOLD with mallopt when the pair asks
(0: glibc's default, a threshold that rises to the largest block freed; -1: the default,
and malloc_trim(0) before the resident set is read; -2: the default, and malloc_trim(0)
once the stage is loaded), runs one warm call,
then CALLS calls of ROWS hidden-state rows in fresh sequences (bench.stage_cost's context
otherwise, one thread), then 8-row decode steps, and prints the calls' median seconds and
the process's resident set.
Usage: python prefill.py ROUNDS CALLS ROWS UBATCH:THRESHOLD[,...] SHARD...
"""

import ctypes
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

M_MMAP_THRESHOLD = -3


def prefill_s(path: Path, n_ubatch: int, threshold: int, calls: int, rows: int) -> tuple[float, float]:
    libc = ctypes.CDLL("libc.so.6")
    if threshold > 0:
        libc.mallopt(M_MMAP_THRESHOLD, threshold)
    backend = StageBackend(path, dataclasses.replace(CONTEXT, n_ubatch=n_ubatch))
    if threshold == -2:
        libc.malloc_trim(0)
    rng = np.random.default_rng(7)
    hidden = rng.standard_normal((rows, backend.info.n_embd)).astype(np.float32)
    seconds = []
    for _ in range(calls + 1):
        seq = backend.open_sequence()
        start = time.perf_counter()
        backend.decode([Segment(seq, 0, hidden=hidden, output=Output.TOKEN)])
        seconds.append(time.perf_counter() - start)
        backend.close_sequence(seq)
    seqs = [backend.open_sequence() for _ in range(8)]
    for pos in range(4):
        row = rng.standard_normal((1, backend.info.n_embd)).astype(np.float32)
        backend.decode([Segment(s, pos, hidden=row, output=Output.TOKEN) for s in seqs])
    if threshold < 0:
        libc.malloc_trim(0)
    rss = resident_memory().rss / 2**20
    backend.close()
    return statistics.median(seconds[1:]), rss


if __name__ == "__main__":
    rounds, calls, rows = (int(x) for x in sys.argv[1:4])
    pairs = [tuple(int(v) for v in p.split(":")) for p in sys.argv[4].split(",")]
    spawn = multiprocessing.get_context("spawn")
    for shard in sys.argv[5:]:
        for r in range(rounds):
            for ub, threshold in pairs:
                with spawn.Pool(1) as pool:
                    s, rss = pool.apply(prefill_s, (Path(shard), ub, threshold, calls, rows))
                print(
                    f"{Path(shard).name} round {r + 1} n_ubatch {ub} mmap threshold { {0: 'default', -1: 'default, trimmed', -2: 'default, trimmed after loading'}.get(threshold, threshold)}: "
                    f"{rows}-row call median {s:.3f} s, RSS {rss:.1f} MiB",
                    flush=True,
                )
