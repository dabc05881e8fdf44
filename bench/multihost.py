"""A chain's stages on separate hosts, on one machine: what scale-out gains and what link latency costs.

Three hosts, each a Linux network namespace (bench/netns.py): `client` (the bench's load
client), `s0` (the head of a 2-stage chain, and the single node it is compared with) and
`s1` (the tail), joined by veth links client<->s0 and s0<->s1, so every hop is real TCP
between separate network stacks. Each stage is pinned to a core of its own and runs one
llama.cpp thread. A delay proxy (bench/delay_proxy.py) on each link adds one-way latency.
Without the privilege to make namespaces the same hosts run on loopback, and the output
says so.

- Scale-out: the chain against one node on one core with one thread, at each concurrency
  of each workload (bench/workload.py: prompt-heavy, and decode-heavy with 16-token prompts
  and 128 new tokens), the node running the token loop (server-side `generate`);
  efficiency = chain tok/s / (2 x single-node tok/s). With `--reps N` each concurrency runs
  N such pairs, their order alternating, and reports the median pair with every pair's
  efficiency beside it. The chain's layer split is `chain_bounds`'s. The single node also
  runs at half of each concurrency: a chain at c computes c/2 rows per call on each stage
  (two micro-batches), so single(c/2) / single(c) bounds its efficiency (`batching_bound`);
  `share_of_bound` is how much of it the chain got.
- Latency tolerance: the same chain with each one-way delay on both links (client<->head
  and head<->tail), at concurrency 8: tok/s, inter-token p50/p99. Each delay is checked by
  pinging through the proxy and past it on both links (added round trip: 2 x delay).

    python -m bench.multihost --out multihost.json
    python -m bench.multihost --model llama-3.2-1b --workload decode --concurrency 1,8 --delays none --out m.json
    python -m bench.multihost --quick --delays 2 --out .bench/multihost-quick.json

Everything it creates (namespaces, links, processes) is removed on the way out, also on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.common import MODEL_ENV, SHARDS, WORK, alternating, bench_model, command_line, shown, table
from bench.interrupts import run_main
from bench.netns import Topology, open_topology
from bench.placement import planned_bounds
from bench.processes import Processes, node_ready, open_processes, serve_command
from bench.workload import WORKLOADS
from neuron_tai.placement import Workload as PlanWorkload
from neuron_tai.shard_cache import cached_stages

HOSTS = ("client", "s0", "s1")
LINKS = (("client", "s0"), ("s0", "s1"))
HEAD_CORE, TAIL_CORE = 0, 1  # the single node runs on the head's core, measured while the chain idles
MAX_SESSIONS = 16  # every session of the highest concurrency runs at once
PLAN_CONCURRENCY = 8  # the split is planned for c=8 (4-row calls a stage), the placement target
SCALE_COLUMNS = [
    "workload",
    "concurrency",
    "single_tok_s",
    "chain_tok_s",
    "efficiency",
    "batching_bound",
    "share_of_bound",
    "single_ms_per_token",
    "chain_ms_per_token",
    "head_compute_ms",
    "tail_compute_ms",
    "hop_ms",
    "single_rows_per_call",
    "head_rows_per_call",
    "tail_rows_per_call",
    "pair_efficiencies",
]
LATENCY_COLUMNS = [
    "delay_ms",
    "tok_s",
    "itl_p50_ms",
    "itl_p99_ms",
    "ttft_p50_ms",
    "rtt_added_expected_ms",
    "rtt_added_client_head_ms",
    "rtt_added_head_tail_ms",
]


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run measures."""

    mode: str
    requests: int
    max_new: int  # the prompt-heavy workload's; the decode-heavy one's is its own (128) unless `max_new_fixed`
    max_prompt: int
    concurrencies: tuple[int, ...]
    delays_ms: tuple[float, ...]
    latency_concurrency: int
    kv_cells: int
    pings: int
    serve_flags: tuple[str, ...]  # beyond sessions, KV and threads
    workloads: tuple[str, ...] = ("prompt", "decode")  # the first one's runs are also the latency runs
    max_new_fixed: bool = False  # `max_new` for every workload (--max-new)
    nice: int = 0  # the nodes' niceness (--nice)
    micro_batches: int | None = None  # the heads' --micro-batches (None: the node's default)
    seed: int = 12
    per_client: int = 0  # at concurrency c, the first per_client x c requests (0: all of them)
    reps: int = 1  # pairs of runs (single node, chain) at each scale-out concurrency; the median pair's row

    def clients_share(self, workload: str) -> int:
        """Requests per client at each concurrency (0: all of them). Fixed-shape (decode-heavy) requests
        are all alike: one per client measures them as well as more would."""
        return min(1, self.per_client) if WORKLOADS[workload].one_shape else self.per_client

    def new_tokens(self, workload: str) -> int:
        """Tokens generated per request in `workload`."""
        return WORKLOADS[workload].max_new or self.max_new if not self.max_new_fixed else self.max_new


FULL = Plan(
    mode="full",
    requests=16,
    max_new=32,
    max_prompt=256,
    concurrencies=(1, 2, 4, 8, 16),
    delays_ms=(0, 2, 5),
    latency_concurrency=8,
    kv_cells=8192,  # 16 sessions of the longest prompt-heavy request (256 + 32)
    pings=50,
    serve_flags=(),
)
# The tiny F32 model with an f32 cache and flash attention off: greedy tokens equal across batch shapes.
QUICK = Plan(
    mode="quick",
    requests=8,
    max_new=8,
    max_prompt=64,
    concurrencies=(1, 2, 4, 8, 16),
    delays_ms=(0, 2, 5),
    latency_concurrency=8,
    kv_cells=2048,
    pings=10,
    serve_flags=("--kv-type", "f32", "--flash-attn", "off"),
    workloads=("prompt",),
)


def chain_bounds(model: Path, plan: Plan, workload: str) -> list[tuple[int, int]]:
    """The chain's two layer ranges for `workload`: the placement plan's split (`neuron-tai plan`,
    bench/placement.py) for the workload's mean prompt and its generated tokens at concurrency 8,
    from per-layer costs measured on this machine with one thread (cached after the first run)."""
    buckets = WORKLOADS[workload].buckets
    prompt = statistics.fmean(min((low + high) / 2, plan.max_prompt) for low, high in buckets)
    work = PlanWorkload(prompt, plan.new_tokens(workload))
    return planned_bounds(model, 2, workload=work, concurrency=PLAN_CONCURRENCY)


class Cluster:
    """Starts the bench's processes on the topology's hosts; `procs` stops them all."""

    def __init__(self, topo: Topology, procs: Processes, plan: Plan) -> None:
        self.topo = topo
        self.procs = procs
        self.plan = plan

    def _start(self, name: str, host: str, cmd: list[str], core: int | None) -> None:
        if not self.procs.start(
            name, self.topo.command(host, cmd, core, self.plan.nice if core is not None else 0), node_ready
        ):
            crash = self.procs.crashed[name]
            raise RuntimeError(f"{name} {crash.reason}:\n" + "\n".join(crash.log_tail))

    def node(self, name: str, host: str, peer: str, model: Path, core: int, extra: list[str]) -> str:
        """A node on `host`, pinned to `core`, one thread, bound to `host`'s address towards `peer`."""
        address = f"tcp://{self.topo.address(host, peer)}:{self.topo.port()}"
        limits = [
            "--max-sessions",
            str(MAX_SESSIONS),
            "--max-waiting",
            str(MAX_SESSIONS),
            "--kv-cells",
            str(self.plan.kv_cells),
        ]
        cmd = serve_command(model, address, threads=1, flags=[*limits, *self.plan.serve_flags, *extra])
        self._start(name, host, cmd, core)
        return address

    def proxy(self, name: str, host: str, target: str, delay_ms: float) -> str:
        """A delay proxy on `host` in front of the node at `target` (a tcp:// address on `host`)."""
        ip, port = target.removeprefix("tcp://").rsplit(":", 1)
        listen = f"{ip}:{self.topo.port()}"
        cmd = [
            sys.executable,
            "-m",
            "bench.delay_proxy",
            "--listen",
            listen,
            "--to",
            f"{ip}:{port}",
            "--delay-ms",
            str(delay_ms),
        ]
        self._start(name, host, cmd, None)
        return f"tcp://{listen}"

    def client(self, host: str, args: list[str]) -> dict[str, Any]:
        """Run the load client (bench/chain_load.py) on `host`; its JSON output."""
        cmd = self.topo.command(host, [sys.executable, "-m", "bench.chain_load", *args])
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600)
        self.procs.check(f"chain_load {' '.join(args[:2])}")
        if proc.returncode != 0:
            raise RuntimeError(f"chain_load {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    def load(self, address: str, concurrencies: tuple[int, ...], tag: str, workload: str) -> list[dict[str, Any]]:
        plan = self.plan
        out = self.client(
            "client",
            [
                "run",
                address,
                "--concurrency",
                ",".join(map(str, concurrencies)),
                "--requests",
                str(plan.requests),
                "--max-new",
                str(plan.new_tokens(workload)),
                "--max-prompt",
                str(plan.max_prompt),
                "--seed",
                str(plan.seed),
                "--tag",
                tag,
                "--workload",
                workload,
                "--per-client",
                str(plan.clients_share(workload)),
            ],
        )
        return [{**run, "warm_tokens": out["warm_tokens"]} for run in out["runs"]]

    def rtt_ms(self, host: str, address: str) -> float:
        """Median round trip of a protocol ping from `host` to `address`."""
        return float(statistics.median(self.client(host, ["ping", address, "--count", str(self.plan.pings)])["rtt_ms"]))


Counters = dict[str, dict[str, float]]  # node name -> its compute counters (`Nodes.counters`)


@dataclass(frozen=True, slots=True)
class Nodes:
    """The measured nodes' addresses, each with the host it is read from."""

    single: str
    head: str
    tail: str

    def counters(self, cluster: Cluster) -> Counters:
        """Each node's compute counters so far: `step_seconds` sum (its llama_decode calls), calls, rows."""
        front = cluster.client("client", ["stats", self.single, self.head])["stats"]
        back = cluster.client("s0", ["stats", self.tail])["stats"]
        return {"single": front[self.single], "head": front[self.head], "tail": back[self.tail]}


def _tokens(run: dict[str, Any]) -> int:
    """Tokens the nodes generated for a run: its requests' and its warm-up's (one request, unmeasured)."""
    return sum(len(t) for t in run["tokens"].values()) + int(run["warm_tokens"])


def cost_per_token(one: dict[str, Any], two: dict[str, Any], spent: Counters) -> dict[str, float]:
    """Wall and compute milliseconds per generated token: what the hop adds beyond the stages' own compute
    (chain wall - head compute - tail compute), the single node's own overhead beside it; and each
    node's rows per llama_decode call."""
    n1, n2 = _tokens(one), _tokens(two)
    single_ms = 1000 * one["wall_s"] / (n1 - one["warm_tokens"])
    chain_ms = 1000 * two["wall_s"] / (n2 - two["warm_tokens"])
    head, tail = (1000 * spent[k]["step_seconds_sum"] / n2 for k in ("head", "tail"))
    rows = {
        f"{name}_rows_per_call": round((x["decode_tokens_total"] + x["prefill_tokens_total"]) / x["batches_total"], 2)
        for name, x in spent.items()
        if x["batches_total"]
    }
    return rows | {
        "single_ms_per_token": round(single_ms, 2),
        "single_compute_ms": round(1000 * spent["single"]["step_seconds_sum"] / n1, 2),
        "chain_ms_per_token": round(chain_ms, 2),
        "head_compute_ms": round(head, 2),
        "tail_compute_ms": round(tail, 2),
        "hop_ms": round(chain_ms - head - tail, 2),
    }


def halves(concurrencies: tuple[int, ...]) -> list[int]:
    """The concurrencies the single node also runs at, unswept, for the micro-batching bound at 2x."""
    return sorted({c // 2 for c in concurrencies if c >= 2 and c % 2 == 0} - set(concurrencies))


def batching_bound(half_tok_s: float | None, full_tok_s: float) -> float | None:
    """The best efficiency a 2-stage chain has at concurrency c: its head splits the c sessions
    into 2 micro-batches so both stages compute at once, so each stage computes c/2 rows per
    call. With perfectly balanced stages, no hop and no other cost, the chain makes 2x the
    single node's tok/s at c/2; efficiency is measured against 2x its tok/s at c."""
    if not half_tok_s or not full_tok_s:
        return None
    return round(half_tok_s / full_tok_s, 3)


def spoken(row: dict[str, Any]) -> str:
    """A row as the console line says it: `key value, key value`."""
    return ", ".join(f"{k} {v}" for k, v in row.items())


def median_pair(rows: list[dict[str, Any]]) -> int:
    """Which pair's efficiency is the median (of an even number of pairs, the higher middle one)."""
    ranked = sorted(range(len(rows)), key=lambda i: rows[i]["efficiency"] or 0.0)
    return ranked[len(rows) // 2]


def measured_pair(
    cluster: Cluster, nodes: Nodes, workload: str, c: int, rep: int
) -> tuple[dict[str, Any], dict[str, Any], Counters]:
    """The single node and the chain at `c`, one after the other, the single node first in even
    repetitions (`interleaved`'s order), and what each node computed meanwhile: (single run,
    chain run, spent)."""
    before = nodes.counters(cluster)
    runs = {
        system: cluster.load(
            nodes.single if system == "single" else nodes.head, (c,), f"{system}-{workload}-c{c}", workload
        )[0]
        for system in alternating(rep, ("single", "chain2"))
    }
    after = nodes.counters(cluster)
    spent = {name: {k: after[name][k] - v for k, v in was.items()} for name, was in before.items()}
    return runs["single"], runs["chain2"], spent


def pair_row(
    workload: str, c: int, one: dict[str, Any], two: dict[str, Any], spent: Counters, half: float | None
) -> dict[str, Any]:
    """One pair's figures: tok/s, efficiency against its batching bound, and costs per token."""
    efficiency = round(two["tok_s"] / (2 * one["tok_s"]), 3) if one["tok_s"] else None
    bound = batching_bound(half, one["tok_s"])
    return {
        "workload": workload,
        "concurrency": c,
        "single_tok_s": one["tok_s"],
        "chain_tok_s": two["tok_s"],
        "efficiency": efficiency,
        "batching_bound": bound,
        "share_of_bound": round(efficiency / bound, 3) if efficiency and bound else None,
        **cost_per_token(one, two, spent),
    }


def scale_out(cluster: Cluster, nodes: Nodes, workload: str) -> dict[str, Any]:
    """The chain (two cores) against the single node (one core): at each concurrency `plan.reps`
    pairs of runs in alternating order, and the median pair's row beside every pair's
    efficiency; the single node also at half of each concurrency, for the micro-batching bound.
    This host's speed drifts over seconds: a pair's two runs meet it in about the same state,
    and the median of several pairs is not moved by one caught in a slow spell."""
    rows, raw, single = [], [], {}
    extra = halves(cluster.plan.concurrencies)
    for c in sorted([*cluster.plan.concurrencies, *extra]):
        if c in extra:
            single[c] = cluster.load(nodes.single, (c,), f"single-{workload}-c{c}", workload)[0]
            raw.append({"system": "single", **single[c]})
            continue
        half = single[c // 2]["tok_s"] if c // 2 in single else None
        pairs, singles = [], []
        for rep in range(cluster.plan.reps):
            one, two, spent = measured_pair(cluster, nodes, workload, c, rep)
            raw += [{"system": "single", "rep": rep, **one}, {"system": "chain2", "rep": rep, **two}]
            pairs.append(pair_row(workload, c, one, two, spent, half))
            singles.append(one)
            print(f"scale-out pair {rep + 1}/{cluster.plan.reps}: {spoken(pairs[-1])}", flush=True)
        middle = median_pair(pairs)
        single[c] = singles[middle]
        rows.append({**pairs[middle], "pair_efficiencies": [p["efficiency"] for p in pairs]})
        print(f"scale-out {spoken(rows[-1])}", flush=True)
    return {"rows": rows, "runs": raw}


@dataclass(frozen=True, slots=True)
class DelayedChain:
    """A chain whose two links go through delay proxies of `delay_ms`, and its nodes' own addresses."""

    delay_ms: float
    entry: str  # the client's way in: the proxy in front of the head
    head: str
    tail_proxy: str  # the head's --next
    tail: str


def start_delayed_chain(cluster: Cluster, head_model: Path, tail: str, delay_ms: float) -> DelayedChain:
    name = f"{delay_ms:g}ms"
    tail_proxy = cluster.proxy(f"proxy-s0-s1-{name}", "s1", tail, delay_ms)
    head = cluster.node(f"head-{name}", "s0", "client", head_model, HEAD_CORE, head_flags(cluster.plan, tail_proxy))
    entry = cluster.proxy(f"proxy-client-s0-{name}", "s0", head, delay_ms)
    return DelayedChain(delay_ms, entry, head, tail_proxy, tail)


def latency_tolerance(cluster: Cluster, chains: list[DelayedChain], workload: str) -> dict[str, Any]:
    """Each delayed chain at the latency concurrency, and the round trip each proxy adds, measured."""
    rows, raw = [], []
    c = cluster.plan.latency_concurrency
    for chain in chains:
        client_head = cluster.rtt_ms("client", chain.entry) - cluster.rtt_ms("client", chain.head)
        head_tail = cluster.rtt_ms("s0", chain.tail_proxy) - cluster.rtt_ms("s0", chain.tail)
        run = cluster.load(chain.entry, (c,), f"delay-{chain.delay_ms:g}ms", workload)[0]
        raw.append({"delay_ms": chain.delay_ms, **run})
        rows.append(
            {
                "delay_ms": chain.delay_ms,
                "tok_s": run["tok_s"],
                "itl_p50_ms": run["itl_p50_ms"],
                "itl_p99_ms": run["itl_p99_ms"],
                "ttft_p50_ms": run["ttft_p50_ms"],
                "rtt_added_expected_ms": 2 * chain.delay_ms,
                "rtt_added_client_head_ms": round(client_head, 3),
                "rtt_added_head_tail_ms": round(head_tail, 3),
            }
        )
        print(f"latency {spoken(rows[-1])}", flush=True)
    return {"concurrency": c, "rows": rows, "runs": raw}


def mismatches(reference: dict[str, list[int]], runs: list[dict[str, Any]]) -> int:
    """Requests whose tokens differ from the reference (the single node alone, greedy)."""
    return sum(run["tokens"][rid] != tokens for run in runs for rid, tokens in reference.items())


def solo_tokens(scaled: dict[str, Any]) -> dict[str, list[int]]:
    """The single node's tokens at the lowest concurrency measured: the reference."""
    runs = [r for r in scaled["runs"] if r["system"] == "single"]
    return min(runs, key=lambda r: r["concurrency"])["tokens"]  # type: ignore[no-any-return]


def head_flags(plan: Plan, tail: str) -> list[str]:
    """A chain head's own flags: its next stage, and its micro-batches when the plan sets them."""
    mb = [] if plan.micro_batches is None else ["--micro-batches", str(plan.micro_batches)]
    return ["--next", tail, *mb]


@dataclass(frozen=True, slots=True)
class Chain:
    """A 2-stage chain of one split: its shards and its nodes' addresses."""

    bounds: tuple[tuple[int, int], ...]
    shards: tuple[Path, Path]
    head: str
    tail: str


def start_chains(cluster: Cluster, model: Path) -> dict[str, Chain]:
    """A chain for each workload's split (workloads with the same split share one); the first is
    named head/tail, the others head-CUT/tail-CUT."""
    chains: dict[tuple[tuple[int, int], ...], Chain] = {}
    splits = {w: tuple(chain_bounds(model, cluster.plan, w)) for w in cluster.plan.workloads}
    for bounds in splits.values():
        if bounds not in chains:
            suffix = f"-{bounds[0][1]}" if chains else ""
            head_model, tail_model = cached_stages(model, bounds, SHARDS)
            tail = cluster.node(f"tail{suffix}", "s1", "s0", tail_model, TAIL_CORE, [])
            head = cluster.node(f"head{suffix}", "s0", "client", head_model, HEAD_CORE, head_flags(cluster.plan, tail))
            chains[bounds] = Chain(bounds, (head_model, tail_model), head, tail)
    return {w: chains[bounds] for w, bounds in splits.items()}


def measure(plan: Plan, topo: Topology, procs: Processes, work: Path) -> dict[str, Any]:
    model = bench_model(plan.mode == "quick", work)
    cluster = Cluster(topo, procs, plan)
    single = cluster.node("single", "s0", "client", model, HEAD_CORE, [])
    by_workload = start_chains(cluster, model)
    first = plan.workloads[0]
    main = by_workload[first]
    head_model, tail_model = main.shards
    chains = [start_delayed_chain(cluster, head_model, main.tail, d) for d in plan.delays_ms]
    shown_chains = {c.bounds: f"{c.head} -> {c.tail} (layers {c.bounds})" for c in by_workload.values()}
    print(f"multihost: single {single}; chain {'; '.join(shown_chains.values())}", flush=True)  # all started
    scaled = {w: scale_out(cluster, Nodes(single, c.head, c.tail), w) for w, c in by_workload.items()}
    latency = latency_tolerance(cluster, chains, first)
    solo = {w: solo_tokens(s) for w, s in scaled.items()}
    differing = sum(
        mismatches(solo[w], [r for r in s["runs"] if r["system"] == "chain2"] + (latency["runs"] if w == first else []))
        for w, s in scaled.items()
    )
    return {
        "model": model.name,
        "bounds": [list(b) for b in main.bounds],
        "bounds_by_workload": {w: [list(b) for b in c.bounds] for w, c in by_workload.items()},
        "shards": [head_model.name, tail_model.name],
        "single_solo_tokens": solo[first],
        "scale_out": scaled[first],  # the first workload's (the latency runs use it too)
        "scale_out_by_workload": scaled,
        "latency": latency,
        "chain_token_mismatches": differing,
        "delayed_chains": [asdict(c) for c in chains],
    }


def with_options(plan: Plan, args: argparse.Namespace, parser: argparse.ArgumentParser) -> Plan:
    """The plan with the command line's overrides."""
    if args.delays:
        delays = () if args.delays == "none" else tuple(float(x) for x in args.delays.split(","))
        plan = replace(plan, delays_ms=delays)
    if args.concurrency:
        plan = replace(plan, concurrencies=tuple(int(x) for x in args.concurrency.split(",")))
    if args.workload:
        workloads = tuple(args.workload.split(","))
        if not workloads or any(w not in WORKLOADS for w in workloads):
            parser.error(f"--workload: one or more of {', '.join(WORKLOADS)}, comma-separated")
        plan = replace(plan, workloads=workloads)
    if args.requests:
        plan = replace(plan, requests=args.requests)
    if args.per_client:
        plan = replace(plan, per_client=args.per_client)
    if args.micro_batches:
        plan = replace(plan, micro_batches=args.micro_batches)
    if args.nice:
        plan = replace(plan, nice=args.nice)
    if args.reps is not None:
        if args.reps < 1:
            parser.error("--reps: at least 1")
        plan = replace(plan, reps=args.reps)
    if args.max_new:
        plan = replace(plan, max_new=args.max_new, max_new_fixed=True)
    return plan


def build_parser() -> argparse.ArgumentParser:
    """The command line (`python -m bench.multihost --help`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny test model, few requests: checks it works")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON result")
    parser.add_argument("--model", help=f"a GGUF file or a model shape (default: ${MODEL_ENV}, else gemma-3-270m)")
    parser.add_argument("--delays", help="one-way delays in ms, comma-separated (default 0,2,5; none: no latency part)")
    parser.add_argument("--concurrency", help="scale-out concurrencies, comma-separated (default 1,2,4,8,16)")
    parser.add_argument("--workload", help="prompt, decode or both (default prompt,decode; quick: prompt)")
    parser.add_argument("--requests", type=int, help="requests per run (default 16; quick 8)")
    parser.add_argument("--per-client", type=int, help="at concurrency c, only the first N x c requests (fewer reps)")
    parser.add_argument(
        "--reps", type=int, help="pairs of runs at each scale-out concurrency, the median's row (default 1)"
    )
    parser.add_argument("--max-new", type=int, help="tokens generated per request in every workload")
    parser.add_argument("--micro-batches", type=int, help="the chain heads' micro-batches (default: the node's)")
    parser.add_argument(
        "--nice", type=int, default=0, help="run the nodes at this niceness (e.g. -10: ahead of other work; root)"
    )
    parser.add_argument("--loopback", action="store_true", help="all hosts on loopback, as without privilege")
    parser.add_argument(
        "--tag",
        default=f"{os.getpid() % 65536:04x}",
        help="names the namespaces nt-TAG-HOST and links ntTAG-l*: at most 4 characters",
    )
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if not 1 <= len(args.tag) <= 4 or not args.tag.isalnum():
        parser.error("--tag: 1 to 4 letters or digits")
    plan = QUICK if args.quick else FULL
    plan = with_options(plan, args, parser)
    if args.model:
        os.environ[MODEL_ENV] = args.model
    work = WORK / "multihost"
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open_topology(HOSTS, LINKS, args.tag, loopback=args.loopback) as topo, open_processes(work / "logs") as procs:
        topology = {
            "isolated": topo.isolated,
            "note": topo.note,
            "namespaces": topo.namespaces if topo.isolated else [],
            "veths": topo.veths if topo.isolated else [],
        }
        result = measure(plan, topo, procs, work)
        stopped = {name: procs.stop(name) for name in list(procs.running)}
    report = {
        "command": command_line(),
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "plan": asdict(plan),
        "topology": topology,
        "cores": {"head": HEAD_CORE, "tail": TAIL_CORE, "single": HEAD_CORE},
        **result,
        "processes": [{"name": n, "pid": pid, "exit_status": rc} for n, (pid, rc) in procs.ended.items()],
        "crashes": [asdict(c) for c in procs.crashed.values()],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{topo.note}\n")
    print(table([row for s in result["scale_out_by_workload"].values() for row in s["rows"]], SCALE_COLUMNS))
    if result["latency"]["rows"]:
        print()
        print(table(result["latency"]["rows"], LATENCY_COLUMNS))
    print(f"\nchain tokens differing from the single node's: {result['chain_token_mismatches']} requests")
    print(f"wrote {shown(args.out)}")
    return 0 if not report["crashes"] and all(rc == 0 for rc in stopped.values() if rc is not None) else 1


if __name__ == "__main__":
    run_main(main, "every namespace, link and process the bench made was removed")
