"""The chaos run's failover part: replicas die, hang and lose their link while sessions generate.

A 3-stage chain on the tiny quantized test model (testkit.models): a head, two replicas of
the middle range, two of the tail; every node one llama.cpp thread, batch-invariant, flash
attention on. Each replica runs in a network namespace of its own, on one veth into a hub
namespace where the head and this bench run (bench/netns.py `open_star`); where namespaces
cannot be made, every node runs on loopback and the `cut` fault is left out (said in `notes`).

1. Undisturbed: `concurrency` greedy sessions generate through the head (server-side
   `generate`, streamed) for `phase_s`; each request's first completion is its reference.
2. Under failures: the same load while one replica at a time is SIGKILLed and restarted,
   SIGSTOPped and resumed, or cut off and reconnected (bench/chaos_faults.py), `faults`
   of them, one every `fault_every_s`; every session is compared with its reference.
3. Once the clients have left, one lease (and a margin) later, every node's `stats`.

It fails on a lost session, a token mismatch, a session still held after the lease, a crash
or a fault kind never injected; it reports the rest: the longest gap between two streamed
tokens per session (p50/p99), the head's recovery counters, throughput under failures
against undisturbed, VmHWM per node. Everything started is stopped, and every namespace
removed, on every way out.

    python -m bench.chaos_failover full    # evidence/chaos_failover.json (on a quiet machine)
    python -m bench.chaos_failover quick   # under 90 s: .bench/chaos-failover-quick.json
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import trio

from bench import chaos_failover_report as report
from bench.chaos_drivers import held, node_stats
from bench.chaos_faults import KINDS, Injector, Replica
from bench.chaos_report import publish
from bench.chaos_streams import StreamRun, run_streams
from bench.common import WORK
from bench.interrupts import run_main, run_until_interrupted
from bench.netns import Star, open_star
from bench.processes import Processes, free_ports, node_ready, open_processes, serve_command
from bench.progress import say
from bench.rss import MemoryTrack
from bench.workload import Request
from neuron_tai.client import open_client
from neuron_tai.shard import stage_bounds, write_stages
from testkit.models import TinySpec, write_tiny_model

# The test suite's quantized tiny model (tests/conftest.py TINY_QUANT): K-quant kernels, as real models.
TINY_QUANT = TinySpec(n_embd=256, n_ff=512, quant="q4_k_m", seed=4321)
LEASE_MARGIN_S = 2.0
PORT = 21000  # inside the namespaces every port is free


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    mode: str
    phase_s: float  # the undisturbed run; the run under failures lasts as long as its faults, at least this
    faults: int
    fault_every_s: float
    down_s: float  # a killed replica is started again after this long
    stopped_s: float  # SIGSTOP held this long
    cut_s: float  # the link down this long
    concurrency: int = 16
    requests: int = 32
    max_new: int = 32
    lease_s: float = 3.0
    max_sessions: int = 48
    seed: int = 11


# A hang or a cut longer than the links' heartbeat timeout (1 s): the stage in front must notice it.
FULL = Plan(mode="full", phase_s=120.0, faults=12, fault_every_s=10.0, down_s=1.0, stopped_s=5.0, cut_s=5.0)
QUICK = Plan(mode="quick", phase_s=12.0, faults=3, fault_every_s=5.0, down_s=0.5, stopped_s=4.0, cut_s=4.0, lease_s=2.0)
HEAD = "head"


def requests(plan: Plan) -> list[Request]:
    """Prompts of 6 to 24 random ids of the tiny vocabulary, after BOS (1), as tests/test_recovery.py."""
    rng = np.random.default_rng(plan.seed)
    return [
        Request(i, (1, *rng.integers(3, 268, int(rng.integers(5, 24))).tolist()), plan.max_new)
        for i in range(plan.requests)
    ]


def shards(work: Path) -> list[Path]:
    model = work / "tiny-llama-q4_k_m.gguf"
    if not model.exists():
        write_tiny_model(model, TINY_QUANT)
    return write_stages(model, work / "shards", stage_bounds(4, split=[1, 3]))


@dataclass(slots=True)
class Chain:
    head: str
    replicas: list[Replica]
    tracks: dict[str, MemoryTrack] = field(default_factory=dict)


def start_chain(procs: Processes, star: Star, plan: Plan, work: Path) -> Chain:
    """Tails, then middles (each forwarding to both tails), then the head (forwarding to both middles)."""
    head_model, mid_model, tail_model = shards(work)
    ports = iter(free_ports(5) if not star.isolated else range(PORT, PORT + 5))
    flags = [
        "--batch-invariant",
        "--flash-attn",
        "on",
        "--lease",
        f"{plan.lease_s:g}",
        "--max-sessions",
        str(plan.max_sessions),
        "--max-waiting",
        str(plan.max_sessions),
    ]

    def replica(base: str, index: int, model: Path, nexts: list[Replica]) -> Replica:
        leaf = base.replace("-", "")
        address = f"tcp://{star.address(leaf)}:{next(ports)}"
        extra = [arg for r in nexts for arg in ("--next", r.address)]
        cmd = star.command(leaf, serve_command(model, address, threads=1, flags=[*flags, *extra]))
        rep = Replica(base, leaf, address, cmd, index)
        if not procs.start(rep.name, cmd, node_ready):
            raise RuntimeError(f"{rep.name} did not start:\n" + "\n".join(procs.crashed[rep.name].log_tail))
        for r in nexts:
            r.upstreams.append(address)
        return rep

    tails = [replica(f"tail-{i}", i, tail_model, []) for i in range(2)]
    mids = [replica(f"mid-{i}", i, mid_model, tails) for i in range(2)]
    head = f"tcp://{star.address(None)}:{next(ports)}"
    nexts = [arg for r in mids for arg in ("--next", r.address)]
    if not procs.start(HEAD, serve_command(head_model, head, threads=1, flags=[*flags, *nexts]), node_ready):
        raise RuntimeError(f"{HEAD} did not start:\n" + "\n".join(procs.crashed[HEAD].log_tail))
    for r in mids:
        r.upstreams.append(head)
    return Chain(head, [mids[0], tails[0], mids[1], tails[1]])


async def watch(procs: Processes, tracks: dict[str, MemoryTrack], t0: float) -> None:
    """Record a crash the moment it happens, and every node's memory, twice a second."""
    while True:
        procs.check("the failover part")
        for name, proc in list(procs.running.items()):
            tracks.setdefault(name, MemoryTrack(proc.pid)).sample(time.monotonic() - t0)
        await trio.sleep(0.5)


async def phase(chain: Chain, plan: Plan, run: StreamRun, tag: str, injector: Injector | None) -> None:
    """The load for `phase_s` (undisturbed) or for as long as the injector's faults take."""
    stop = trio.Event()
    async with open_client(chain.head, timeout_s=60) as client, trio.open_nursery() as nursery:
        nursery.start_soon(run_streams, client, requests(plan), plan.concurrency, stop, tag, run)
        if injector is None:
            await trio.sleep(plan.phase_s)
        else:
            began = trio.current_time()
            await injector.run(plan.faults, plan.fault_every_s)
            await trio.sleep_until(began + plan.phase_s)
        stop.set()


def fronts(chain: Chain) -> dict[str, str]:
    """The nodes that place sessions on replicas: the head, and each middle replica."""
    return {HEAD: chain.head, **{r.name: r.address for r in chain.replicas if r.name.startswith("mid")}}


async def measure(procs: Processes, star: Star, chain: Chain, plan: Plan) -> dict[str, Any]:
    t0 = trio.current_time()
    kinds = KINDS if star.isolated else tuple(k for k in KINDS if k != "cut")
    injector = Injector(procs, star, chain.head, chain.replicas, kinds, plan.down_s, plan.stopped_s, plan.cut_s, t0)
    reference: dict[int, list[int]] = {}
    calm, storm = StreamRun(reference, frozen=False), StreamRun(reference, frozen=True)
    async with trio.open_nursery() as background:
        background.start_soon(watch, procs, chain.tracks, time.monotonic())
        say(f"failover: undisturbed, c={plan.concurrency} for {plan.phase_s:g} s")
        await phase(chain, plan, calm, "calm", None)
        calm_stats = {name: await node_stats(address) for name, address in fronts(chain).items()}
        say(f"failover: under failures, {plan.faults} faults ({', '.join(kinds)}) every {plan.fault_every_s:g} s")
        await phase(chain, plan, storm, "storm", injector)
        say(f"failover: the clients have left; waiting one lease ({plan.lease_s:g} s) and {LEASE_MARGIN_S:g} s")
        await trio.sleep(plan.lease_s + LEASE_MARGIN_S)
        nodes = {HEAD: chain.head, **{r.name: r.address for r in chain.replicas}}
        stats = {name: await node_stats(address) for name, address in nodes.items()}
        background.cancel_scope.cancel()
    hwm = {name: t.peak_mib for name, t in chain.tracks.items()}
    hwm.update(injector.peaks_mib)
    calm_row, storm_row = calm.report(), storm.report()
    missing = [r.rid for r in requests(plan) if r.rid not in reference]
    return {
        "undisturbed": calm_row,
        "under_failures": storm_row,
        "faults": injector.faults,
        "killed": injector.killed,
        "kinds": list(kinds),
        "throughput_ratio": round(storm_row["tok_s"] / calm_row["tok_s"], 3)
        if storm_row["tok_s"] and calm_row["tok_s"]
        else None,
        "recovery": report.recovery_figures(stats[HEAD]),
        "undisturbed_placement": report.placement_spread(calm_stats),
        "undisturbed_recoveries": (calm_stats[HEAD] or {}).get("recoveries_total"),
        "vmhwm_mib": hwm,
        "after_lease": {n: None if s is None else held(s) for n, s in stats.items()},
        "replicas_at_end": {n: s["downstream"]["replicas"] for n, s in stats.items() if s and "downstream" in s},
        "bench_errors": [f"requests without an undisturbed completion: {missing}"] if missing else [],
    }


def run_part(mode: str, out: Path | None) -> int:
    """The whole part in `mode`; its JSON written to `out` (or its default place); 0 when it passed."""
    plan = FULL if mode == "full" else QUICK
    work = WORK / f"chaos-failover-{plan.mode}"
    work.mkdir(parents=True, exist_ok=True)
    started, wall = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.monotonic()
    say(f"chaos failover {plan.mode}: a head, two middle and two tail replicas on the tiny quantized model")
    with open_star(["mid0", "mid1", "tail0", "tail1"], "cf") as star, open_processes(work / "logs") as procs:
        chain = start_chain(procs, star, plan, work)
        result = trio.run(run_until_interrupted, partial(measure, procs, star, chain, plan))
        for name in list(procs.running):
            procs.stop(name)
    killed = set(result["killed"])
    result["crashes"] = [asdict(c) for c in procs.crashed.values()]
    result["processes"] = [
        {"name": n, "pid": pid, "exit_status": rc, "killed_on_purpose": n in killed}
        for n, (pid, rc) in procs.ended.items()
    ]
    result["notes"] = [] if star.isolated else [f"`cut` not injected: {star.note}"]
    found = report.failures(result, tuple(result["kinds"]))
    payload = {
        "started": started,
        "seconds": round(time.monotonic() - wall, 1),
        "plan": asdict(plan),
        "network": star.note,
        "model": "tiny-llama q4_k_m (testkit.models)",
        "passed": not found,
        "failures": found,
        **result,
    }
    print(report.console(result))
    return publish(payload, "chaos_failover.json", out, WORK / "chaos-failover-quick.json", "chaos failover")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=["full", "quick"], default="full")
    parser.add_argument("--out", type=Path, help="where the JSON goes (quick: .bench/chaos-failover-quick.json)")
    args = parser.parse_args()
    return run_part(args.mode, args.out)


if __name__ == "__main__":
    run_main(main, "every process the failover part started was stopped, every namespace removed")
