"""Node sweep on gemma-3-270m Q4_K_M through ZeroMQ on loopback.

A single node and a 2-stage chain (layers 0-8 and 9-17; one llama.cpp thread per
stage so the two processes share the 2 cores without oversubscribing them) at
concurrency 1/2/4/8, each against the engine driven in process with the same
workload in the same run (interleaved; ratio = median of paired ratios).
Writes evidence/node_sweep.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "20000")  # what `neuron-tai serve` uses: the same for the engine here

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import WORK, best_of, gemma_path, paired_ratio, prompt_tokens, table, write_evidence
from bench.engine_sweep import run_sessions
from bench.processes import free_ports
from engine.engine import EngineConfig, open_engine
from neuron_tai.client import Client, open_client
from neuron_tai.shard import write_stages

COLUMNS = ["setup", "concurrency", "agg_tok_s", "engine_tok_s", "ratio"]
SERVE = ["--max-sessions", "8", "--kv-cells", "4096", "--n-batch", "512", "--max-prefill", "64", "--log-level",
         "warning"]  # fmt: skip


def start_node(model: Path, threads: int, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    cmd = [sys.executable, "-m", "neuron_tai.cli", "serve", str(model), "--bind", address, "--threads", str(threads),
           *SERVE, *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"node did not start: {cmd}")
    return proc, address


async def client_session(client: Client, name: str, ids: list[int], steps: int) -> int:
    await client.open(name, len(ids) + steps + 1)
    r = await client.step(name, 0, tokens=ids)
    for i in range(steps):
        assert r.token is not None
        r = await client.step(name, len(ids) + i, tokens=[r.token])
    await client.close(name)
    return steps + 1


async def over_zmq(address: str, prompts: list[list[int]], steps: int) -> float:
    async with open_client(address, timeout_s=120) as client:
        counts: list[int] = []

        async def one(i: int) -> None:
            counts.append(await client_session(client, f"s{i}", prompts[i], steps))

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return sum(counts) / (time.perf_counter() - start)


async def sweep(args: argparse.Namespace, model: Path, addresses: dict[str, str]) -> list[dict[str, Any]]:
    cfg = EngineConfig(model=model, max_sessions=8, kv_cells=4096, n_batch=512, n_threads=2, max_prefill_tokens=64)
    results = []
    async with open_engine(cfg) as engine:
        for concurrency in (1, 2, 4, 8):
            prompts = prompt_tokens(engine.backend, concurrency)
            runs: dict[str, list[float]] = {"engine": [], **{k: [] for k in addresses}}
            for rep in range(args.reps):
                order = ["engine", *addresses] if rep % 2 == 0 else [*addresses, "engine"]
                for setup in order:
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
    model = gemma_path()
    shards = write_stages(model, WORK / "shards" / "chain2", [(0, 9), (9, 18)])
    procs: list[subprocess.Popen[str]] = []
    try:
        single, single_addr = start_node(model, 2, [])
        procs.append(single)
        tail, tail_addr = start_node(shards[1], 1, [])
        procs.append(tail)
        head, head_addr = start_node(shards[0], 1, ["--next", tail_addr])
        procs.append(head)
        results = trio.run(sweep, args, model, {"single": single_addr, "chain2": head_addr})
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    path = write_evidence(
        "node_sweep.json",
        {"model": model.name, "steps": args.steps, "reps": args.reps, "chain2_layers": [[0, 9], [9, 18]],
         "results": results},
    )  # fmt: skip
    print()
    print(table(results, COLUMNS))
    print("->", path)
    single8 = next(r for r in results if r["setup"] == "single" and r["concurrency"] == 8)
    return 0 if single8["ratio"] >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
