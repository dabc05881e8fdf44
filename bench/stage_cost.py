"""What each stage of a split costs per decode step: the even layer split against `--stages`' weight balance.

A chain runs at the pace of its slowest stage. For each split this loads every shard alone
(one llama.cpp thread, as a stage on its own core), runs decode steps of 8 sessions (and of
1) and reports the median time per step, the slowest stage, and the bound that puts on a
2-stage chain's efficiency against one node: whole-model step / (stages x slowest stage).

    python -m bench.stage_cost [--stages 2] [--reps 3]   # gemma-3-270m; writes evidence/stage_cost.json
    python -m bench.stage_cost --quick                   # the tiny test model, under .bench/
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import WORK, bench_model, interleaved, shown, write_evidence
from engine.backend import ContextConfig, Segment, StageBackend
from engine.gguf_facts import read_facts
from engine.messages import Output
from neuron_tai.shard import stage_bounds, weight_balanced_bounds, write_stages

ROWS = (1, 8)


def step_ms(path: Path, steps: int) -> dict[int, float]:
    """Median milliseconds of one decode step of `rows` sessions, for each of ROWS."""
    backend = StageBackend(path, ContextConfig(n_seq_max=8, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=1))
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3, help="repetitions, interleaved across the shards")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per repetition and row count")
    parser.add_argument("--quick", action="store_true", help="the tiny test model: checks that it runs")
    args = parser.parse_args()
    model = bench_model(args.quick)
    n = read_facts(model).block_count
    splits = {"layers": stage_bounds(n, stages=args.stages), "weights": weight_balanced_bounds(model, args.stages)}
    files: dict[str, Path] = {"whole": model}
    for name, bounds in splits.items():
        for (a, b), path in zip(bounds, write_stages(model, WORK / "stage-cost" / name, bounds), strict=True):
            files[f"{name} {a}:{b}"] = path
    runs: dict[str, list[dict[int, float]]] = {key: [] for key in files}
    for rep, key in interleaved(args.reps, list(files)):
        runs[key].append(step_ms(files[key], args.steps))
        print(f"rep {rep + 1}/{args.reps} {key:14} {runs[key][-1]}", flush=True)
    median = {key: {r: round(statistics.median(x[r] for x in got), 2) for r in ROWS} for key, got in runs.items()}
    rows: list[dict[str, Any]] = []
    for name, bounds in splits.items():
        stages = {f"{a}:{b}": median[f"{name} {a}:{b}"] for a, b in bounds}
        slowest = {r: max(s[r] for s in stages.values()) for r in ROWS}
        bound = {r: round(median["whole"][r] / (len(bounds) * slowest[r]), 3) for r in ROWS}
        rows.append(
            {
                "split": name,
                "bounds": [list(b) for b in bounds],
                "step_ms": stages,
                "slowest_ms": slowest,
                "efficiency_bound": bound,
            }
        )
        print(f"{name:8} {bounds}  slowest stage {slowest} ms  efficiency bound {bound}", flush=True)
    payload = {
        "model": model.name,
        "stages": args.stages,
        "reps": args.reps,
        "steps": args.steps,
        "threads": 1,
        "whole_step_ms": median["whole"],
        "splits": rows,
        "runs": {k: [{str(r): v for r, v in x.items()} for x in got] for k, got in runs.items()},
    }
    if args.quick:
        out = WORK / "stage_cost-quick.json"
        out.write_text(json.dumps(payload, indent=2) + "\n")
    else:
        out = write_evidence("stage_cost.json", payload)
    print(f"wrote {shown(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
