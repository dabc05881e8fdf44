"""Backend sweep on gemma-3-270m Q4_K_M.

Aggregate decode tok/s of the stage backend at 1/2/4/8 sequences against a bare
Python loop over llama_decode in the same run (interleaved repetitions in
alternating order; tok/s best of each, ratio the median of paired ratios), and
whether 2- and 3-stage splits reproduce the whole model's greedy tokens.
Writes evidence/backend_sweep.json and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    WORK,
    BareLoop,
    bench_model,
    best_of,
    interleaved,
    paired_ratio,
    prompt_tokens,
    shown,
    table,
    write_evidence,
)
from engine.backend import ContextConfig, Segment, StageBackend
from engine.messages import Output
from neuron_tai.shard import read_model_layers, stage_bounds, write_stages
from testkit.local_chain import LocalChain

COLUMNS = ["concurrency", "backend_tok_s", "bare_tok_s", "ratio", "outside_decode_share", "tokens_equal_bare"]
CONFIG = ContextConfig(n_seq_max=8, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=2)


def backend_decode_rate(
    backend: StageBackend, prompts: list[list[int]], steps: int
) -> tuple[float, float, list[list[int]]]:
    """tok/s, the fraction of step time spent outside llama_decode, and the tokens."""
    seqs = [backend.open_sequence() for _ in prompts]
    try:
        first = backend.decode(
            [
                Segment(s, 0, tokens=np.array(p, np.int32), output=Output.TOKEN)
                for s, p in zip(seqs, prompts, strict=True)
            ]
        )
        tokens = [[r.token] for r in first]
        inside = backend.decode_seconds
        start = time.perf_counter()
        for _ in range(steps):
            segs = [
                Segment(s, backend.length(s), tokens=np.array([t[-1]], np.int32), output=Output.TOKEN)
                for s, t in zip(seqs, tokens, strict=True)
            ]
            for t, r in zip(tokens, backend.decode(segs), strict=True):
                t.append(r.token)
        elapsed = time.perf_counter() - start
        inside = backend.decode_seconds - inside
    finally:
        for s in seqs:
            backend.close_sequence(s)
    outside = (elapsed - inside) / elapsed
    return len(prompts) * steps / elapsed, outside, [[int(x) for x in t if x is not None] for t in tokens]


def split_exactness(model: Path, prompts: list[list[int]], steps: int) -> dict[str, bool]:
    def run(paths: list[Path]) -> tuple[list[list[int]], list[np.ndarray]]:
        stages = [StageBackend(p, CONFIG) for p in paths]
        try:
            trace = LocalChain(stages).greedy({str(i): p for i, p in enumerate(prompts)}, steps=steps - 1)
        finally:
            for s in stages:
                s.close()
        names = sorted(trace, key=int)
        return [[int(np.argmax(row)) for row in trace[n]] for n in names], [row for n in names for row in trace[n]]

    whole_tokens, whole_logits = run([model])
    result: dict[str, bool] = {}
    n = read_model_layers(model).block_count  # gemma-3-270m: 0-6 6-18, and 0-6 6-12 12-18
    for label, bounds in (("2stage", stage_bounds(n, split=[n // 3])), ("3stage", stage_bounds(n, stages=3))):
        shards = write_stages(model, WORK / "shards" / label, bounds)
        tokens, logits = run(shards)
        result[f"exact_{label}"] = tokens == whole_tokens
        result[f"logits_bit_identical_{label}"] = all(
            np.array_equal(a, b) for a, b in zip(whole_logits, logits, strict=True)
        )
    return result


def sweep_point(backend: StageBackend, bare: BareLoop, concurrency: int, reps: int, steps: int) -> dict[str, Any]:
    """The backend against the bare loop at one concurrency, interleaved `reps` times."""
    prompts = prompt_tokens(backend, concurrency)
    bare_runs, backend_runs, outside, same_tokens = [], [], [], True
    for rep, side in interleaved(reps, ("bare", "backend")):
        if side == "bare":
            rate, bare_tokens = bare.decode_rate(prompts, steps)
            bare_runs.append(rate)
        else:
            rate, share, our_tokens = backend_decode_rate(backend, prompts, steps)
            backend_runs.append(rate)
            outside.append(share)
        if side == ("backend", "bare")[rep % 2]:  # the repetition's second side: both sides' tokens are in
            same_tokens &= bare_tokens == our_tokens
    return {
        "concurrency": concurrency,
        "backend_tok_s": round(best_of(backend_runs), 2),
        "bare_tok_s": round(best_of(bare_runs), 2),
        # Median of paired ratios: adjacent runs share the machine's momentary load.
        "ratio": round(paired_ratio(backend_runs, bare_runs), 3),
        "backend_runs": [round(r, 2) for r in backend_runs],
        "bare_runs": [round(r, 2) for r in bare_runs],
        "tokens_equal_bare": same_tokens,
        # Share of the backend's step time spent outside llama_decode (Python, sampling, copies);
        # the bare loop pays for the same sampling.
        "outside_decode_share": round(float(np.median(outside)), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (best of each is kept)")
    args = parser.parse_args()

    model = bench_model(quick=False)
    backend = StageBackend(model, CONFIG)
    bare = BareLoop(model, CONFIG)
    results = []
    for concurrency in (1, 2, 4, 8):
        results.append(sweep_point(backend, bare, concurrency, args.reps, args.steps))
        print(table([results[-1]], COLUMNS), flush=True)
    bare.close()
    backend.close()

    exact = split_exactness(model, prompt_tokens(StageBackend(model, CONFIG), 8), steps=64)
    path = write_evidence(
        "backend_sweep.json",
        {
            "model": model.name,
            "config": {k: getattr(CONFIG, k) for k in CONFIG.__dataclass_fields__},
            "steps": args.steps,
            "reps": args.reps,
            "results": results,
            "exactness": "8 prompts x 64 greedy tokens, whole model vs splits at layers 6 and 6,12",
            **exact,
        },
    )
    print()
    print(table(results, COLUMNS))
    print(f"exact_2stage={exact['exact_2stage']} exact_3stage={exact['exact_3stage']}  -> {shown(path)}")
    ok = all(r["ratio"] >= 0.95 for r in results) and exact["exact_2stage"] and exact["exact_3stage"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
