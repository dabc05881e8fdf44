"""Time-sliced scale-out: a 2-stage chain and the one-core node it is measured against, both
loaded at once, each given the machine in turn.

    chain_sliced.py conduct MODEL SPLIT WORKLOAD C SLOT_S ROUNDS OUTDIR [SYSTEM...]

SYSTEM is `single` or `chain`, optionally `@CHECKOUT` to run another checkout's code (an A/B
of two versions of a chain); default: single chain. A stopped chain's clock runs on: its ZeroMQ
heartbeats (1 s) time out when it continues, and the head recovers its sessions, so for chains
use instead

    chain_sliced.py rounds MODEL SPLIT WORKLOAD C N ROUNDS OUTDIR SYSTEM...

every system loaded at once, idle but for its turn: each round runs the same N requests on
each system in turn, the order rotated every round.

The single node runs on core 0 with one thread; the chain's head (layers 0:SPLIT) on core 0 and
its tail (SPLIT:end) on core 1, one thread each, on loopback. Each system has its own closed-loop
client of server-side `generate` (WORKLOAD: prompt or decode, the bench's; a new request as soon
as one ends). While one system runs, the other's processes (node or stages, and client) are
stopped with SIGSTOP; the conductor rotates SLOT_S-second slots, ROUNDS rounds. A system's rate
in a slot is the tokens its client received inside it, so the host's drift falls on both alike.
Efficiency = chain rate / (2 x single rate). The nodes' `stats` are read at the end of their
slots (rows, calls, time inside llama_decode).
"""

from __future__ import annotations

import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())

SESSIONS = 16
COUNTERS = ("batches_total", "decode_rows_total", "prefill_tokens_total", "llama_decode_seconds_total")


def requests_for(model: Path, workload: str, seed: int = 7, total: int = 100000):
    from bench.workload import CORPUS, WORKLOADS, make_requests
    from engine.llama_handles import Vocabulary

    vocab = Vocabulary(model)
    corpus = vocab.tokenize(CORPUS, add_special=False)
    start = vocab.tokenize("", add_special=True)
    w = WORKLOADS[workload]
    return make_requests(corpus, total, w.max_new or 32, seed=seed, max_prompt=256,
                         bos=start[0] if start else None, buckets=w.buckets)


def drive(address: str, model: Path, workload: str, c: int, stop: Path, out: Path) -> None:
    import trio

    from bench.node_driver import generate, run_closed_loop
    from neuron_tai.client import open_client

    def until_stopped(requests):
        for r in requests:
            if stop.exists():
                return
            yield r

    async def main() -> None:
        async with open_client(address, timeout_s=900) as client:
            async def one(req):
                return await generate(client, req, f"s-{req.rid}")
            traces, _ = await run_closed_loop(until_stopped(requests_for(model, workload)), c, one)
        out.write_text(json.dumps(sorted(t for tr in traces.values() for t in tr.times)))

    trio.run(main)


def burst(address: str, model: Path, workload: str, c: int, n: int, offset: int, out: Path) -> None:
    """One closed-loop run of requests offset..offset+n-1 at concurrency c: its wall time and tokens."""
    import trio

    from bench.node_driver import generate, run_closed_loop
    from neuron_tai.client import open_client

    # SAME_SEED=S: every round serves the first n requests of seed S, as `python -m bench.chain_load
    # run --seed S --requests N` does (the multi-host bench: seed 12, 16 requests); else the next n of seed 7.
    same = os.environ.get("SAME_SEED")
    requests = requests_for(model, workload, int(same), n) if same else requests_for(model, workload)[offset : offset + n]

    async def main() -> None:
        async with open_client(address, timeout_s=900) as client:
            async def one(req):
                return await generate(client, req, f"b{offset}-{req.rid}")
            traces, wall = await run_closed_loop(requests, c, one)
        tokens = sum(len(t.times) for t in traces.values())
        out.write_text(json.dumps({"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}))

    trio.run(main)


def rounds(model: Path, split: int, workload: str, c: int, n: int, count: int, outdir: Path, specs: list[str]) -> None:
    """Every system loaded at once and idle but for its turn: each round runs the same n requests
    on each system in turn (the order rotated every round), so drift slower than a run hits all."""
    outdir.mkdir(parents=True, exist_ok=True)
    me = os.path.abspath(__file__)
    started = [start(spec, model, split, outdir) for spec in specs]
    for _, _, _, address in started:
        wait_up(address)
    runs = []
    try:
        for r in range(count):
            order = started[r % len(started):] + started[: r % len(started)]
            for name, _, counted, address in order:
                before = [stats(a) for a in counted]
                out = outdir / f"{name}-r{r}.json"
                subprocess.run([sys.executable, me, "burst", address, str(model), workload, str(c), str(n), str(r * n),
                                str(out)], check=True)
                after = [stats(a) for a in counted]
                runs.append({"system": name, "round": r, **json.loads(out.read_text()), "before": before, "after": after})
                print(f"round {r} {name}: {runs[-1]['tok_s']:.2f} tok/s", flush=True)
    finally:
        for _, nodes, _, _ in started:
            for p in nodes:
                p.terminate()
                p.wait(timeout=60)
    (outdir / "rounds.json").write_text(json.dumps(runs, indent=1))
    report_rounds(outdir)


def report_rounds(outdir: Path) -> None:
    runs = json.loads((outdir / "rounds.json").read_text())
    names = list(dict.fromkeys(r["system"] for r in runs))
    rate = {n: {r["round"]: r["tok_s"] for r in runs if r["system"] == n} for n in names}
    single = lambda n: n.startswith("single")  # noqa: E731
    for n in names:
        x = list(rate[n].values())
        print(f"{n:14s} tok/s per run: mean {statistics.mean(x):.2f} median {statistics.median(x):.2f} "
              f"min {min(x):.2f} max {max(x):.2f} ({len(x)} runs)")
    for a in names:
        for b in names:
            if a == b or (not single(b) and (single(a) or a > b)):
                continue
            scale = 2 if single(b) and not single(a) else 1
            per_round = sorted(rate[a][r] / (scale * rate[b][r]) for r in rate[a] if r in rate[b])
            what = f"efficiency {a} / (2 x {b})" if scale == 2 else f"{a} / {b}"
            print(f"{what}: per round {[round(x, 3) for x in per_round]}, median {statistics.median(per_round):.3f}; "
                  f"ratio of means {statistics.mean(rate[a].values()) / (scale * statistics.mean(rate[b].values())):.3f}")
    for n in names:
        mine = [r for r in runs if r["system"] == n]
        for i in range(len(mine[0]["after"])):
            d = {k: sum(r["after"][i][k] - r["before"][i][k] for r in mine) for k in COUNTERS}
            print(f"  {n} node {i}: calls {d['batches_total']}, rows a call "
                  f"{(d['decode_rows_total'] + d['prefill_tokens_total']) / max(d['batches_total'], 1):.2f} "
                  f"(decode {d['decode_rows_total']}, prompt {d['prefill_tokens_total']}), inside llama_decode "
                  f"{d['llama_decode_seconds_total']:.1f} s")


def stats(address: str) -> dict:
    import trio

    from neuron_tai.client import open_client

    async def get() -> dict:
        async with open_client(address, timeout_s=30) as client:
            s = await client.stats()
        return {k: s.get(k) for k in COUNTERS}

    return trio.run(get)


def up(address: str) -> bool:
    try:
        stats(address)
        return True
    except Exception:
        return False


def serve(model: Path, bind: str, core: int, log, cwd: str, *extra: str) -> subprocess.Popen:
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "neuron_tai.cli", "serve", str(model), "--bind", bind,
           "--threads", "1", "--log-level", "warning", "--max-sessions", str(SESSIONS), "--max-waiting",
           str(SESSIONS), "--kv-cells", "8192", "--lease", "900", *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)


def wait_up(address: str) -> None:
    for _ in range(600):
        if up(address):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{address} never came up")


def start(spec: str, model: Path, split: int, outdir: Path) -> tuple[str, list[subprocess.Popen], list[str], str]:
    """`single` or `chain`, each optionally `@CHECKOUT` (the code it runs; default this one):
    its name, its node processes, the addresses whose stats count, and the address its client drives."""
    from bench.processes import free_ports
    from engine.gguf_facts import read_facts

    kind, _, cwd = spec.partition("@")
    cwd = cwd or os.getcwd()
    name = kind if "@" not in spec else f"{kind}-{Path(cwd).name}"
    logs = lambda n: open(outdir / f"{n}.log", "w")  # noqa: E731
    if kind == "single":
        (port,) = free_ports(1)
        address = f"tcp://127.0.0.1:{port}"
        return name, [serve(model, address, 0, logs(name), cwd)], [address], address
    n_layer = read_facts(model).block_count
    p_head, p_tail = free_ports(2)
    a_head, a_tail = f"tcp://127.0.0.1:{p_head}", f"tcp://127.0.0.1:{p_tail}"
    tail = serve(model, a_tail, 1, logs(f"{name}-tail"), cwd, "--layers", f"{split}:{n_layer}")
    wait_up(a_tail)
    head = serve(model, a_head, 0, logs(f"{name}-head"), cwd, "--layers", f"0:{split}", "--next", a_tail,
                 "--downstream-timeout", "900")  # a stopped chain's clock runs on
    return name, [head, tail], [a_head, a_tail], a_head


def conduct(model: Path, split: int, workload: str, c: int, slot: float, rounds: int, outdir: Path,
            specs: list[str]) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    stop = outdir / "stop"
    stop.unlink(missing_ok=True)
    me = os.path.abspath(__file__)
    procs: dict[str, list[subprocess.Popen]] = {}
    counted: dict[str, list[str]] = {}
    for spec in specs:
        name, nodes, counted[name], address = start(spec, model, split, outdir)
        wait_up(address)
        client = subprocess.Popen([sys.executable, me, "drive", address, str(model), workload, str(c), str(stop),
                                   str(outdir / f"{name}.json")], stdout=open(outdir / f"{name}-client.log", "w"),
                                  stderr=subprocess.STDOUT)
        procs[name] = [*nodes, client]
    names = list(procs)
    send = lambda n, s: [p.send_signal(s) for p in procs[n]]  # noqa: E731
    for n in names:  # warm: each alone, then stopped
        for m in names:
            send(m, signal.SIGSTOP if m != n else signal.SIGCONT)
        time.sleep(2 * slot)
        send(n, signal.SIGSTOP)
    windows = []
    for r in range(rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            send(n, signal.SIGCONT)
            t0 = time.time()
            time.sleep(slot)
            t1 = time.time()
            snap = [stats(a) for a in counted[n]]
            send(n, signal.SIGSTOP)
            windows.append({"system": n, "round": r, "t0": t0, "t1": t1, "stats": snap})
            time.sleep(0.05)
    stop.write_text("stop")
    for n in names:
        send(n, signal.SIGCONT)
    for n in names:
        procs[n][-1].wait(timeout=1800)
        for p in procs[n][:-1]:
            p.terminate()
            p.wait(timeout=60)
    (outdir / "windows.json").write_text(json.dumps(windows, indent=1))
    report(outdir)


def report(outdir: Path) -> None:
    windows = json.loads((outdir / "windows.json").read_text())
    names = list(dict.fromkeys(w["system"] for w in windows))
    times = {n: json.loads((outdir / f"{n}.json").read_text()) for n in names}
    rates: dict[str, dict[int, float]] = {n: {} for n in names}
    for w in windows:
        ts = times[w["system"]]
        rates[w["system"]][w["round"]] = (bisect.bisect_left(ts, w["t1"]) - bisect.bisect_left(ts, w["t0"])) / (w["t1"] - w["t0"])
    for n, v in rates.items():
        x = list(v.values())
        print(f"{n:14s} tok/s per slot: mean {statistics.mean(x):.2f} median {statistics.median(x):.2f} "
              f"min {min(x):.2f} max {max(x):.2f} ({len(x)} slots)")
    for a in names:
        for b in names:
            single = lambda n: n.startswith("single")  # noqa: E731
            if a == b or (not single(b) and (single(a) or a > b)):
                continue
            scale = 2 if single(b) and not single(a) else 1  # a chain has two cores to the single node's one
            per_round = [rates[a][r] / (scale * rates[b][r]) for r in rates[a] if rates[b].get(r)]
            q = statistics.quantiles(per_round, n=4)
            what = f"efficiency {a} / (2 x {b})" if scale == 2 else f"{a} / {b}"
            print(f"{what}: ratio of means {statistics.mean(rates[a].values()) / (scale * statistics.mean(rates[b].values())):.3f}; "
                  f"per round median {statistics.median(per_round):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
    for n in names:
        mine = [w for w in windows if w["system"] == n]
        for i, part in enumerate(["head", "tail"] if len(mine[0]["stats"]) == 2 else ["node"]):
            a, b = mine[0]["stats"][i], mine[-1]["stats"][i]
            d = {k: b[k] - a[k] for k in COUNTERS}
            active = sum(w["t1"] - w["t0"] for w in mine[1:])
            print(f"  {n} {part}: over its last {len(mine) - 1} slots ({active:.0f} s): calls {d['batches_total']}, rows a call "
                  f"{(d['decode_rows_total'] + d['prefill_tokens_total']) / max(d['batches_total'], 1):.2f} "
                  f"(decode {d['decode_rows_total']}, prompt {d['prefill_tokens_total']}), inside llama_decode "
                  f"{d['llama_decode_seconds_total']:.1f} s (includes calls a stop stretched)")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "drive":
        drive(args[0], Path(args[1]), args[2], int(args[3]), Path(args[4]), Path(args[5]))
    elif cmd == "conduct":
        conduct(Path(args[0]), int(args[1]), args[2], int(args[3]), float(args[4]), int(args[5]), Path(args[6]),
                args[7:] or ["single", "chain"])
    elif cmd == "burst":
        burst(args[0], Path(args[1]), args[2], int(args[3]), int(args[4]), int(args[5]), Path(args[6]))
    elif cmd == "rounds":
        rounds(Path(args[0]), int(args[1]), args[2], int(args[3]), int(args[4]), int(args[5]), Path(args[6]), args[7:])
    elif cmd == "report-rounds":
        report_rounds(Path(args[0]))
    elif cmd == "report":
        report(Path(args[0]))
