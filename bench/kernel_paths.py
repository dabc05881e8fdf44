"""Decode speed of each weight kernel path llama.cpp offers here, on gemma-3-270m Q4_K_M.

A bare llama_decode loop (bench.common.BareLoop) at 1 and 8 sequences for every path
(`repack`, `plain`, and `amx` when the library offers it), each repetition of each path
in a process of its own so that a crash (the AMX kernels segfault on some hosts) is
recorded as such instead of ending the run. Repetitions are interleaved across paths.
Writes evidence/kernel_paths.json.

    python -m bench.kernel_paths [--reps 3] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

CONCURRENCY = (1, 8)
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def measure(model: Path, kernels: str, steps: int) -> dict[str, Any]:
    """In this process: tok/s of the bare loop at each concurrency, and where the weights went."""
    from bench.bare_loop import BareLoop  # noqa: PLC0415 - loads llama.cpp only in the child
    from engine.backend import ContextConfig  # noqa: PLC0415

    config = ContextConfig(n_seq_max=8, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, kernels=kernels)
    loop = BareLoop(model, config)
    try:
        prompt = [int(t) for t in loop.model.tokenize(PROMPT, True)]
        rates = {c: loop.decode_rate([prompt] * c, steps)[0] for c in CONCURRENCY}
        return {
            "kernel_path": loop.model.kernel_path.value,
            "weight_buffers": loop.model.weight_buffers,
            "tok_s": {str(c): round(r, 2) for c, r in rates.items()},
        }
    finally:
        loop.close()


def run_child(model: Path, kernels: str, steps: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.kernel_paths", "--child", kernels, "--model", str(model), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-20:]
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        return {"crashed": how, "log_tail": tail}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    crashed = [r for r in runs if "crashed" in r]
    if crashed:
        return {"crashed": crashed[0]["crashed"], "log_tail": crashed[0]["log_tail"], "runs": len(runs)}
    ok = runs[0]
    return {
        "kernel_path": ok["kernel_path"],
        "weight_buffers_mib": {k: round(v / 2**20, 1) for k, v in ok["weight_buffers"].items()},
        "tok_s_median": {c: round(statistics.median(r["tok_s"][c] for r in runs), 2) for c in ok["tok_s"]},
        "tok_s_runs": {c: [r["tok_s"][c] for r in runs] for c in ok["tok_s"]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.steps)), flush=True)
        return 0

    from bench.common import bench_model, shown, write_evidence  # noqa: PLC0415
    from engine.kernels import choose_path, cpu_features  # noqa: PLC0415
    from engine.llama_handles import extra_buffer_types  # noqa: PLC0415

    model = bench_model(quick=False)
    offered = list(extra_buffer_types())
    paths = ["repack", "plain"] + (["amx"] if "AMX" in offered else [])
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    for rep in range(args.reps):
        for kernels in paths if rep % 2 == 0 else reversed(paths):
            result = run_child(model, kernels, args.steps)
            runs[kernels].append(result)
            print(f"rep {rep + 1}/{args.reps} {kernels}: {result.get('tok_s', result.get('crashed'))}", flush=True)
    summary = {p: summarise(r) for p, r in runs.items()}
    payload = {
        "cpu": cpu_features().summary(),
        "offered_extra_buffers": offered,
        "auto_chooses": choose_path("auto", offered).value,
        "model": model.name,
        "steps": args.steps,
        "reps": args.reps,
        "paths": summary,
    }
    path = write_evidence("kernel_paths.json", payload)
    for name, s in summary.items():
        print(f"{name:7s} {s.get('tok_s_median', s.get('crashed'))}")
    print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
