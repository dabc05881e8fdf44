"""`just chaos`: hostile peers against a node and chains while valid sessions generate on them.

The tiny test model, every node one llama.cpp thread and a short lease (`Plan.lease_s`):
- `single` (N): the whole model, batch-invariant;
- `chain-head` -> `chain-tail` (H -> T): the model in two stages, batch-invariant;
- `restart-head` -> `restart-tail` (H2 -> T2): a chain whose tail is stopped (SIGSTOP: the
  head must notice by its heartbeats), killed and restarted, again and again;
- `malformed-head` -> `fake-stage` (H3 -> F): a head whose next stage answers garbage
  (bench/fake_stage.py).
H2 and H3 do not recover sessions (`--recovery-attempts 0`): they show the failure path,
a `downstream` answered and the step rolled back.

Each valid request first runs alone on N and on H: its reference. Then, for `Plan.attack_s`,
hostile peer processes (bench/chaos_peer.py) attack every node with every class of bad input
while valid sessions generate on N and H (greedy, the node running the token loop), each
compared token for token with its reference; a driver runs sessions through H2 while its
tail comes and goes, another through H3; a prober process pings every node every 20 ms; each
node's memory is read from /proc. Once every client has left, the run waits one lease (and a
little) and reads every node's `stats`: no session may be held anywhere.

It exits 1 on a crashed node, memory over the bound, a token mismatch, a valid session that
did not complete, a session still held, a malformed reply not answered `downstream`, a hostile
message never answered, or fewer hostile messages than the plan's minimum. Everything it
starts is stopped on the way out, also on Ctrl-C or SIGTERM (exit 130).

Then, unless `--part hostile`, the failover part runs in a process of its own
(bench/chaos_failover.py): replicas of a 3-stage chain killed, hung and cut off while
sessions generate. `--part failover` runs it alone. The exit status is 1 if either failed.

    python -m bench.chaos           # full, about 2 minutes: evidence/chaos.json, then evidence/chaos_failover.json
    python -m bench.chaos quick     # each part under 90 s: .bench/chaos-quick.json, .bench/chaos-failover-quick.json
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import trio

from bench import chaos_report
from bench.chaos_drivers import (
    COUNTERS,
    Outcomes,
    ValidRun,
    held,
    malformed_load,
    node_stats,
    restart_load,
    solo_tokens,
    stats_peaks,
    valid_load,
)
from bench.common import WORK, shown, tiny_model
from bench.hostile import Target
from bench.interrupts import run_main, run_until_interrupted
from bench.processes import Processes, free_ports, node_ready, open_processes, serve_command
from bench.progress import say
from bench.rss import MemoryTrack
from bench.workload import CORPUS, Request, make_requests
from neuron_tai.client import open_client
from neuron_tai.shard import write_stages
from testkit.models import TinySpec, vocabulary

LEASE_MARGIN_S = 2.0  # past one lease, before `stats` is read: the node's lease timer and the chain's closes
MEMORY_PERIOD_S = 0.5
PROBE_MAX_S = 900.0  # the prober stops by itself after this long, whatever happens to the bench


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What one chaos run does, and the bounds it is judged by."""

    mode: str
    attack_s: float
    lease_s: float
    quotas: tuple[tuple[str, int], ...]  # hostile peer role -> messages over the attack
    never_read_per_connection: int = 4000
    oversize_per_target: int
    valid_requests: int
    valid_max_new: int
    valid_concurrency: int  # per node (N and H)
    valid_think_s: float  # each valid client's pause between sessions
    malformed_workers: int
    kill_every_s: float  # the restarted tail: up this long between cycles,
    freeze_s: float  # stopped (SIGSTOP) this long in every other cycle, then killed (SIGKILL),
    down_s: float  # down this long, then started again
    min_hostile: int
    quiet_s: float  # pings of the idle nodes before the attack
    rss_peak_mib: float = 512.0  # no node's VmHWM above this
    rss_final_mib: float = 256.0  # no node's VmRSS above this once the clients have left
    # The node's default cache: batch-invariant nodes hold closed sessions' cells until a compaction
    # frees them, so under steady traffic the cache must be compacted again and again.
    kv_cells: int = 4096
    max_sessions: int = 32
    seed: int = 7


FULL = Plan(
    mode="full",
    attack_s=90.0,
    lease_s=3.0,
    quotas=(
        ("garbage", 60_000),
        ("fields", 25_000),
        ("flood", 25_000),
        ("huge", 500),
        ("never_read", 32_000),
        ("vanish", 1200),
    ),
    oversize_per_target=2,
    valid_requests=6,
    valid_max_new=24,
    valid_concurrency=3,
    valid_think_s=0.5,
    malformed_workers=2,
    kill_every_s=5.0,
    freeze_s=4.0,
    down_s=1.0,
    min_hostile=100_000,
    quiet_s=5.0,
)
QUICK = Plan(
    mode="quick",
    attack_s=15.0,
    lease_s=2.0,
    quotas=(("garbage", 4000), ("fields", 2000), ("flood", 2000), ("huge", 40), ("never_read", 8000), ("vanish", 120)),
    oversize_per_target=1,
    valid_requests=3,
    valid_max_new=12,
    valid_concurrency=2,
    valid_think_s=0.2,
    malformed_workers=1,
    kill_every_s=1.0,
    freeze_s=3.5,
    down_s=0.5,
    min_hostile=10_000,
    quiet_s=2.0,
)

SINGLE, HEAD, TAIL, FAKE = "single", "chain-head", "chain-tail", "fake-stage"
RESTART_HEAD, RESTART_TAIL, MALFORMED_HEAD = "restart-head", "restart-tail", "malformed-head"
ATTACKED = (SINGLE, HEAD, TAIL, RESTART_HEAD, MALFORMED_HEAD)
ROLE_TARGETS = {
    "garbage": ATTACKED,
    "fields": ATTACKED,
    "flood": ATTACKED,
    "huge": ATTACKED,
    "never_read": (SINGLE, HEAD, RESTART_HEAD, MALFORMED_HEAD),
    "vanish": (SINGLE, HEAD, RESTART_HEAD, MALFORMED_HEAD),
}


def serve(model: Path, address: str, plan: Plan, *extra: str) -> list[str]:
    flags = ["--lease", f"{plan.lease_s:g}", "--max-sessions", str(plan.max_sessions), *extra]
    return serve_command(model, address, threads=1, flags=flags)


class RestartedTail:
    """The restart chain's tail: one process at a time, each incarnation under a name of its own."""

    def __init__(self, procs: Processes, cmd: list[str]) -> None:
        self.procs = procs
        self.cmd = cmd
        self.incarnation = 1  # the first is started like the other nodes, as RESTART_TAIL
        self.killed: list[str] = []

    @property
    def name(self) -> str:
        return RESTART_TAIL if self.incarnation == 1 else f"{RESTART_TAIL}.{self.incarnation}"

    def spawn(self) -> None:
        self.incarnation += 1
        self.procs.spawn(self.name, self.cmd)

    async def start(self, timeout_s: float = 120.0) -> bool:
        """Start the next incarnation (from the event loop's thread) and wait until it is ready."""
        self.spawn()
        while (outcome := self.procs.poll_ready(self.name, node_ready, timeout_s)) is None:
            await trio.sleep(0.05)
        return outcome

    def pause(self) -> None:
        self.procs.signal(self.name, signal.SIGSTOP)

    def kill(self) -> None:
        self.killed.append(self.name)
        self.procs.kill(self.name)


async def tail_cycles(tail: RestartedTail, plan: Plan, until: float, t0: float) -> list[dict[str, Any]]:
    """Stop (every other cycle), kill and restart the tail for as long as a whole cycle fits before `until`."""
    cycles: list[dict[str, Any]] = []
    restart_budget = 6.0

    def now() -> float:
        return round(trio.current_time() - t0, 3)

    for k in range(1, 10_000):
        freeze = plan.freeze_s if k % 2 else 0.0
        if trio.current_time() + plan.kill_every_s + freeze + plan.down_s + restart_budget > until:
            break
        await trio.sleep(plan.kill_every_s)
        cycle: dict[str, Any] = {"cycle": k, "name": tail.name, "stopped_s": freeze}
        if freeze:
            cycle["stopped_at"] = now()
            tail.pause()
            await trio.sleep(freeze)
        cycle["killed_at"] = now()
        tail.kill()
        await trio.sleep(plan.down_s)
        cycle["restarted_at"] = now()
        cycle["ready"] = await tail.start()
        cycle["ready_at"] = now()
        cycles.append(cycle)
        say(f"restart tail: cycle {k} ({'stopped, ' if freeze else ''}killed, restarted as {tail.name})")
        if not cycle["ready"]:
            break
    return cycles


async def watch(procs: Processes) -> None:
    """Record a crash the moment it happens (the restarting tail's own start records its crash itself)."""
    while True:
        procs.check("the chaos run")
        await trio.sleep(0.2)


async def sample_memory(procs: Processes, tracks: dict[str, MemoryTrack], t0: float) -> None:
    while True:
        now = time.monotonic() - t0
        for name, proc in list(procs.running.items()):
            if name == FAKE:
                continue  # the bench's own broken stage: its memory is not the node's
            track = tracks.setdefault(name, MemoryTrack(proc.pid))
            track.sample(now)
        await trio.sleep(MEMORY_PERIOD_S)


async def run_peer(cmd: list[str], out: Path, log: Path, *, task_status: trio.TaskStatus[trio.Process]) -> None:
    """A peer process whose stdout (one JSON line) goes to `out`; cancelled, it gets SIGTERM, then SIGKILL."""
    with out.open("wb") as stdout, log.open("wb") as stderr:
        await trio.run_process(cmd, stdout=stdout, stderr=stderr, check=False, task_status=task_status)


def read_peer(out: Path) -> dict[str, Any] | None:
    try:
        lines = out.read_text().strip().splitlines()
        return json.loads(lines[-1]) if lines else None  # type: ignore[no-any-return]
    except (OSError, json.JSONDecodeError):
        return None


@dataclass(slots=True)
class Run:
    """One run's processes and what it found, filled in as it goes."""

    plan: Plan
    procs: Processes
    work: Path
    addresses: dict[str, str]
    tail: RestartedTail
    tracks: dict[str, MemoryTrack] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    bench_errors: list[str] = field(default_factory=list)

    @property
    def peers_dir(self) -> Path:
        """Where the hostile peers and the prober read their targets and write their results."""
        return self.work / "peers"


async def targets(run: Run) -> dict[str, Target]:
    """What the hostile peers need to know of each attacked node, asked of the nodes themselves."""
    async with open_client(run.addresses[SINGLE], timeout_s=30) as client:
        stage = (await client.open("facts", 8)).stage
        await client.close("facts")
    out = {}
    for name in ATTACKED:
        stats = await node_stats(run.addresses[name])
        if stats is None:
            raise RuntimeError(f"{name} does not answer `stats`")
        limits = {k: stats[k] for k in ("max_text_bytes", "max_text_tokens", "max_header_bytes", "max_message_bytes")}
        address = run.addresses[name]
        out[name] = Target(
            name, address, first=name != TAIL, last=True, n_vocab=stage.n_vocab, n_embd=stage.n_embd, **limits
        )
    return out


async def valid_requests(run: Run) -> list[Request]:
    """The report's workload (bench/workload.py), short prompts, tokenized by the node itself."""
    async with open_client(run.addresses[SINGLE], timeout_s=30) as client:
        corpus = await client.tokenize(CORPUS, add_special=False)
        start = await client.tokenize("", add_special=True)
    bos = start[0] if start else None
    plan = run.plan
    return make_requests(corpus, plan.valid_requests, plan.valid_max_new, seed=plan.seed, max_prompt=48, bos=bos)


def peer_command(role: str, targets_file: Path, seconds: float, *options: str) -> list[str]:
    """A hostile peer's (or the prober's) command line: bench/chaos_peer.py."""
    peer = [sys.executable, "-m", "bench.chaos_peer", role]
    return [*peer, "--targets", str(targets_file), "--seconds", f"{seconds:g}", *options]


def attacker_command(role: str, targets_file: Path, plan: Plan, quota: int, seed: int) -> list[str]:
    options = ["--quota", str(quota), "--seed", str(seed)]
    if role == "huge":
        options += ["--oversize", str(plan.oversize_per_target)]
    if role == "never_read":
        options += ["--per-connection", str(plan.never_read_per_connection)]
    return peer_command(role, targets_file, plan.attack_s, *options)


@dataclass(slots=True)
class Attack:
    """What the attack phase saw: the valid sessions, the drivers' outcomes, the tail's cycles
    and each attacked node's stats peaks."""

    valid: dict[str, ValidRun] = field(default_factory=lambda: {SINGLE: ValidRun(), HEAD: ValidRun()})
    restarts: Outcomes = field(default_factory=Outcomes)
    malformed: Outcomes = field(default_factory=Outcomes)
    cycles: list[dict[str, Any]] = field(default_factory=list)
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0


async def attack(run: Run, t0: float) -> None:
    """Prober up, solo runs, then the hostile peers beside valid sessions; after one lease, what
    every node holds."""
    peers_dir = run.peers_dir
    peers_dir.mkdir(parents=True, exist_ok=True)
    files = target_files(await targets(run), peers_dir)
    requests = await valid_requests(run)
    async with trio.open_nursery() as nursery:
        probe_cmd = peer_command("probe", files["probe"], PROBE_MAX_S)
        probe = await nursery.start(partial(run_peer, probe_cmd, peers_dir / "probe.json", peers_dir / "probe.log"))
        await trio.sleep(run.plan.quiet_s)  # the prober's pings of idle nodes: the latency the attack is compared with
        solo = await solo_runs(run, requests)
        seen = await under_attack(run, files, requests, solo, t0)
        probe.send_signal(signal.SIGTERM)
    stats = await stats_after_lease(run, t0)
    record_attack(run, seen, solo, stats)


def target_files(nodes: dict[str, Target], peers_dir: Path) -> dict[str, Path]:
    """Each hostile role's targets (and the prober's), as the file its peer process reads."""
    files: dict[str, Path] = {}
    for role, names in (*ROLE_TARGETS.items(), ("probe", ATTACKED)):
        files[role] = peers_dir / f"{role}.targets.json"
        files[role].write_text(json.dumps([asdict(nodes[n]) for n in names]))
    return files


async def solo_runs(run: Run, requests: list[Request]) -> dict[str, dict[int, list[int]]]:
    """Each valid request alone on the single node and on the chain: the tokens the attack must not change."""
    plan, addresses = run.plan, run.addresses
    say(f"solo runs: {len(requests)} requests, {plan.valid_max_new} tokens each, alone on {SINGLE} and {HEAD}")
    solo = {
        SINGLE: await solo_tokens(addresses[SINGLE], requests, "solo-single"),
        HEAD: await solo_tokens(addresses[HEAD], requests, "solo-chain"),
    }
    for track in run.tracks.values():
        track.before_mib = track.samples[-1][1] if track.samples else None
    return solo


async def under_attack(
    run: Run, files: dict[str, Path], requests: list[Request], solo: dict[str, dict[int, list[int]]], t0: float
) -> Attack:
    """The hostile peers, the valid sessions, the tail's restarts and the malformed next stage, for
    `attack_s`; returns once every peer has sent its last and every valid session in flight ended."""
    plan, addresses, peers_dir = run.plan, run.addresses, run.peers_dir
    prompt = list(requests[0].prompt[:8])
    say(
        f"attack: {plan.attack_s:g} s, {sum(q for _, q in plan.quotas)} messages from "
        f"{len(plan.quotas)} hostile peers, valid sessions on {SINGLE} and {HEAD}"
    )
    seen = Attack(start=time.time())
    stop, settled = trio.Event(), trio.Event()  # settled: the restarted tail's last cycle is over
    async with trio.open_nursery() as attackers:
        for seed, (role, quota) in enumerate(plan.quotas):
            cmd = attacker_command(role, files[role], plan, quota, plan.seed + seed)
            await attackers.start(partial(run_peer, cmd, peers_dir / f"{role}.json", peers_dir / f"{role}.log"))
        for name in (SINGLE, HEAD):
            load = (addresses[name], requests, solo[name], stop, plan.valid_concurrency, plan.valid_think_s)
            attackers.start_soon(valid_load, *load, f"valid-{name}", seen.valid[name])
        attackers.start_soon(restart_load, addresses[RESTART_HEAD], prompt, stop, settled, t0, seen.restarts)
        attackers.start_soon(
            malformed_load, addresses[MALFORMED_HEAD], prompt, stop, plan.malformed_workers, seen.malformed
        )

        async def cycle_tail() -> None:
            try:
                seen.cycles.extend(await tail_cycles(run.tail, plan, trio.current_time() + plan.attack_s, t0))
            finally:
                settled.set()

        attackers.start_soon(cycle_tail)
        for name in ATTACKED:
            attackers.start_soon(stats_peaks, addresses[name], stop, seen.peaks.setdefault(name, {}))
        await trio.sleep(plan.attack_s)
        stop.set()
        say("attack over: waiting for the peers' last replies and the valid sessions in flight")
    seen.end = time.time()
    return seen


async def stats_after_lease(run: Run, t0: float) -> dict[str, dict[str, Any] | None]:
    """Every client has left: one lease later, each node's `stats` (and its memory, sampled)."""
    left = trio.current_time()
    say(f"every client has left; waiting one lease ({run.plan.lease_s:g} s) and {LEASE_MARGIN_S:g} s")
    await trio.sleep_until(left + run.plan.lease_s + LEASE_MARGIN_S)
    addresses = run.addresses
    stats = {
        name: await node_stats(addresses[RESTART_TAIL if name == run.tail.name else name])
        for name in (SINGLE, HEAD, TAIL, RESTART_HEAD, run.tail.name, MALFORMED_HEAD)
    }
    now = time.monotonic() - t0
    for name, track in run.tracks.items():
        if name in run.procs.running and track.sample(now) is not None:
            track.final_mib = track.samples[-1][1]
    return stats


def record_attack(
    run: Run, seen: Attack, solo: dict[str, dict[int, list[int]]], stats: dict[str, dict[str, Any] | None]
) -> None:
    """The attack's part of the result: what each peer and the prober wrote, and what the nodes kept."""
    peers_dir = run.peers_dir
    peers = []
    for role, _ in run.plan.quotas:
        got = read_peer(peers_dir / f"{role}.json")
        if got is None:
            run.bench_errors.append(f"hostile peer {role} wrote no result (log {shown(peers_dir / f'{role}.log')})")
        else:
            peers.append(got)
    probed = read_peer(peers_dir / "probe.json")
    if probed is None:
        run.bench_errors.append("the prober wrote no result")
    run.result.update(
        attack_window={"start": seen.start, "end": seen.end, "seconds": round(seen.end - seen.start, 1)},
        peers=peers, solo={n: {str(k): v for k, v in s.items()} for n, s in solo.items()},
        valid={n: v.report() for n, v in seen.valid.items()},
        tail_restart=restart_report(seen.restarts, seen.cycles), malformed_next=seen.malformed.report(),
        ping=chaos_report.ping_phases(probed["samples"] if probed else {}, (seen.start, seen.end)),
        stats_peaks_under_attack=seen.peaks,
        after_lease={n: None if s is None else held(s) for n, s in stats.items()},
        node_counters={n: {k: s.get(k) for k in (*COUNTERS, "downstream")} for n, s in stats.items() if s is not None},
        drivers_sent={"tail_restart": seen.restarts.sent, "malformed_next": seen.malformed.sent},
    )  # fmt: skip


def restart_report(out: Outcomes, cycles: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cycle: how soon after the tail went away a request was answered with an error (the head
    noticed), and how soon after the tail was ready again a session went through."""
    timeline = out.timeline
    for c in cycles:
        gone = c.get("stopped_at", c["killed_at"])
        failed = next(((t, o, s) for t, o, s in timeline if t + s >= gone and o != "ok"), None)
        c["first_error"] = (
            None
            if failed is None
            else {"outcome": failed[1], "answered_after_s": round(failed[0] + failed[2] - gone, 3)}
        )
        ok = next((t + s for t, o, s in timeline if t >= c["ready_at"] and o == "ok"), None)
        c["first_ok_after_ready_s"] = None if ok is None else round(ok - c["ready_at"], 3)
    downstream = [s for _, o, s in timeline if o.endswith("downstream")]
    return {
        **out.report(),
        "outcomes": dict(out.generates),
        "cycles": cycles,
        "recovered_after_last_restart": bool(cycles) and cycles[-1]["first_ok_after_ready_s"] is not None,
        "downstream_answer_s_max": round(max(downstream), 3) if downstream else None,
    }


def start_nodes(procs: Processes, plan: Plan, work: Path) -> tuple[dict[str, str], RestartedTail]:
    model = tiny_model(work)
    head_model, tail_model = write_stages(model, work / "shards", [(0, 2), (2, 4)])
    ports = free_ports(7)
    names = (SINGLE, HEAD, TAIL, RESTART_HEAD, RESTART_TAIL, MALFORMED_HEAD, FAKE)
    addresses = {name: f"tcp://127.0.0.1:{port}" for name, port in zip(names, ports, strict=True)}
    invariant = ["--batch-invariant", "--flash-attn", "on", "--kv-cells", str(plan.kv_cells)]
    tail = RestartedTail(procs, serve(tail_model, addresses[RESTART_TAIL], plan))
    starts: list[tuple[str, list[str]]] = [
        (RESTART_TAIL, tail.cmd),
        (TAIL, serve(tail_model, addresses[TAIL], plan, *invariant)),
        (SINGLE, serve(model, addresses[SINGLE], plan, *invariant)),
        (HEAD, serve(head_model, addresses[HEAD], plan, *invariant, "--next", addresses[TAIL],
                     "--downstream-timeout", "10")),
        (RESTART_HEAD, serve(head_model, addresses[RESTART_HEAD], plan, "--next", addresses[RESTART_TAIL],
                             "--downstream-timeout", "10", "--recovery-attempts", "0")),
        (FAKE, [sys.executable, "-m", "bench.fake_stage", "--bind", addresses[FAKE], "--n-vocab",
                str(len(vocabulary()[0])), "--n-embd", str(TinySpec().n_embd)]),
        (MALFORMED_HEAD, serve(head_model, addresses[MALFORMED_HEAD], plan, "--next", addresses[FAKE],
                               "--downstream-timeout", "1", "--recovery-attempts", "0")),
    ]  # fmt: skip
    for name, cmd in starts:
        if not procs.start(name, cmd, node_ready):
            raise RuntimeError(f"{name} did not start:\n" + "\n".join(procs.crashed[name].log_tail))
    return addresses, tail


async def measure(run: Run) -> dict[str, Any]:
    t0 = time.monotonic()
    async with trio.open_nursery() as background:
        background.start_soon(watch, run.procs)
        background.start_soon(sample_memory, run.procs, run.tracks, t0)
        await attack(run, t0)
        background.cancel_scope.cancel()
    return run.result


def fake_counts(log: Path) -> dict[str, int]:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("counts "):
            return json.loads(line.removeprefix("counts "))  # type: ignore[no-any-return]
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=["full", "quick"], default="full")
    parser.add_argument(
        "--part",
        choices=["both", "hostile", "failover"],
        default="both",
        help="hostile peers, failing replicas (bench/chaos_failover.py), or both in turn",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where quick writes its JSON (default .bench/chaos-quick.json; "
        "the failover part's goes beside it, named *-failover.json)",
    )
    parser.add_argument("--attack-s", type=float, help="the attack's length, in seconds (the plan's by default)")
    args = parser.parse_args()
    if args.part == "failover":
        return failover_part(args.mode, args.out)
    status = hostile_part(args)
    if args.part == "both":
        out = None if args.out is None else args.out.with_name(f"{args.out.stem}-failover.json")
        status = max(status, failover_part(args.mode, out))
    return status


def failover_part(mode: str, out: Path | None) -> int:
    """bench/chaos_failover.py in a process of its own: it moves into a network namespace, and the
    client's ZeroMQ context (one per process, its I/O threads made with it) must be made there."""
    cmd = [sys.executable, "-m", "bench.chaos_failover", mode, *(["--out", str(out)] if out else [])]
    return subprocess.run(cmd, check=False).returncode


def hostile_part(args: argparse.Namespace) -> int:
    """The hostile peers' part: 0 when it passed."""
    plan = FULL if args.mode == "full" else QUICK
    if args.attack_s:
        plan = replace(plan, attack_s=args.attack_s)
    work = WORK / f"chaos-{plan.mode}"
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    wall = time.monotonic()
    say(f"chaos {plan.mode}: starting the nodes on the tiny model")
    with open_processes(work / "logs") as procs:
        addresses, tail = start_nodes(procs, plan, work)
        run = Run(plan, procs, work, addresses, tail)
        trio.run(run_until_interrupted, partial(measure, run))
        stopped = {name: procs.stop(name) for name in list(procs.running)}
    say(f"stopped every process: {stopped}")
    result = run.result
    result["memory"] = chaos_report.memory_rows(run.tracks, plan.rss_peak_mib, plan.rss_final_mib)
    result["processes"] = [
        {"name": n, "pid": pid, "exit_status": rc, "killed_on_purpose": n in tail.killed}
        for n, (pid, rc) in procs.ended.items()
    ]
    result["crashes"] = [asdict(c) for c in procs.crashed.values()]
    result["fake_stage_replies"] = fake_counts(procs.log(FAKE))
    result["bench_errors"] = run.bench_errors
    classes = chaos_report.hostile_classes(result.pop("peers"), result.pop("drivers_sent"))
    result["hostile"] = {"classes": classes, "total": sum(c["sent"] for c in classes.values())}
    plan_row = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(plan).items()}
    found = chaos_report.failures(result, plan_row)
    payload = {
        "started": started,
        "seconds": round(time.monotonic() - wall, 1),
        "plan": plan_row,
        "topology": {name: shown(a) for name, a in addresses.items()},
        "model": "tiny-llama (testkit.models)",
        "passed": not found,
        "failures": found,
        **result,
    }
    print(chaos_report.console(result))
    return chaos_report.publish(payload, "chaos.json", args.out, WORK / "chaos-quick.json", "chaos")


if __name__ == "__main__":
    run_main(main, "every process the chaos run started was stopped")
