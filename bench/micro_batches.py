"""Micro-batches on gemma-3-270m Q4_K_M through ZeroMQ on loopback: what they cost, what they gain.

A single node (2 llama.cpp threads) and a 2-stage chain (layers 0-8 and 9-17, one thread
per stage), each with `--micro-batches 1` and `2` (every setup its own processes), at
concurrency 8; interleaved reps, each setup's ratio to micro-batches 1 = median of the
paired ratios. A single node has nothing to overlap, so 2 there measures the split's cost
(two smaller llama_decode calls per iteration); in the chain, 2 lets one group compute in
a stage while the other computes in the next. Writes evidence/micro_batches.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import trio

from bench.common import (
    PROMPT_TEXTS,
    WORK,
    bench_model,
    best_of,
    interleaved,
    paired_ratio,
    shown,
    table,
    write_evidence,
)
from bench.node_sweep import node_command, over_zmq
from bench.processes import free_ports, node_ready, open_processes
from neuron_tai.client import open_client
from neuron_tai.shard import read_model_layers, stage_bounds, write_stages

COLUMNS = ["setup", "micro_batches", "concurrency", "agg_tok_s", "ratio_to_1"]
SETUPS = [("single", 1), ("single", 2), ("chain2", 1), ("chain2", 2)]


async def measure(args: argparse.Namespace, addresses: dict[tuple[str, int], str]) -> list[dict[str, Any]]:
    async with open_client(next(iter(addresses.values()))) as client:
        prompts = [await client.tokenize(PROMPT_TEXTS[i % len(PROMPT_TEXTS)]) for i in range(args.concurrency)]
    runs: dict[tuple[str, int], list[float]] = {setup: [] for setup in SETUPS}
    for _rep, setup in interleaved(args.reps, SETUPS):
        runs[setup].append(await over_zmq(addresses[setup], prompts, args.steps))
        print(f"{setup[0]} micro-batches {setup[1]}: {runs[setup][-1]:.2f} tok/s", flush=True)
    return [
        {
            "setup": name,
            "micro_batches": n,
            "concurrency": args.concurrency,
            "agg_tok_s": round(best_of(runs[(name, n)]), 2),
            "ratio_to_1": round(paired_ratio(runs[(name, n)], runs[(name, 1)]), 3),
            "runs": [round(x, 2) for x in runs[(name, n)]],
        }
        for name, n in SETUPS
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    model = bench_model(quick=False)
    halves = stage_bounds(read_model_layers(model).block_count, stages=2)  # gemma-3-270m: 0-9, 9-18
    shards = write_stages(model, WORK / "shards" / "chain2", halves)
    ports = iter(free_ports(6))
    addresses: dict[tuple[str, int], str] = {}
    with open_processes(WORK / "logs") as procs:
        for name, n in SETUPS:
            mb = ["--micro-batches", str(n)]
            address = addresses[(name, n)] = f"tcp://127.0.0.1:{next(ports)}"
            nodes: list[tuple[str, Path, str, int, list[str]]]
            if name == "single":
                nodes = [(f"mb-single-{n}", model, address, 2, mb)]
            else:
                tail = f"tcp://127.0.0.1:{next(ports)}"
                nodes = [
                    (f"mb-chain2-{n}-tail", shards[1], tail, 1, []),
                    (f"mb-chain2-{n}-head", shards[0], address, 1, ["--next", tail, *mb]),
                ]
            for proc, stage, bind, threads, extra in nodes:
                if not procs.start(proc, node_command(stage, bind, threads, extra), node_ready):
                    raise SystemExit(f"{proc} crashed: {procs.crashed[proc].reason}; see {procs.crashed[proc].log}")
        results = trio.run(measure, args, addresses)
    path = write_evidence(
        "micro_batches.json",
        {"model": model.name, "steps": args.steps, "reps": args.reps, "chain2_layers": [list(h) for h in halves],
         "results": results},
    )  # fmt: skip
    print()
    print(table(results, COLUMNS))
    print("->", shown(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
