"""Node sweep on gemma-3-270m Q4_K_M through ZeroMQ on loopback.

A single node and a 2-stage chain (layers 0-8 and 9-17; one llama.cpp thread per
stage so the two processes share the 2 cores without oversubscribing them) at
concurrency 1/2/4/8, each against the engine driven in process with the same
workload in the same run (interleaved; ratio = median of paired ratios).
Writes evidence/node_sweep.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import trio

from bench.common import (
    WORK,
    bench_model,
    best_of,
    interleaved,
    paired_ratio,
    prompt_tokens,
    shown,
    table,
    write_evidence,
)
from bench.engine_sweep import run_sessions
from bench.node_driver import closed_loop
from bench.processes import SWEEP_SERVE, free_ports, node_ready, open_processes, serve_command
from bench.workload import Request
from engine.config import EngineConfig
from engine.engine import open_engine
from neuron_tai.client import open_client
from neuron_tai.shard import read_model_layers, stage_bounds, write_stages

COLUMNS = ["setup", "concurrency", "agg_tok_s", "engine_tok_s", "ratio"]


def node_command(model: Path, address: str, threads: int, extra: list[str]) -> list[str]:
    return serve_command(model, address, threads=threads, flags=[*SWEEP_SERVE, *extra])


async def over_zmq(address: str, prompts: list[list[int]], steps: int) -> float:
    """All sessions at once through the node client; generated tokens per second."""
    requests = [Request(i, tuple(p), steps + 1) for i, p in enumerate(prompts)]
    async with open_client(address, timeout_s=120) as client:
        traces, wall = await closed_loop(client, requests, len(requests), "s")
    return sum(len(t.tokens) for t in traces) / wall


async def sweep(args: argparse.Namespace, model: Path, addresses: dict[str, str]) -> list[dict[str, Any]]:
    cfg = EngineConfig(model=model, max_sessions=8, kv_cells=4096, n_batch=512, n_threads=2, max_prefill_tokens=64)
    results = []
    async with open_engine(cfg) as engine:
        for concurrency in (1, 2, 4, 8):
            prompts = prompt_tokens(engine.backend, concurrency)
            runs: dict[str, list[float]] = {"engine": [], **{k: [] for k in addresses}}
            for _rep, setup in interleaved(args.reps, ["engine", *addresses]):
                if setup == "engine":
                    runs["engine"].append((await run_sessions(engine, prompts, args.steps))[0])
                else:
                    runs[setup].append(await over_zmq(addresses[setup], prompts, args.steps))
            for setup in addresses:
                row = {
                    "setup": setup,
                    "concurrency": concurrency,
                    "agg_tok_s": round(best_of(runs[setup]), 2),
                    "engine_tok_s": round(best_of(runs["engine"]), 2),
                    "ratio": round(paired_ratio(runs[setup], runs["engine"]), 3),
                    "runs": [round(x, 2) for x in runs[setup]],
                    "engine_runs": [round(x, 2) for x in runs["engine"]],
                }
                results.append(row)
                print(table([row], COLUMNS), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    model = bench_model(quick=False)
    halves = stage_bounds(read_model_layers(model).block_count, stages=2)  # gemma-3-270m: 0-9, 9-18
    shards = write_stages(model, WORK / "shards" / "chain2", halves)
    single, tail, head = (f"tcp://127.0.0.1:{port}" for port in free_ports(3))
    nodes = [
        ("sweep-single", model, single, 2, []),
        ("sweep-chain2-tail", shards[1], tail, 1, []),
        ("sweep-chain2-head", shards[0], head, 1, ["--next", tail]),
    ]
    with open_processes(WORK / "logs") as procs:
        for name, stage, address, threads, extra in nodes:
            if not procs.start(name, node_command(stage, address, threads, extra), node_ready):
                raise SystemExit(f"{name} crashed: {procs.crashed[name].reason}; see {procs.crashed[name].log}")
        results = trio.run(sweep, args, model, {"single": single, "chain2": head})
    path = write_evidence(
        "node_sweep.json",
        {"model": model.name, "steps": args.steps, "reps": args.reps, "chain2_layers": [list(h) for h in halves],
         "results": results},
    )  # fmt: skip
    print()
    print(table(results, COLUMNS))
    print("->", shown(path))
    single8 = next(r for r in results if r["setup"] == "single" and r["concurrency"] == 8)
    return 0 if single8["ratio"] >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
