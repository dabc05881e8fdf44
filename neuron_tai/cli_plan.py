"""`neuron-tai plan`: where each layer range should run, and the `serve` lines that run it there.

The costs are measured on this machine (neuron_tai/layer_costs.py, cached) or read from a
JSON file; the split is the placement program's (neuron_tai/placement.py). A host is
`SPEED[:MEMORY][@ADDRESS]`: only the ratios of the speeds matter, so the numbers that
`neuron-tai plan MODEL --measure` prints on each machine can be given as they are.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_tai.cli_errors import UsageError
from neuron_tai.cli_options import build, options_of
from neuron_tai.config import CHAIN_MICRO_BATCHES
from neuron_tai.layer_costs import Measure, cached_costs, chain_micro_batches, chain_rows, load_costs
from neuron_tai.placement import Host, ModelCosts, Plan, Workload, plan
from transport.address import AddressError, check_address

__all__ = ["PlanOptions", "parse_host", "parse_workload", "planned_split", "run_plan", "serve_lines"]

_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    model: Path = field(metadata={"help": "the GGUF model to split", "group": "start"})
    stages: int | None = field(
        default=None,
        metadata={"help": "how many stages", "group": "start", "min": 1, "metavar": "N", "shown": "one per --host"},
    )
    hosts: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "a machine of the chain, in chain order: its speed (relative; e.g. what --measure printed "
            "there), optionally the memory a stage may use there and its address; repeat it for each machine",
            "group": "start",
            "kind": "names",
            "repeat": True,
            "flag": "host",
            "metavar": "SPEED[:MEM][@ADDR]",
            "shown": "--stages equal machines, no memory limit",
        },
    )
    workload: str = field(
        default="16:128",
        metadata={"help": "prompt and generated tokens per request the split is for", "metavar": "PREFILL:DECODE"},
    )
    concurrency: int = field(
        default=8,
        metadata={
            "help": "sessions the chain serves at once: each stage's decode calls then carry 1/N of them "
            "(a chain of N stages runs N micro-batches; all of them with one stage), and the costs are measured "
            "at that many rows, since llama.cpp's cost per row depends on rows per call",
            "min": 1,
            "metavar": "N",
        },
    )
    threads: int = field(default=1, metadata={"help": "llama.cpp threads of each stage", "min": 1})
    kv_cells: int = field(default=4096, metadata={"help": "KV cells each stage holds (memory, serve lines)", "min": 1})
    measure: bool = field(
        default=False,
        metadata={
            "help": "print this machine's speed for --workload, at the decode rows --concurrency and --stages "
            "give (give it as --host SPEED)"
        },
    )
    costs: Path | None = field(
        default=None,
        metadata={"help": "read the costs from this JSON file instead of measuring", "metavar": "FILE"},
    )
    remeasure: bool = field(default=False, metadata={"help": "measure again instead of using the cached costs"})


def _size(text: str) -> int:
    unit = _UNITS.get(text[-1:].lower(), 1)
    return int(float(text[:-1] if unit > 1 else text) * unit)


def parse_host(text: str) -> tuple[Host, str | None]:
    """`SPEED[:MEM][@ADDR]` (2, 1.5:8G, 1:4G@tcp://10.0.0.3:5555) as a Host and its address."""
    spec, _, address = text.partition("@")
    speed, _, memory = spec.partition(":")
    try:
        host = Host(float(speed), _size(memory) if memory else None)
        return host, check_address(address) if address else None
    except AddressError as exc:
        raise UsageError(f"--host {text}: {exc}") from None
    except ValueError:
        raise UsageError(
            f"--host {text}: expected SPEED[:MEM][@ADDR], e.g. 2, 1.5:8G or 1:4G@tcp://10.0.0.3:5555"
        ) from None


def parse_workload(text: str) -> tuple[float, float]:
    try:
        prefill, decode = (float(x) for x in text.split(":"))
        Workload(prefill, decode)
    except ValueError:
        raise UsageError(f"--workload {text}: expected PREFILL:DECODE tokens per request, e.g. 16:128") from None
    return prefill, decode


def _costs(model: Path, costs: Path | None, how: Measure, *, remeasure: bool = False) -> ModelCosts:
    """The costs from `costs` when given, else measured here as `how` says (cached)."""
    return load_costs(costs) if costs is not None else cached_costs(model, how, remeasure=remeasure)


def _opts_costs(opts: PlanOptions, stages: int) -> ModelCosts:
    how = Measure.for_chain(opts.concurrency, stages, opts.threads)
    return _costs(opts.model, opts.costs, how, remeasure=opts.remeasure)


def planned_split(
    model: Path,
    stages: int,
    *,
    threads: int = 1,
    concurrency: int = 8,
    workload: Workload | None = None,
    costs: Path | None = None,
    hosts: Sequence[Host] | None = None,
) -> Plan:
    """The plan for `stages` machines (equal unless `hosts` says) serving `concurrency` sessions at
    once: what `neuron-tai shard --stages N` writes."""
    measured = _costs(model, costs, Measure.for_chain(concurrency, stages, threads))
    chosen = list(hosts) if hosts is not None else [Host()] * stages
    if len(chosen) != stages:
        raise ValueError(f"{stages} stages but {len(chosen)} hosts")
    return plan(measured, chosen, workload or Workload())


def serve_lines(
    model: Path, chosen: Plan, addresses: Sequence[str], threads: int, kv_cells: int
) -> list[tuple[int, str]]:
    """Each stage's `neuron-tai serve` line, tail first: a stage's --next is up before it starts.

    A chain longer than 2 stages keeps one micro-batch per stage in flight: the head is told
    how many (serve's default, 2, is a 2-stage chain's); the stages below run its groups."""
    lines = []
    n = len(chosen.stages)
    groups = chain_micro_batches(n)
    for i in reversed(range(n)):
        a, b = chosen.stages[i].layers
        args = ["neuron-tai", "serve", str(model), "--layers", f"{a}:{b}", "--bind", addresses[i]]
        args += ["--threads", str(threads), "--kv-cells", str(kv_cells)]
        if i + 1 < n:
            args += ["--next", addresses[i + 1]]
        if i == 0 and n > 1 and groups != CHAIN_MICRO_BATCHES:
            args += ["--micro-batches", str(groups)]
        lines.append((i, shlex.join(args)))
    return lines


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _report(opts: PlanOptions, costs: ModelCosts, hosts: list[tuple[Host, str | None]], chosen: Plan) -> list[str]:
    work = Workload(*parse_workload(opts.workload), kv_cells=opts.kv_cells)
    rows = chain_rows(opts.concurrency, len(chosen.stages))
    source = f"from {opts.costs}" if opts.costs else f"measured here, {opts.threads} thread(s), {rows}-row decode calls"
    out = [
        f"{opts.model.name}: {len(costs.layers)} layers, costs {source}; workload {work.prefill_tokens:g} prompt + "
        f"{work.decode_tokens:g} generated tokens per request, {work.kv_cells} KV cells per stage",
        "stage  layers  speed  memory limit  needs     share  load",
    ]
    for i, (stage, (host, _)) in enumerate(zip(chosen.stages, hosts, strict=True)):
        a, b = stage.layers
        out.append(
            f"{i:<6} {a:>2}:{b:<4} {host.speed:<6g} {_mib(host.memory_bytes):<13} {_mib(stage.memory_bytes):<9} "
            f"{stage.share:.3f}  {stage.load:.3f}"
        )
    out.append(
        f"predicted scale-out efficiency bound: {chosen.efficiency_bound:.3f} "
        f"(stage time summed / ({len(chosen.stages)} x the slowest stage's))"
    )
    return out


def _hosts(opts: PlanOptions) -> list[tuple[Host, str | None]]:
    hosts = [parse_host(h) for h in opts.hosts]
    if not hosts:
        return [(Host(), None)] * (opts.stages or 1)
    if opts.stages is not None and opts.stages != len(hosts):
        raise UsageError(f"--stages {opts.stages} but {len(hosts)} --host: give one --host per stage")
    return hosts


def run_plan(values: Mapping[str, Any]) -> int:
    opts: PlanOptions = build(PlanOptions, options_of(PlanOptions), values)
    prefill, decode = parse_workload(opts.workload)
    if opts.measure:
        costs = _opts_costs(opts, opts.stages or 1)
        whole = plan(costs, [Host()], Workload(prefill, decode, opts.kv_cells)).slowest_seconds
        speed = (prefill + decode) / whole if whole > 0 else math.inf
        print(f"speed {speed:.4g}  ({opts.model.name}: tokens per second of a whole-model stage for this workload)")
        return 0
    if not opts.hosts and opts.stages is None:
        raise UsageError("give --stages N or one --host per machine")
    hosts = _hosts(opts)
    costs = _opts_costs(opts, len(hosts))
    chosen = plan(costs, [h for h, _ in hosts], Workload(prefill, decode, opts.kv_cells))
    print("\n".join(_report(opts, costs, hosts, chosen)))
    addresses = [a or f"tcp://HOST{i}:5555" for i, (_, a) in enumerate(hosts)]
    print("start in this order (tail first, so each stage's --next is up):")
    for i, line in serve_lines(opts.model, chosen, addresses, opts.threads, opts.kv_cells):
        print(f"  # stage {i}\n  {line}")
    if any(a is None for _, a in hosts):
        print("(HOSTn: each machine's address; give it as --host SPEED[:MEM]@tcp://ADDRESS:PORT)")
    return 0
