"""Speculative generate (prompt lookup) against `speculate: 0`, on a single node and a 2-stage chain.

gemma-3-270m Q4_K_M (a real model: it copies what it is shown; the random-weight shapes
would not), single node (2 llama.cpp threads) and a 2-stage chain (halves of the layers,
one thread each), concurrency 1, 4 and 8, two workloads:

- copy-heavy: each session is shown a source file of this repository and asked for it
  again, its first lines already given (what "edit or continue a given file" prompts
  look like: the answer is mostly in the prompt); greedy.
- non-repetitive: short open questions, sampled (temperature 0.8, top-p 0.95, a seed per
  session): little of the answer is anywhere in the history.

Both arms run on the same nodes in the same run, one after the other at each point: the
request's `speculate` is K or 0. Reported: aggregate generated tok/s, inter-token p50
(a message of k tokens after a gap counts k gaps of gap/k), accepted draft tokens per
pass, passes per generated token, and the tokens that differ from the `speculate: 0`
arm. Nodes in batch-invariant mode (`--batch-invariant --flash-attn on`) then run both
workloads at c = 4 with both arms, where any differing token is a mismatch (DESIGN.md:
exact there). Writes evidence/speculation.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from bench.common import EVIDENCE, PROMPT_TEXTS, ROOT, SHARDS, WORK, gemma_path, shown, table, write_evidence
from bench.processes import SWEEP_SERVE, free_ports, node_ready, open_processes, serve_command
from neuron_tai.client import Client, Done, Generated, open_client
from neuron_tai.shard import read_model_layers, stage_bounds
from neuron_tai.shard_cache import cached_stages
from protocol.sampling import Sampling

COLUMNS = [
    "setup", "workload", "c", "speculate", "tok_s", "ratio", "itl_p50_ms", "accepted_per_pass",
    "passes_per_token", "differing_tokens",
]  # fmt: skip
COPY_SOURCES = [
    "neuron_tai/generation.py", "engine/replies.py", "neuron_tai/text_stream.py", "neuron_tai/leases.py",
    "engine/pacing.py", "neuron_tai/stop_text.py", "engine/session_ends.py", "neuron_tai/replica_book.py",
]  # fmt: skip
SAMPLED = Sampling(temperature=0.8, top_p=0.95)
INVARIANT_FLAGS = ["--batch-invariant", "--flash-attn", "on"]


def copy_prompt(path: str, chars: int) -> str:
    """A source file, then the request to write it out again with its first lines given."""
    text = (ROOT / path).read_text()[:chars]
    head = "\n".join(text.splitlines()[:3])
    return f"Here is the file {path}:\n```python\n{text}\n```\nThe same file, unchanged:\n```python\n{head}\n"


@dataclass(slots=True)
class Arm:
    """One arm's sessions at one point: their tokens, passes and inter-token gaps."""

    tokens: list[list[int]] = field(default_factory=list)
    passes: int = 0
    gaps_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


async def one_session(
    client: Client, name: str, ids: list[int], max_new: int, speculate: int, sampling: Sampling, arm: Arm, slot: int
) -> None:
    await client.open(name, len(ids) + max_new + 40, sampling=sampling, wait_ms=120_000)
    tokens: list[int] = []
    last = None
    done: Done | None = None
    async for reply in client.generate_tokens(name, 0, ids, max_new, ignore_eog=True, speculate=speculate):
        now = time.perf_counter()
        if isinstance(reply, Generated):
            if last is not None:
                arm.gaps_ms += [(now - last) * 1000 / len(reply.tokens)] * len(reply.tokens)
            last = now
            tokens += reply.tokens
        else:
            done = reply
    await client.close(name)
    assert done is not None and done.generated == len(tokens)
    arm.tokens[slot] = tokens
    arm.passes += done.passes if done.passes is not None else done.generated


async def run_arm(
    address: str, prompts: list[list[int]], args: argparse.Namespace, speculate: int, sampled: bool
) -> Arm:
    """Every prompt generates at once, each in its own session."""
    arm = Arm(tokens=[[] for _ in prompts])
    async with open_client(address, timeout_s=300) as client:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i, ids in enumerate(prompts):
                sampling = (
                    Sampling(SAMPLED.temperature, SAMPLED.top_k, SAMPLED.top_p, seed=i) if sampled else Sampling()
                )
                nursery.start_soon(one_session, client, f"s{i}", ids, args.max_new, speculate, sampling, arm, i)
        arm.wall_s = time.perf_counter() - start
    return arm


def differing(a: Arm, b: Arm) -> int:
    """Tokens of `b` that differ from `a`'s at the same place (a longer or shorter run counts its excess)."""
    count = 0
    for x, y in zip(a.tokens, b.tokens, strict=True):
        count += sum(1 for p, q in zip(x, y, strict=False) if p != q) + abs(len(x) - len(y))
    return count


def row(setup: str, workload: str, c: int, speculate: int, arm: Arm, base: Arm) -> dict[str, Any]:
    tok_s = arm.generated / arm.wall_s
    return {
        "setup": setup,
        "workload": workload,
        "c": c,
        "speculate": speculate,
        "tok_s": round(tok_s, 2),
        "ratio": round(tok_s / (base.generated / base.wall_s), 3),
        "itl_p50_ms": round(statistics.median(arm.gaps_ms), 2) if arm.gaps_ms else None,
        "accepted_per_pass": round((arm.generated - arm.passes) / arm.passes, 3),
        "passes_per_token": round(arm.passes / arm.generated, 3),
        "differing_tokens": differing(base, arm),
    }


async def measure(
    address: str, setup: str, prompts: dict[str, list[list[int]]], args: argparse.Namespace, levels: list[int]
) -> list[dict[str, Any]]:
    """Both workloads at each concurrency, `speculate: 0` then K, on one setup's nodes, after a
    warm-up (fresh nodes fault their weights in: the first arm measured would pay for it)."""
    await run_arm(address, [prompts["copy-heavy"][0]], args, args.speculate, False)
    rows = []
    for workload, pool in prompts.items():
        for c in levels:
            chosen = [pool[i % len(pool)] for i in range(c)]
            base = await run_arm(address, chosen, args, 0, workload == "non-repetitive")
            spec = await run_arm(address, chosen, args, args.speculate, workload == "non-repetitive")
            rows += [row(setup, workload, c, 0, base, base), row(setup, workload, c, args.speculate, spec, base)]
            print(table(rows[-2:], COLUMNS).splitlines()[-1], flush=True)
    return rows


def start_setups(procs: Any, model: Path, shards: list[Path], invariant: bool, speculate_flag: str) -> dict[str, str]:
    """A single node and a 2-stage chain; their client-facing addresses by setup name."""
    # A copy-heavy prompt (1600 characters of source) is longer than one step's default 512 tokens.
    flags = [*SWEEP_SERVE, "--max-step-tokens", "2048", "--speculate", speculate_flag]
    flags += INVARIANT_FLAGS if invariant else []
    ports = iter(free_ports(3))
    tag = "-invariant" if invariant else ""
    single, head, tail = (f"tcp://127.0.0.1:{next(ports)}" for _ in range(3))
    nodes = [
        (f"spec-single{tag}", serve_command(model, single, threads=2, flags=flags)),
        (f"spec-tail{tag}", serve_command(shards[1], tail, threads=1, flags=flags)),
        (f"spec-head{tag}", serve_command(shards[0], head, threads=1, flags=[*flags, "--next", tail])),
    ]
    for name, cmd in nodes:
        if not procs.start(name, cmd, node_ready):
            raise SystemExit(f"{name} crashed: {procs.crashed[name].reason}; see {procs.crashed[name].log}")
    return {"single": single, "chain2": head}


async def tokenize_all(address: str, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    async with open_client(address, timeout_s=60) as client:
        copy = [await client.tokenize(copy_prompt(p, args.copy_chars)) for p in COPY_SOURCES]
        other = [await client.tokenize(t) for t in PROMPT_TEXTS]
    return {"copy-heavy": copy, "non-repetitive": other}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="48 new tokens, 900-character files")
    parser.add_argument("--speculate", type=int, default=6, help="draft tokens per pass in the speculating arm")
    parser.add_argument("--out", type=Path, default=EVIDENCE / "speculation.json")
    parser.add_argument("--model", type=Path, help="another GGUF file (default: gemma-3-270m, which copies)")
    parser.add_argument("--levels", default="1,4,8", help="concurrencies")
    parser.add_argument("--copy-chars", type=int, help="characters of each file shown (default 900, quick; 1600)")
    args = parser.parse_args()
    args.max_new, chars = (48, 900) if args.quick else (128, 1600)
    args.copy_chars = args.copy_chars or chars
    model = args.model or gemma_path()
    halves = stage_bounds(read_model_layers(model).block_count, stages=2)
    shards = cached_stages(model, halves, SHARDS)
    rows: list[dict[str, Any]] = []
    with open_processes(WORK / "logs") as procs:
        addresses = start_setups(procs, model, shards, invariant=False, speculate_flag="0")
        prompts = trio.run(tokenize_all, addresses["single"], args)
        for setup, address in addresses.items():
            rows += trio.run(measure, address, setup, prompts, args, [int(c) for c in args.levels.split(",")])
        procs.stop_all()
        invariant = start_setups(procs, model, shards, invariant=True, speculate_flag=str(args.speculate))
        checks: list[dict[str, Any]] = []
        for setup, address in invariant.items():
            checks += trio.run(measure, address, f"{setup}-invariant", prompts, args, [4])
    mismatches = sum(r["differing_tokens"] for r in checks)
    payload = {
        "model": model.name,
        "chain2_layers": [list(h) for h in halves],
        "max_new": args.max_new,
        "speculate": args.speculate,
        "results": rows,
        "invariant_checks": checks,
        "invariant_mismatches": mismatches,
    }
    path = write_evidence(args.out.name, payload, args.out.parent)
    print()
    print(table(rows + checks, COLUMNS))
    print(f"greedy and seeded mismatches in batch-invariant mode: {mismatches}")
    print("->", shown(path))
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
