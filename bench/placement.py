"""Placement on unequal machines: the plan's split against the even and the weight-balanced split.

A 2-stage chain on this machine's two cores, the head on core 0, the tail on core 1 inside
a CPU cgroup with a quota of half a core (the slower machine). The plan is told the
speeds (1 and 0.5) and chooses from the costs measured here (neuron_tai/layer_costs.py);
the load client runs on core 1 outside the cgroup, in the half core the tail may not use.
Each split runs the same closed-loop, decode-heavy workload at concurrency 8 (server-side
`generate`), the splits interleaved over the repetitions, and the report gives each
split's tok/s, the ratio to the even split's, and the bound each split predicts.

    python -m bench placement [--model llama-3.2-1b] [--quick]
    python -m bench.placement --reps 2 --requests 16 --max-new 32

Needs root (it makes and removes the cgroup). `planned_bounds` is the plan's split for
other suites.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import trio

from bench.common import EVIDENCE, SHARDS, WORK, bench_model, interleaved, shown, write_evidence
from bench.latency import summarize
from bench.node_driver import closed_loop
from bench.processes import Processes, free_ports, node_ready, open_processes, serve_command
from bench.workload import CORPUS, make_requests
from neuron_tai.cli_plan import planned_split
from neuron_tai.client import open_client
from neuron_tai.layer_costs import Measure, cached_costs
from neuron_tai.placement import Host, Plan, Workload, evaluate, plan
from neuron_tai.shard import read_model_layers, stage_bounds, weight_balanced_bounds
from neuron_tai.shard_cache import cached_stages

HEAD_CORE, TAIL_CORE = 0, 1
TAIL_SHARE = 0.5  # the tail's CPU quota, in cores
PROMPT_TOKENS = 16
CGROUP_V1, CGROUP_V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")


def planned_bounds(
    model: Path,
    stages: int,
    speeds: Sequence[float] | None = None,
    workload: Workload | None = None,
    concurrency: int = 8,
) -> list[tuple[int, int]]:
    """The plan's split of `model` into `stages` (hosts of `speeds`, equal by default) serving
    `concurrency` sessions at once, from costs measured on this machine with one thread per stage
    (cached after the first call)."""
    hosts = [Host(s) for s in speeds] if speeds is not None else None
    return planned_split(model, stages, concurrency=concurrency, workload=workload, hosts=hosts).bounds


@contextlib.contextmanager
def cpu_quota(name: str, cores: float) -> Iterator[Path]:
    """A CPU cgroup capped at `cores` (cgroup v1 `cpu` or v2 `cpu.max`); its `cgroup.procs`. Removed on leaving.

    The period is 10 ms, not the kernel's 100 ms: a step of a few tens of ms then runs at the
    quota's pace instead of in bursts of a full core followed by a frozen stretch."""
    period = 10_000
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        group = CGROUP_V1 / name
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
    elif (CGROUP_V2 / "cgroup.controllers").exists():
        group = CGROUP_V2 / name
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{int(cores * period)} {period}")
    else:
        raise SystemExit("placement: no cgroup cpu controller here (needs root and cgroup v1 cpu or v2)")
    try:
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():  # none should be left: the bench stopped them
            with contextlib.suppress(OSError):
                (group.parent / "cgroup.procs").write_text(pid)
        group.rmdir()


def in_cgroup(procs_file: Path, core: int, cmd: list[str]) -> list[str]:
    """`cmd` pinned to `core`, moved into the cgroup before it starts."""
    return ["sh", "-c", f'echo $$ > {procs_file} && exec taskset -c {core} "$@"', "sh", *cmd]


async def drive(address: str, n: int, max_new: int, concurrency: int, tag: str) -> dict[str, Any]:
    async with open_client(address, timeout_s=600) as client:
        corpus = await client.tokenize(CORPUS, add_special=False)
        start = await client.tokenize("", add_special=True)
        requests = make_requests(
            corpus, n, max_new, seed=24, bos=start[0] if start else None, buckets=((PROMPT_TOKENS, PROMPT_TOKENS),)
        )
        await closed_loop(client, requests[:1], 1, f"{tag}-warm")
        traces, wall = await closed_loop(client, requests, concurrency, tag)
    return summarize(traces, wall)


def run_split(procs: Processes, shards: list[Path], cgroup: Path, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Start the chain (tail first), run the load on the head, stop it."""
    head_port, tail_port = free_ports(2)
    tail, head = f"tcp://127.0.0.1:{tail_port}", f"tcp://127.0.0.1:{head_port}"
    flags = ["--max-sessions", "8", "--kv-cells", "4096"]
    names = (f"{tag}-tail", f"{tag}-head")
    try:
        tail_cmd = in_cgroup(cgroup, TAIL_CORE, serve_command(shards[1], tail, threads=1, flags=flags))
        head_cmd = [
            "taskset",
            "-c",
            str(HEAD_CORE),
            *serve_command(shards[0], head, threads=1, flags=[*flags, "--next", tail]),
        ]
        for name, cmd in zip(names, (tail_cmd, head_cmd), strict=True):
            if not procs.start(name, cmd, node_ready):
                raise RuntimeError(f"{name} {procs.crashed[name].reason}:\n" + "\n".join(procs.crashed[name].log_tail))
        return trio.run(drive, head, args.requests, args.max_new, args.concurrency, tag)
    finally:
        for name in names:
            procs.stop(name)


def splits(
    model: Path, work: Workload, hosts: list[Host], concurrency: int
) -> tuple[dict[str, list[tuple[int, int]]], dict[str, Plan]]:
    costs = cached_costs(model, Measure.for_chain(concurrency, len(hosts)))
    n = read_model_layers(model).block_count
    bounds = {
        "plan": plan(costs, hosts, work).bounds,
        "even": stage_bounds(n, stages=2),
        "weights": weight_balanced_bounds(model, 2),
    }
    return bounds, {name: evaluate(costs, hosts, work, b) for name, b in bounds.items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model = bench_model(args.quick)
    work = Workload(PROMPT_TOKENS, args.max_new, 4096)
    hosts = [Host(1.0), Host(TAIL_SHARE)]
    bounds, predicted = splits(model, work, hosts, args.concurrency)
    for name, b in bounds.items():
        print(f"{name:8} {b}  predicted bound {predicted[name].efficiency_bound:.3f}", flush=True)
    shards = {name: cached_stages(model, b, SHARDS) for name, b in bounds.items()}
    # The load client runs beside the tail, outside its cgroup (the half core the tail may not
    # use): on another machine, as it would be, rather than on the head's core.
    os.sched_setaffinity(0, {TAIL_CORE})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in bounds}
    with cpu_quota("neuron-tai-placement", TAIL_SHARE) as cgroup, open_processes(WORK / "placement" / "logs") as procs:
        for rep, name in interleaved(args.reps, list(bounds)):
            runs[name].append(run_split(procs, shards[name], cgroup, args, f"{name}-r{rep}"))
            print(f"rep {rep + 1}/{args.reps} {name:8} {runs[name][-1]['tok_s']} tok/s", flush=True)
    tok_s = {name: statistics.median(r["tok_s"] for r in got) for name, got in runs.items()}
    rows = [
        {
            "split": name,
            "bounds": [list(x) for x in bounds[name]],
            "tok_s": tok_s[name],
            "vs_even": round(tok_s[name] / tok_s["even"], 3),
            "predicted_bound": round(predicted[name].efficiency_bound, 3),
            "predicted_tok_s": round(args.max_new / predicted[name].slowest_seconds, 2),
            "predicted_load": [round(s.load, 3) for s in predicted[name].stages],
        }
        for name in bounds
    ]
    for row in rows:
        print(f"{row['split']:8} {row['bounds']}  {row['tok_s']} tok/s  x{row['vs_even']} of even", flush=True)
    return {
        "model": model.name,
        "setup": f"2-stage chain; head on core {HEAD_CORE}; tail on core {TAIL_CORE} with a CPU quota of "
        f"{TAIL_SHARE} core (cgroup, 10 ms period); load client on core {TAIL_CORE} outside the cgroup; "
        f"1 thread each; plan told speeds 1 and {TAIL_SHARE}",
        "workload": {"prompt_tokens": PROMPT_TOKENS, "max_new": args.max_new, "requests": args.requests},
        "concurrency": args.concurrency,
        "reps": args.reps,
        "splits": rows,
        "runs": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny test model, few requests: checks it runs")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, help="the evidence file (default: evidence/placement.json)")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.requests, args.max_new = 1, 8, 8
    payload = measure(args)
    if args.out is not None:  # named as given (`python -m bench` names it after the model already)
        args.out.resolve().parent.mkdir(parents=True, exist_ok=True)
        out = write_evidence(args.out.name, payload, WORK / "placement").replace(args.out.resolve())
    else:
        out = write_evidence("placement.json", payload, WORK if args.quick else EVIDENCE)
    print(f"wrote {shown(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
