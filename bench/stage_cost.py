"""What each stage of a split costs per decode step: the even layer split against `--stages`' weight balance.

A chain runs at the pace of its slowest stage. For each split this loads every shard alone
(one llama.cpp thread, as a stage on its own core), runs decode steps of 8 sessions (and of
1) and reports the median time per step, the slowest stage, and the bound that puts on a
2-stage chain's efficiency against one node: whole-model step / (stages x slowest stage).

It also reports what each stage holds in memory, each in a fresh process after one full
prefill batch and decode steps: its weights, KV cache, llama.cpp's compute buffer (as
reserved) and logits buffer, and the process's resident bytes (VmRSS, VmHWM), against the
target weights + KV + 25%.

    python -m bench.stage_cost [--stages 2] [--reps 3]   # gemma-3-270m; writes evidence/stage_cost.json
    python -m bench.stage_cost --quick                   # the tiny test model, under .bench/
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import SHARDS, bench_model, interleaved, shown, write_result
from engine.backend import ContextConfig, Segment, StageBackend
from engine.config import default_n_ubatch
from engine.gguf_facts import read_facts
from engine.llama_handles import logged_buffers
from engine.messages import Output
from engine.process_memory import resident_memory
from neuron_tai.shard import stage_bounds, weight_balanced_bounds
from neuron_tai.shard_cache import cached_stages

ROWS = (1, 8)
CONTEXT = ContextConfig(n_seq_max=8, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=1)
MIB = 2**20


def step_ms(path: Path, steps: int) -> dict[int, float]:
    """Median milliseconds of one decode step of `rows` sessions, for each of ROWS."""
    backend = StageBackend(path, CONTEXT)
    try:
        info = backend.info
        out = Output.TOKEN if info.last else Output.HIDDEN
        seqs = [backend.open_sequence() for _ in range(8)]
        rng = np.random.default_rng(7)

        def segment(seq: int, pos: int) -> Segment:
            if info.first:
                return Segment(seq, pos, tokens=np.array([100 + seq], np.int32), output=out)
            return Segment(seq, pos, hidden=rng.standard_normal((1, info.n_embd)).astype(np.float32), output=out)

        pos = 0
        for _ in range(4):  # warm up
            backend.decode([segment(s, pos) for s in seqs])
            pos += 1
        result = {}
        for rows in ROWS:
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                backend.decode([segment(s, pos) for s in seqs[:rows]])
                times.append((time.perf_counter() - start) * 1000)
                pos += 1
            for s in seqs[rows:]:  # the sequences left out catch up, untimed
                for p in range(pos - steps, pos):
                    backend.decode([segment(s, p)])
            result[rows] = round(statistics.median(times), 2)
        return result
    finally:
        backend.close()


def stage_memory(path: Path) -> dict[str, float]:
    """MiB a stage holds after a full prefill batch and 8-row decode steps (run in a fresh process)."""
    base = resident_memory()  # the interpreter and the libraries, before the model
    facts = read_facts(path)
    context = dataclasses.replace(CONTEXT, n_ubatch=default_n_ubatch(facts))  # as `serve` runs it
    backend = StageBackend(path, context)
    try:
        info, n = backend.info, CONTEXT.n_batch
        out = Output.TOKEN if info.last else Output.HIDDEN
        seqs = [backend.open_sequence() for _ in range(8)]
        rng = np.random.default_rng(7)

        def segment(seq: int, pos: int, rows: int) -> Segment:
            if info.first:
                return Segment(seq, pos, tokens=(np.arange(rows, dtype=np.int32) + 100) % info.n_vocab, output=out)
            return Segment(seq, pos, hidden=rng.standard_normal((rows, info.n_embd)).astype(np.float32), output=out)

        backend.decode([segment(seqs[0], 0, n)])
        for step in range(4):
            backend.decode([segment(s, n + step if s == seqs[0] else step, 1) for s in seqs])
        held = resident_memory()
        weights = facts.weights_bytes
        kv = sum(logged_buffers(backend.context_log, "KV").values())
        parts = {
            "weights": weights,
            "kv": kv,
            "compute": backend.compute_buffer_bytes,
            "output_buffer": backend.output_buffer_bytes(),
            "rss": held.rss,
            "rss_peak": held.peak,
            "rss_anon": held.anon,
            "rss_file": held.file,
            "process_base": base.rss,
            "target": 1.25 * (weights + kv),
        }
        return {key: round(value / MIB, 1) for key, value in parts.items()}
    finally:
        backend.close()


def memory_table(files: dict[str, Path]) -> dict[str, dict[str, float]]:
    """`stage_memory` of each shard, each in a process of its own (a process's peak is its own)."""
    spawn = multiprocessing.get_context("spawn")
    table = {}
    for key, path in files.items():
        with spawn.Pool(1) as pool:
            table[key] = pool.apply(stage_memory, (path,))
        m = table[key]
        print(
            f"memory {key:14} weights {m['weights']} KV {m['kv']} compute {m['compute']} "
            f"output {m['output_buffer']} | RSS {m['rss']} peak {m['rss_peak']} (private {m['rss_anon']}, "
            f"files {m['rss_file']}; {m['process_base']} before the model) target {m['target']} MiB",
            flush=True,
        )
    return table


def split_row(
    name: str, bounds: list[tuple[int, int]], median: dict[str, dict[int, float]], memory: dict[str, Any]
) -> dict[str, Any]:
    """One split's stages: their step times, the slowest, the efficiency bound it puts on a chain, memory."""
    stages = {f"{a}:{b}": median[f"{name} {a}:{b}"] for a, b in bounds}
    slowest = {r: max(s[r] for s in stages.values()) for r in ROWS}
    bound = {r: round(median["whole"][r] / (len(bounds) * slowest[r]), 3) for r in ROWS}
    print(f"{name:8} {bounds}  slowest stage {slowest} ms  efficiency bound {bound}", flush=True)
    return {
        "split": name,
        "bounds": [list(b) for b in bounds],
        "step_ms": stages,
        "slowest_ms": slowest,
        "efficiency_bound": bound,
        "memory_mib": {f"{a}:{b}": memory[f"{name} {a}:{b}"] for a, b in bounds},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3, help="repetitions, interleaved across the shards")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per repetition and row count")
    parser.add_argument("--quick", action="store_true", help="the tiny test model: checks that it runs")
    parser.add_argument("--memory-only", action="store_true", help="only what each stage holds in memory")
    args = parser.parse_args()
    model = bench_model(args.quick)
    n = read_facts(model).block_count
    splits = {"layers": stage_bounds(n, stages=args.stages), "weights": weight_balanced_bounds(model, args.stages)}
    files: dict[str, Path] = {"whole": model}
    for name, bounds in splits.items():
        for (a, b), path in zip(bounds, cached_stages(model, bounds, SHARDS), strict=True):
            files[f"{name} {a}:{b}"] = path
    if args.memory_only:
        memory_table(files)
        return 0
    runs: dict[str, list[dict[int, float]]] = {key: [] for key in files}
    for rep, key in interleaved(args.reps, list(files)):
        runs[key].append(step_ms(files[key], args.steps))
        print(f"rep {rep + 1}/{args.reps} {key:14} {runs[key][-1]}", flush=True)
    median = {key: {r: round(statistics.median(x[r] for x in got), 2) for r in ROWS} for key, got in runs.items()}
    memory = memory_table(files)
    rows = [split_row(name, bounds, median, memory) for name, bounds in splits.items()]
    payload = {
        "model": model.name,
        "stages": args.stages,
        "reps": args.reps,
        "steps": args.steps,
        "threads": 1,
        "whole_step_ms": median["whole"],
        "memory_mib": memory,
        "splits": rows,
        "runs": {k: [{str(r): v for r, v in x.items()} for x in got] for k, got in runs.items()},
    }
    print(f"wrote {shown(write_result('stage_cost.json', payload, args.quick))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
