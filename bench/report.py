"""`just bench`: the node against what users would otherwise run, with proof that sessions never mix.

One run, on real processes over loopback: a single node and a 2-stage chain (each also in
batch-invariant mode), llama.cpp's `llama-server -np 16`, llama-cpp-python's `Llama`
serving requests one after another, and the bare llama_decode loop. The same seeded
prompts of mixed lengths and token counts go to each at concurrency 1, 2, 4, 8 and 16.
Then the corruption proof, a burst beyond the node's limits, and the report in
evidence/DGR-012/ (`quick`: the tiny test model, no peer that needs a build, report under
.bench/). A node or llama-server that crashes is reported with its log's last lines and the rest
still runs. Exits 1 on any crash, bit-exact mismatch or lost session.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import trio

from bench import plots, report_markdown
from bench.admission import burst
from bench.aggregate import saturation
from bench.bare_loop import BareLoop, run_waves
from bench.ceiling import ceiling_for
from bench.common import (
    EVIDENCE,
    WORK,
    bench_model,
    evidence_meta,
    interleaved,
    resolve_model,
    shown,
)
from bench.faults import ENV, Faults
from bench.faults import SIGNAL as FAULT_SIGNAL
from bench.interrupts import run_main, run_until_interrupted
from bench.latency import Trace, summarize
from bench.llama_server import cached_binary, ensure_llama_server
from bench.node_driver import closed_loop
from bench.processes import Processes, free_ports, node_ready, open_processes, serve_command, while_alive
from bench.progress import say
from bench.proofs import default_mode, invariant_proof
from bench.python_peer import PythonPeer, open_llama, run_serial
from bench.rss import preemptions_of
from bench.server_peer import calls_between, healthy, metrics, server_command, weight_buffers
from bench.server_peer import closed_loop as server_loop
from bench.stats_sampler import StatsSampler
from bench.systems import ALL, BARE, CHAIN, NODE_FAST, PYTHON, SERVER, SLOTS
from bench.systems import NODE as SINGLE
from bench.workload import CORPUS, WORKLOADS, Request, first_per_client, make_requests
from engine.backend import ContextConfig
from engine.llama_handles import weight_placement
from engine.process_cpu import preemptions
from neuron_tai.client import open_client


@dataclass(frozen=True, slots=True)
class Plan:
    """What one bench run measures and where it writes."""

    mode: str
    requests: int
    max_new: int
    max_prompt: int
    concurrencies: tuple[int, ...]
    reps: int
    kv_cells: int
    ctx_per_slot: int
    build_server: bool  # quick mode only uses a llama-server that is already built
    burst_queue_bytes: int  # the burst node's queue budget: room for one long prompt or a few short ones
    out_dir: Path
    seed: int = 12
    workload: str = "prompt"  # a key of bench.workload.WORKLOADS
    # Requests per client at concurrency c: the first c x per_client (at most `requests`); 0: all of them at every c.
    per_client: int = 0
    proofs: bool = True  # the corruption proof, the default-mode analysis and the burst
    variants: bool = True  # the node with --prefill-share 4 and `Llama` serial, beside the systems the issue names
    chain_at: tuple[int, ...] = ()  # the concurrencies the 2-stage chain runs at (empty: every one)


FULL = Plan(
    mode="full",
    requests=16,
    max_new=32,
    max_prompt=256,
    concurrencies=(1, 2, 4, 8, 16),
    reps=1,
    kv_cells=4096,
    ctx_per_slot=512,
    build_server=True,
    burst_queue_bytes=1024,
    out_dir=EVIDENCE / "DGR-012",
)
QUICK = Plan(
    mode="quick",
    requests=16,
    max_new=16,
    max_prompt=64,
    concurrencies=(1, 2, 4, 8, 16),
    reps=1,
    kv_cells=2048,
    ctx_per_slot=256,
    build_server=False,
    burst_queue_bytes=256,
    out_dir=WORK / "DGR-012-quick",
)
PROOF_SESSIONS = 8  # the corruption proof's primaries, each beside a partner of its own


# -- set-up ---------------------------------------------------------------------------


def shard_in_two(model: Path) -> list[Path]:
    """`neuron-tai shard MODEL --stages 2`, exactly as an operator would run it."""
    out = WORK / "shards" / model.stem
    cmd = [sys.executable, "-m", "neuron_tai.cli", "shard", str(model), "--stages", "2", "-o", str(out)]
    say("$ neuron-tai shard " + shown(" ".join(cmd[4:])))
    printed = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout  # "layers A:B<TAB>PATH"
    return [Path(line.split("\t", 1)[1]) for line in printed.splitlines()]


def llama_server(plan: Plan) -> tuple[Path | None, str]:
    """The cached llama-server; full mode builds it first if needed (once, about 6 minutes on 2 cores)."""
    if not plan.build_server or cached_binary() is not None:
        binary = cached_binary()
        return binary, f"cached {shown(binary)}" if binary else ""
    say("building llama-server from the vendored llama.cpp (once; about 6 minutes on 2 cores) ...")
    binary, note = ensure_llama_server()
    return binary, shown(note)


# Which processes each system needs: it is reported crashed once one of them is.
NEEDS: dict[str, tuple[str, ...]] = {
    SINGLE: ("single",),
    NODE_FAST: ("single-prefill-share-4",),
    CHAIN: ("chain2-head", "chain2-tail"),
    SERVER: ("llama-server",),
    BARE: (),
    PYTHON: (),
}
PROOF_NODES = ("single-invariant", "chain2-invariant-head", "chain2-invariant-tail")


@dataclass(slots=True)
class Nodes:
    single: str
    chain: str
    chain_tail: str
    single_fast: str
    single_inv: str
    chain_inv: str
    burst: str
    server_port: int | None
    server_note: str
    server_pid: int | None = None


def start_all(
    procs: Processes, plan: Plan, model: Path, shards: list[Path], server: tuple[Path | None, str], faults: Faults
) -> Nodes:
    """Start every node and llama-server; one that crashes on the way is recorded in `procs`, not raised."""
    ports = free_ports(9)  # all bound at once: nine distinct ports

    def serve(name: str, path: Path, port: int, threads: int, extra: list[str]) -> str:
        address = f"tcp://127.0.0.1:{port}"
        cmd = serve_command(path, address, threads=threads, flags=extra)
        if procs.start(name, faults.command(name, cmd), node_ready):
            say(f"started {name}: {address}")
        return address

    limits = ["--max-sessions", str(SLOTS), "--max-waiting", str(SLOTS), "--kv-cells", str(plan.kv_cells)]
    invariant = ["--batch-invariant"] + (["--flash-attn", "on"] if plan.mode == "quick" else [])
    single = serve("single", model, ports[0], 2, limits)
    fast = [*limits, "--prefill-share", "4"]
    single_fast = serve("single-prefill-share-4", model, ports[8], 2, fast) if plan.variants else ""
    tail = serve("chain2-tail", shards[1], ports[1], 1, limits)
    head = serve("chain2-head", shards[0], ports[2], 1, [*limits, "--next", tail])
    single_inv = head_inv = burst_node = ""  # the proofs' nodes, started when this report runs the proofs
    if plan.proofs:
        single_inv = serve("single-invariant", model, ports[3], 2, [*limits, *invariant])
        tail_inv = serve("chain2-invariant-tail", shards[1], ports[4], 1, [*limits, *invariant])
        head_inv = serve("chain2-invariant-head", shards[0], ports[5], 1, [*limits, *invariant, "--next", tail_inv])
        burst_limits = ["--max-sessions", "4", "--max-waiting", "4", "--queue-budget", str(plan.burst_queue_bytes)]
        burst_node = serve("burst", model, ports[6], 2, [*burst_limits, "--kv-cells", str(plan.kv_cells)])
    binary, note = server
    port: int | None = None
    if binary is None:
        note = note or "skipped in quick mode: llama-server is not built yet (`just bench` builds it once)"
        say(f"llama-server: {note}")
    else:
        port = ports[7]
        cmd = server_command(binary, model, port, SLOTS, plan.ctx_per_slot, 2, weight_placement(model))
        if procs.start("llama-server", faults.command("llama-server", cmd), lambda _log: healthy(port)):
            say(f"started llama-server: http://127.0.0.1:{port} ({note})")
    pid = procs.running["llama-server"].pid if "llama-server" in procs.running else None
    return Nodes(single, head, tail, single_fast, single_inv, head_inv, burst_node, port, note, pid)


# -- kernel paths ---------------------------------------------------------------------------


async def node_weights(address: str) -> dict[str, Any]:
    async with open_client(address, timeout_s=60) as client:
        stats = await client.stats()
    return {"kernel_path": stats.get("kernel_path"), "weight_buffers": stats.get("weight_buffers")}


async def kernel_paths(
    procs: Processes, nodes: Nodes, bare: BareLoop, llm: PythonPeer | None
) -> dict[str, dict[str, Any]]:
    """Where each system's weights went: the nodes' `stats`, llama-server's log, llama.cpp's log in-process."""
    out: dict[str, dict[str, Any]] = {
        BARE: {"kernel_path": bare.model.kernel_path.value, "weight_buffers": bare.model.weight_buffers}
    }
    if llm is not None:
        out[PYTHON] = {"kernel_path": llm.kernel_path.value, "weight_buffers": llm.weight_buffers}
    for system, address in ((SINGLE, nodes.single), (NODE_FAST, nodes.single_fast)):
        if address and (got := await while_alive(procs, NEEDS[system], "start", partial(node_weights, address))):
            out[system] = got
    head = await while_alive(procs, NEEDS[CHAIN], "start", partial(node_weights, nodes.chain))
    tail = await while_alive(procs, NEEDS[CHAIN], "start", partial(node_weights, nodes.chain_tail))
    if head is not None and tail is not None:
        same = head["kernel_path"] == tail["kernel_path"]
        path = head["kernel_path"] if same else f"head {head['kernel_path']}, tail {tail['kernel_path']}"
        out[CHAIN] = {
            "kernel_path": path,
            "weight_buffers": {"head": head["weight_buffers"], "tail": tail["weight_buffers"]},
        }
    if nodes.server_port is not None and procs.alive(NEEDS[SERVER]):
        path, buffers = weight_buffers(procs.log("llama-server"))
        out[SERVER] = {"kernel_path": path.value, "weight_buffers": buffers}
    for system, info in out.items():
        say(f"kernel path: {system}: {info['kernel_path']}")
    return out


# -- the sweep --------------------------------------------------------------------------


@dataclass(slots=True)
class Sweep:
    runs: list[dict[str, Any]]
    tokens: dict[tuple[str, int], dict[int, list[int]]]  # (system, concurrency) -> rid -> tokens (first rep)


def record(
    sweep: Sweep, system: str, c: int, rep: int, traces: list[Trace], wall: float, engine: dict[str, Any] | None = None
) -> None:
    row = {"system": system, "concurrency": c, "rep": rep, **summarize(traces, wall)}
    if engine is not None:
        row["engine"] = engine
    sweep.runs.append(row)
    sweep.tokens.setdefault((system, c), {t.rid: t.tokens for t in traces})
    say(
        f"{system:<34} c={c:<2} rep {rep}: {row['tok_s']:8.2f} tok/s  TTFT p50 {row['ttft_p50_ms']} ms  "
        f"ITL p50 {row['itl_p50_ms']} ms p99 {row['itl_p99_ms']} ms"
    )


# (requests, concurrency, session tag, armed) -> traces, wall time; `armed()` runs just before the
# first request (where a test's injected crash lands: the run is cut short mid-flight).
Run = Callable[[list[Request], int, str, Callable[[], None]], Awaitable[tuple[list[Trace], float]]]


ENGINE_COUNTERS = (
    "batches_total",
    "decode_batches_total",
    "decode_rows_total",
    "prefill_tokens_total",
    "preemptions_total",
)


def decode_use(counts: dict[str, float], decode_s: float, wall: float, step_s: float | None = None) -> dict[str, Any]:
    """A run's llama_decode calls and rows (`counts`), the time spent inside them against its wall
    time, and its steps' time (`step_s`: a node's steps also sample and hand off to its compute
    thread; the bare loop's steps are its calls)."""
    share = round(decode_s / wall, 3) if wall > 0 else None
    steps = round(decode_s if step_s is None else step_s, 3)
    return {
        **{k: int(v) for k, v in counts.items()},
        "llama_decode_s": round(decode_s, 3),
        "llama_decode_share": share,
        "step_s": steps,
    }


def engine_use(before: dict[str, Any], after: dict[str, Any], wall: float) -> dict[str, Any]:
    """What the node's engine did during a run, from its `stats` before and after."""
    counts = {k.removesuffix("_total"): after[k] - before[k] for k in ENGINE_COUNTERS}
    steps = after["step_seconds"]["sum"] - before["step_seconds"]["sum"]
    inside = after["llama_decode_seconds_total"] - before["llama_decode_seconds_total"]
    return decode_use(counts, inside, wall, steps)


async def node_run(
    address: str, used: dict[str, dict[str, Any]], requests: list[Request], c: int, tag: str, armed: Callable[[], None]
) -> tuple[list[Trace], float]:
    """A client of its own per run: cancelling the run (its node crashed) also stops the client.
    The node's engine counters over the run go to `used[tag]`."""
    async with open_client(address, timeout_s=300) as client:
        before = await client.stats()  # connected before the clock starts
        armed()
        traces, wall = await closed_loop(client, requests, c, tag)
        used[tag] = engine_use(before, await client.stats(), wall)
        return traces, wall


def server_counters(port: int, pid: int | None) -> dict[str, float] | None:
    """llama-server's metrics and its threads' preemptions now; None once it no longer answers."""
    try:
        found = metrics(port)
    except (OSError, RuntimeError, ValueError):
        return None
    return found if pid is None else found | {"preemptions": preemptions_of(pid)}


def server_use(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, int] | None:
    """llama-server's llama_decode calls over a run (its metrics count no rows and no time inside them)."""
    if before is None or after is None or "n_decode_total" not in before or "n_decode_total" not in after:
        return None
    use = calls_between(before, after)
    if "preemptions" in before and "preemptions" in after:
        use["preemptions"] = round(after["preemptions"] - before["preemptions"])
    return use


async def server_run(
    server: tuple[int, int | None],
    used: dict[str, dict[str, Any]],
    requests: list[Request],
    c: int,
    tag: str,
    armed: Callable[[], None],
) -> tuple[list[Trace], float]:
    """`server`: llama-server's port and pid. Its calls over the run go to `used[tag]`."""
    before = await trio.to_thread.run_sync(server_counters, *server)
    armed()
    loop = partial(server_loop, server[0], requests, c)
    got = await trio.to_thread.run_sync(loop, abandon_on_cancel=True)  # its threads fail once the server is gone
    if (use := server_use(before, await trio.to_thread.run_sync(server_counters, *server))) is not None:
        used[tag] = use
    return got


async def bare_run(
    bare: BareLoop, used: dict[str, dict[str, Any]], requests: list[Request], c: int, tag: str, _armed: object
) -> tuple[list[Trace], float]:
    before, preempted = dict(bare.counters), preemptions()
    traces, wall = run_waves(bare, requests, c)
    use = {k: v - before[k] for k, v in bare.counters.items()} | {"preemptions": preemptions() - preempted}
    decode_s = use.pop("llama_decode_s")
    used[tag] = decode_use(use, decode_s, wall)
    return traces, wall


async def python_run(
    llm: PythonPeer, requests: list[Request], _c: int, _tag: str, _armed: object
) -> tuple[list[Trace], float]:
    return run_serial(llm.llm, requests)


def sweep_runs(nodes: Nodes, bare: BareLoop, llm: PythonPeer | None, used: dict[str, dict[str, Any]]) -> dict[str, Run]:
    """How each system present serves a share of the workload at a concurrency."""
    runs: dict[str, Run] = {
        SINGLE: partial(node_run, nodes.single, used),
        CHAIN: partial(node_run, nodes.chain, used),
        BARE: partial(bare_run, bare, used),
    }
    if nodes.single_fast:
        runs[NODE_FAST] = partial(node_run, nodes.single_fast, used)
    if nodes.server_port is not None:
        runs[SERVER] = partial(server_run, (nodes.server_port, nodes.server_pid), used)
    if llm is not None:
        runs[PYTHON] = partial(python_run, llm)
    return runs


@dataclass(slots=True)
class Sweeper:
    """One sweep's systems, the processes they need, and the faults the bench injects on the way."""

    plan: Plan
    requests: list[Request]
    sampler: StatsSampler
    procs: Processes
    faults: Faults
    runs: dict[str, Run]
    used: dict[str, dict[str, Any]]  # run tag -> the engine's llama_decode calls over that run
    result: Sweep = field(default_factory=lambda: Sweep([], {}))

    @property
    def systems(self) -> list[str]:
        return [s for s in (SINGLE, NODE_FAST, CHAIN, SERVER, BARE) if s in self.runs]

    def crash(self, names: list[str]) -> None:
        for name in names:
            say(f"{ENV}: sending {name} {FAULT_SIGNAL.name}")
            self.procs.signal(name, FAULT_SIGNAL)

    async def at(self, c: int) -> None:
        """Every system at concurrency `c`, interleaved over the repetitions."""
        plan, systems = self.plan, self.systems
        due = self.faults.due(c)
        # a process no swept system needs crashes as the sweep reaches c
        self.crash([name for name in due if not any(name in NEEDS[s] for s in systems)])
        # `Llama` serves one request at a time whatever the concurrency: measured once, at the first.
        sides = [*systems, PYTHON] if c == plan.concurrencies[0] and PYTHON in self.runs else systems
        sides = [s for s in sides if s != CHAIN or not plan.chain_at or c in plan.chain_at]
        for rep, system in interleaved(plan.reps, sides):
            if not self.procs.alive(NEEDS[system]):
                continue
            hit = [n for n in due if n in NEEDS[system]]
            due = [n for n in due if n not in hit]  # a system's process crashes once its run is under way
            await self.measure(system, c, rep, hit)

    async def measure(self, system: str, c: int, rep: int, crashing: list[str]) -> None:
        self.sampler.phase = f"{system} c={c}"
        tag = f"{system.replace(' ', '')}-c{c}-r{rep}"
        share = first_per_client(self.requests, self.plan.per_client, c)
        run = partial(self.runs[system], share, c, tag, partial(self.crash, crashing))
        got = await while_alive(self.procs, NEEDS[system], f"{system} c={c}", run)
        self.sampler.phase = "idle"
        if got is None:
            say(f"{system} c={c}: stopped, a process it needs crashed")
        else:
            record(self.result, system, c, rep, *got, self.used.pop(tag, None))


async def sweep(
    plan: Plan,
    nodes: Nodes,
    requests: list[Request],
    sampler: StatsSampler,
    bare: BareLoop,
    llm: PythonPeer | None,
    procs: Processes,
    faults: Faults,
) -> Sweep:
    used: dict[str, dict[str, Any]] = {}
    sweeper = Sweeper(plan, requests, sampler, procs, faults, sweep_runs(nodes, bare, llm, used), used)
    await warm_up(sweeper.runs, sweeper.systems, requests[0], procs)
    used.clear()
    for c in plan.concurrencies:
        await sweeper.at(c)
    return sweeper.result


async def warm_up(runs: dict[str, Run], systems: list[str], request: Request, procs: Processes) -> None:
    """One short request per system before anything is measured: a process's first calls pay
    once for the pages and buffers they touch, which would otherwise land on c=1 alone."""
    warm = [replace(request, max_new=4)]
    for system in systems:
        run = partial(runs[system], warm, 1, f"warm-up-{system.replace(' ', '')}", lambda: None)
        await while_alive(procs, NEEDS[system], f"{system} warm-up", run)


async def proofs(
    plan: Plan, nodes: Nodes, procs: Processes, requests: list[Request]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The corruption proof on the batch-invariant nodes, then the burst beyond the burst node's limits."""
    primary = requests[:PROOF_SESSIONS]
    partners = [replace(r, rid=100 + r.rid) for r in requests[PROOF_SESSIONS : 2 * PROOF_SESSIONS]]
    proof = partial(invariant_proof, nodes.single_inv, nodes.chain_inv, primary, partners)
    invariant = await while_alive(procs, PROOF_NODES, "the corruption proof", proof)
    burst_requests = [replace(requests[i % len(requests)], rid=200 + i) for i in range(24)]
    if procs.alive(("burst",)):
        queued = f"{plan.burst_queue_bytes} B of queued steps"
        say(f"burst: 24 clients at once; the node takes 4 sessions, 4 waiting, {queued}")
    admission = await while_alive(procs, ("burst",), "the burst", partial(burst, nodes.burst, burst_requests))
    if admission is not None:
        got, expected = admission["tokens_received"], admission["tokens_expected"]
        say(
            f"burst: accepted {admission['accepted']}, refused {admission['refused']}, "
            f"busy retries {admission['busy_retries']}, tokens {got}/{expected}"
        )
    return invariant, admission


# -- main -------------------------------------------------------------------------------


def plan_for(base: Plan, workload: str, model: Path, out: Path | None, *, named: bool) -> Plan:
    """The plan for one model and workload: a named model's or another workload's report goes beside the default.

    `just bench` runs four reports (two models, two workloads) and has 45 minutes on 2 cores. The
    default report (gemma-3-270m, prompt-heavy) runs everything; a full report beside it cuts
    repetitions first: one repetition, a client serves 2 requests at each concurrency (1 when
    decode-heavy: those all have one shape), the proofs run only in the default report (they check
    the node, not the workload); then systems: no `--prefill-share 4` node, no `Llama` serial, and
    the 2-stage chain (its two stages sharing this machine's cores) only at c = 1 and 8: the
    multi-host suite measures the chain as it is meant to run, one machine per stage.
    """
    plan = replace(base, workload=workload)
    decode, beside = workload != "prompt", named or workload != "prompt"
    if decode and base.mode == "full":
        plan = replace(plan, max_new=WORKLOADS[workload].max_new)
    if beside:
        plan = replace(plan, reps=1)
    if beside and base.mode == "full":
        one_shape = WORKLOADS[workload].one_shape  # every request alike: one per client measures them
        plan = replace(plan, per_client=1 if one_shape else 2, proofs=False, variants=False, chain_at=(1, 8))
    if out is not None:
        return replace(plan, out_dir=out)
    if beside:  # as `python -m bench` places them
        name = "report" + ("" if workload == "prompt" else f"-{workload}") + (f"-{model.stem}" if named else "")
        return replace(plan, out_dir=base.out_dir / name)
    return plan


def plan_requests(plan: Plan, bare: BareLoop) -> list[Request]:
    """The plan's workload, tokenized by the nodes' tokenizer (the same llama.cpp, the same model)."""
    corpus = bare.model.tokenize(CORPUS, add_special=False)
    start = bare.model.tokenize("", add_special=True)
    requests = make_requests(
        corpus,
        plan.requests,
        plan.max_new,
        seed=plan.seed,
        max_prompt=plan.max_prompt,
        bos=start[0] if start else None,
        buckets=WORKLOADS[plan.workload].buckets,
    )
    lengths = [len(r.prompt) for r in requests]
    say(
        f"workload: {len(requests)} requests, prompts {min(lengths)}-{max(lengths)} tokens, "
        f"{plan.max_new} new tokens each, seed {plan.seed}"
    )
    return requests


def systems_measured(kernels: dict[str, dict[str, Any]], procs: Processes) -> dict[str, dict[str, Any]]:
    """Each system measured (or crashed): its processes, kernel path, weight buffers and crashes."""
    return {
        s: {
            "processes": list(NEEDS[s]),
            **kernels.get(s, {"kernel_path": None, "weight_buffers": None}),
            "crashed": [n for n in NEEDS[s] if n in procs.crashed],
        }
        for s in ALL
        if s in kernels or any(n in procs.crashed for n in NEEDS[s])
    }


async def run(plan: Plan, model: Path, nodes: Nodes, procs: Processes, faults: Faults) -> dict[str, Any]:
    bare = BareLoop(
        model, ContextConfig(n_seq_max=16, n_ctx=16 * plan.ctx_per_slot, n_batch=512, n_ubatch=512, n_threads=2)
    )
    llm: PythonPeer | None = None
    try:
        requests = plan_requests(plan, bare)
        llm = open_llama(model, plan.ctx_per_slot, 2) if plan.variants else None
        kernels = await kernel_paths(procs, nodes, bare, llm)
        watched = {"single": nodes.single, "chain2-head": nodes.chain, "chain2-tail": nodes.chain_tail}
        sampler = StatsSampler({name: address for name, address in watched.items() if procs.alive([name])})
        primary = requests[:PROOF_SESSIONS]
        async with trio.open_nursery() as nursery:
            await nursery.start(sampler.run)
            result = await sweep(plan, nodes, requests, sampler, bare, llm, procs, faults)
            nursery.cancel_scope.cancel()
        default = None
        if plan.proofs and (SINGLE, 1) in result.tokens:
            proof = partial(default_mode, nodes.single, result.tokens, primary, bare)
            default = await while_alive(procs, NEEDS[SINGLE], "the default-mode analysis", proof)
    finally:
        if llm is not None:
            llm.close()
        bare.close()
    invariant, admission = (await proofs(plan, nodes, procs, requests)) if plan.proofs else (None, None)
    return {
        "workload": [{"rid": r.rid, "prompt_tokens": len(r.prompt), "max_new": r.max_new} for r in requests],
        "systems": systems_measured(kernels, procs),
        "runs": result.runs,
        "telemetry": sampler.samples,
        "default_mode": default,
        "invariant": invariant,
        "admission": admission,
        "mismatches": invariant["mismatches"] if invariant is not None else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["full", "quick"], default="full")
    parser.add_argument("--out", type=Path, help="report directory (default: evidence/DGR-012, quick: .bench/)")
    parser.add_argument("--model", help="a GGUF file, gemma-3-270m or a model shape (default: gemma, quick: tiny)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="prompt", help="prompt- or decode-heavy")
    parser.add_argument("--reps", type=int, help="repetitions per system and concurrency (default: the plan's)")
    parser.add_argument(
        "--render-only", type=Path, metavar="DIR", help="redraw DIR's plots and README from its bench.json"
    )
    args = parser.parse_args()
    if args.render_only:
        report = json.loads((args.render_only / "bench.json").read_text())
        plots.draw_all(report, args.render_only)
        (args.render_only / "README.md").write_text(report_markdown.render(report))
        return 0
    quick = args.mode == "quick"
    model = resolve_model(args.model) if args.model else bench_model(quick)
    plan = plan_for(QUICK if quick else FULL, args.workload, model, args.out, named=args.model is not None)
    plan = replace(plan, reps=args.reps or plan.reps)
    faults = Faults.from_env()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    say(f"bench {plan.mode}: model {shown(model)}, {WORKLOADS[plan.workload].name} workload")
    shards = shard_in_two(model)
    server = llama_server(plan)
    ceiling = ceiling_for(model, pp=16, tg=plan.max_new, build=plan.build_server)  # alone on the machine
    with open_processes(WORK / "logs") as procs:
        nodes = start_all(procs, plan, model, shards, server, faults)
        payload = trio.run(run_until_interrupted, partial(run, plan, model, nodes, procs, faults))
    payload["processes"] = [{"name": n, "pid": pid, "exit_status": rc} for n, (pid, rc) in procs.ended.items()]
    payload["crashes"] = [asdict(c) for c in procs.crashed.values()]
    meta = evidence_meta()
    report = {
        **meta,
        "started": started,
        "finished": meta["date"],
        "plan": {k: shown(v) if isinstance(v, Path) else v for k, v in asdict(plan).items()},
        "model": model.name,
        "workload_name": WORKLOADS[plan.workload].name,
        "chain2_shards": [s.name for s in shards],
        "llama_server": nodes.server_note,
        "sessions_max": SLOTS,
        "ceiling": ceiling,
        **payload,
    }
    report["saturation"] = saturation(report["runs"])
    write_report(report, plan.out_dir)
    failed = failures(report)
    if failed:
        print(f"FAILED: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    """bench.json, the plots and the README of one report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    plots.draw_all(report, out_dir)
    (out_dir / "README.md").write_text(report_markdown.render(report))
    say(f"report: {shown(out_dir)}/README.md, bench.json, {', '.join(plots.FILES)}")


def failures(report: dict[str, Any]) -> list[str]:
    """What makes the report a failure: a crash, a bit-exact mismatch, a session lost in the burst."""
    failed = []
    if report["crashes"]:
        failed.append("crashed: " + ", ".join(f"{c['name']} ({c['reason']})" for c in report["crashes"]))
    if report["mismatches"]:
        failed.append(f"{report['mismatches']} bit-exact mismatches")
    admission = report["admission"]
    if admission and (admission["incomplete_sessions"] or admission["tokens_received"] != admission["tokens_expected"]):
        failed.append("lost sessions in the burst")
    return failed


if __name__ == "__main__":
    run_main(main, "every process the bench started was stopped")
