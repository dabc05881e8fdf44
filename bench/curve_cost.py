"""What CurveZMQ costs: throughput with keys on every link over plain links, in one run.

A single node and a 2-stage chain (layers split in two, one llama.cpp thread per stage),
each started twice from the same flags: plain, and requiring CURVE (keys on the client
link and, in the chain, on the link between the stages). 8 sessions at once generate
`--steps` tokens each over ZeroMQ on loopback (bench.node_driver: the node runs the token
loop). Repetitions interleave plain and CURVE (ABBA), and the ratio is the median of the
paired per-repetition ratios (CURVE over plain), so load drifting on a shared machine
affects both sides alike. Writes evidence/curve.json with {single_ratio, chain2_ratio, ...}.

    python -m bench.curve_cost [--reps 4] [--steps 48]
    python -m bench.curve_cost --quick        # the tiny test model: checks the script runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import trio

from bench.common import EVIDENCE, PROMPT_TEXTS, SHARDS, WORK, bench_model, paired_ratio, shown, table, write_evidence
from bench.node_driver import closed_loop
from bench.processes import SWEEP_SERVE, Processes, free_ports, node_ready, open_processes, serve_command
from bench.workload import Request
from neuron_tai.client import open_client
from neuron_tai.security import create_key_pair
from neuron_tai.shard import read_model_layers, stage_bounds
from neuron_tai.shard_cache import cached_stages

CONCURRENCY = 8
COLUMNS = ["system", "plain_tok_s", "curve_tok_s", "ratio"]

ClientKeys = tuple[str, str] | None  # (the node's public key, the client's key pair), or plain


class Keys:
    """One key pair per node role and one for the bench's client, in a fresh directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name in ("single", "head", "tail", "client"):
            for old in root.glob(f"{name}.key*"):
                old.unlink()
            create_key_pair(root, name)

    def public(self, name: str) -> str:
        return str(self.root / f"{name}.key")

    def pair(self, name: str) -> str:
        return str(self.root / f"{name}.key_secret")

    def serve(self, name: str, admits: str) -> list[str]:
        return ["--curve-secret", self.pair(name), "--allow", self.public(admits)]

    def client(self, server: str) -> ClientKeys:
        return self.public(server), self.pair("client")


def start(procs: Processes, name: str, model: Path, threads: int, extra: list[str]) -> str:
    address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    procs.start(name, serve_command(model, address, threads=threads, flags=[*SWEEP_SERVE, *extra]), node_ready)
    return address


async def throughput(address: str, client_keys: ClientKeys, steps: int, tag: str) -> float:
    """Tokens per second of CONCURRENCY sessions at once on one client connection."""
    server_key, key = client_keys or (None, None)
    async with open_client(address, timeout_s=300, server_key=server_key, key=key) as client:
        prompts = [await client.tokenize(PROMPT_TEXTS[i % len(PROMPT_TEXTS)]) for i in range(CONCURRENCY)]
        requests = [Request(i, tuple(p), steps + 1) for i, p in enumerate(prompts)]
        traces, wall = await closed_loop(client, requests, CONCURRENCY, tag)
    return sum(len(t.tokens) for t in traces) / wall


async def measure(
    systems: dict[str, dict[str, tuple[str, ClientKeys]]], reps: int, steps: int
) -> dict[str, dict[str, list[float]]]:
    runs: dict[str, dict[str, list[float]]] = {s: {"plain": [], "curve": []} for s in systems}
    for links in systems.values():  # warm both up once, unmeasured
        for kind, (address, keys) in links.items():
            await throughput(address, keys, min(steps, 8), f"warm-{kind}")
    for rep in range(reps):
        order = ["plain", "curve"] if rep % 2 == 0 else ["curve", "plain"]
        for system, links in systems.items():
            for kind in order:
                address, keys = links[kind]
                rate = await throughput(address, keys, steps, f"{kind}-{rep}")
                runs[system][kind].append(rate)
                print(f"rep {rep + 1}/{reps} {system:7s} {kind:5s} {rate:8.1f} tok/s", flush=True)
    return runs


def start_systems(
    procs: Processes, model: Path, shards: list[Path], keys: Keys
) -> dict[str, dict[str, tuple[str, ClientKeys]]]:
    """A single node and a 2-stage chain, each plain and with CURVE: {system: {kind: (address, client keys)}}."""
    single_plain = start(procs, "single-plain", model, 2, [])
    single_curve = start(procs, "single-curve", model, 2, keys.serve("single", "client"))
    tail_plain = start(procs, "tail-plain", shards[1], 1, [])
    head_plain = start(procs, "head-plain", shards[0], 1, ["--next", tail_plain])
    tail_curve = start(procs, "tail-curve", shards[1], 1, keys.serve("tail", "head"))
    chained = ["--next", tail_curve, "--next-key", keys.public("tail")]
    head_curve = start(procs, "head-curve", shards[0], 1, [*keys.serve("head", "client"), *chained])
    return {
        "single": {"plain": (single_plain, None), "curve": (single_curve, keys.client("single"))},
        "chain2": {"plain": (head_plain, None), "curve": (head_curve, keys.client("head"))},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--quick", action="store_true", help="the tiny test model; writes under .bench/, not evidence/")
    parser.add_argument("--out", type=Path, help="where to write the result (default: evidence/curve.json)")
    args = parser.parse_args()

    work = WORK / "curve"
    work.mkdir(parents=True, exist_ok=True)
    model = bench_model(args.quick, work)
    split = stage_bounds(read_model_layers(model).block_count, stages=2)  # gemma-3-270m: 0-9, 9-18
    if args.quick:
        args.reps, args.steps = min(args.reps, 2), min(args.steps, 8)
        out = args.out or work / "curve-quick.json"
    else:
        out = args.out or EVIDENCE / "curve.json"
    shards = cached_stages(model, split, SHARDS)
    keys = Keys(work / "keys")

    with open_processes(work / "logs") as procs:
        systems = start_systems(procs, model, shards, keys)
        runs = trio.run(measure, systems, args.reps, args.steps)
        stopped = {name: procs.stop(name) for name in list(procs.running)}

    rows = []
    for system, kinds in runs.items():
        rows.append({
            "system": system,
            "plain_tok_s": round(statistics.median(kinds["plain"]), 2),
            "curve_tok_s": round(statistics.median(kinds["curve"]), 2),
            "ratio": round(paired_ratio(kinds["curve"], kinds["plain"]), 3),
        })  # fmt: skip
    payload = {
        "model": model.name,
        "single_ratio": rows[0]["ratio"],
        "chain2_ratio": rows[1]["ratio"],
        "concurrency": CONCURRENCY,
        "steps": args.steps,
        "reps": args.reps,
        "chain2_layers": [list(s) for s in split],
        "serve_flags": SWEEP_SERVE,
        "tok_s_runs": {s: {k: [round(x, 2) for x in v] for k, v in kinds.items()} for s, kinds in runs.items()},
        "rows": rows,
        "node_exit_status": stopped,
    }
    path = write_evidence(out.name, payload, out.parent)
    print()
    print(table(rows, COLUMNS))
    print(f"wrote {shown(path)}")
    return 0 if all(code == 0 for code in stopped.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
