"""Which decode-batch padding makes each weight kernel path batch-invariant, on gemma-3-270m Q4_K_M.

For every kernel path llama.cpp offers here and every padding multiple tried, an engine in
batch-invariant mode runs 8 prompts alone, then all 8 with staggered starts (so decode
batches of every size from 1 to 8 occur), teacher-free greedy, logits compared bit for
bit with the solo runs. The smallest padding with no mismatch is what the engine picks
for that path (engine/kernels.py INVARIANT_PAD_ROWS). Writes evidence/invariance_padding.json.

    python -m bench.invariance_padding [--steps 24] [--pads 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

import trio

from bench.common import bench_model, prompt_tokens, shown, write_evidence
from bench.engine_sweep import run_sessions
from engine.config import EngineConfig
from engine.engine import open_engine
from engine.llama_handles import extra_buffer_types


async def check(cfg: EngineConfig, steps: int) -> dict[str, Any]:
    async with open_engine(cfg) as engine:
        prompts = prompt_tokens(engine.backend, 8)
        solo = []
        for p in prompts:
            _, _, _, digests = await run_sessions(engine, [p], steps, logits=True)
            solo.append(digests[0])
        delays = [0.02 * i * i for i in range(8)]  # arrivals spread out: every batch size from 1 to 8
        _, _, _, together = await run_sessions(engine, prompts, steps, logits=True, delays=delays)
        first = [
            next((k for k, (a, b) in enumerate(zip(s, t, strict=True)) if a != b), None)
            for s, t in zip(solo, together, strict=True)
        ]
        path = engine.stats()["kernel_path"]
    return {"kernel_path": path, "mismatched_sessions": sum(f is not None for f in first), "first_mismatch": first}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--pads", default="1,2,4,8,16")
    args = parser.parse_args()
    pads = [int(x) for x in args.pads.split(",")]
    paths = ["repack", "plain"] + (["amx"] if "AMX" in extra_buffer_types() else [])
    model = bench_model(quick=False)
    base = EngineConfig(model=model, max_sessions=8, kv_cells=4096, n_threads=2, batch_invariant=True)
    results: dict[str, dict[str, Any]] = {}
    for kernels in paths:
        results[kernels] = {}
        for pad in pads:
            r = trio.run(check, replace(base, kernels=kernels, pad_rows=pad), args.steps)
            results[kernels][str(pad)] = r
            print(
                f"{kernels:7s} pad {pad:2d}: {r['mismatched_sessions']} of 8 sessions differ {r['first_mismatch']}",
                flush=True,
            )
    smallest = {
        k: next((int(p) for p, r in v.items() if r["mismatched_sessions"] == 0), None) for k, v in results.items()
    }
    path = write_evidence(
        "invariance_padding.json", {"steps": args.steps, "smallest_exact_pad": smallest, "results": results}
    )
    print("smallest exact padding per path:", smallest, f"\nwrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
