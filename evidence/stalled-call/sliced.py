"""Time-sliced comparison: every system loaded at once, each given the machine in turn.

    sliced.py conduct MODEL C SLOT_S ROUNDS OUTDIR [systems...]

Each system (node + its client, llama-server + its client, the bare loop) runs its own closed
loop in processes of its own. All but one are SIGSTOPped; the conductor rotates which one runs,
SLOT_S seconds each, ROUNDS rounds (order rotated each round). A system's throughput in a slot
is the tokens its client received inside that slot over the slot's length; the host's drift
(seconds to minutes) then hits every system alike, and each round gives a ratio.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())

CTX_PER_SLOT = 512
SLOTS = 16


def requests_for(model: Path, n: int, max_new: int):
    from bench.workload import CORPUS, DECODE_HEAVY, make_requests
    from engine.llama_handles import Vocabulary

    vocab = Vocabulary(model)
    corpus = vocab.tokenize(CORPUS, add_special=False)
    start = vocab.tokenize("", add_special=True)
    return make_requests(corpus, n, max_new, seed=7, max_prompt=256, bos=start[0] if start else None,
                         buckets=DECODE_HEAVY.buckets)


def until_stopped(requests, stop: Path):
    for r in requests:
        if stop.exists():
            return
        yield r


def dump(out: Path, traces) -> None:
    times = sorted(t for tr in traces for t in tr.times)
    out.write_text(json.dumps(times))


def drive_node(address: str, model: Path, c: int, stop: Path, out: Path) -> None:
    import trio

    from bench.node_driver import generate, run_closed_loop
    from neuron_tai.client import open_client

    reqs = requests_for(model, 100000, 128)

    async def main() -> None:
        async with open_client(address, timeout_s=600) as client:
            async def one(req):
                return await generate(client, req, f"s-{req.rid}")
            traces, _ = await run_closed_loop(until_stopped(reqs, stop), c, one)
        dump(out, traces.values())

    trio.run(main)


def drive_server(port: int, model: Path, c: int, stop: Path, out: Path) -> None:
    reqs = requests_for(model, 100000, 128)
    traces, _ = closed_loop_gen(port, reqs, c, stop)
    dump(out, traces)


def closed_loop_gen(port, reqs, c, stop):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from bench.server_peer import complete

    pending = until_stopped(reqs, stop)
    lock = threading.Lock()
    traces = []

    def worker() -> None:
        while True:
            with lock:
                req = next(pending, None)
            if req is None:
                return
            traces.append(complete(port, req))

    with ThreadPoolExecutor(c) as pool:
        for f in [pool.submit(worker) for _ in range(c)]:
            f.result()
    return traces, 0.0


def drive_bare(model: Path, c: int, stop: Path, out: Path) -> None:
    from bench.bare_loop import BareLoop, _wave
    from engine.backend import ContextConfig

    reqs = requests_for(model, 100000, 128)
    calls = []

    class Logged(BareLoop):
        def decode(self, *, prefill: bool) -> None:
            before = self.counters["llama_decode_s"]
            super().decode(prefill=prefill)
            calls.append((time.perf_counter(), self.counters["llama_decode_s"] - before, self.batch.n_tokens, prefill))

    bare = Logged(model, ContextConfig(n_seq_max=16, n_ctx=16 * CTX_PER_SLOT, n_batch=512, n_ubatch=512, n_threads=2))
    traces = []
    it = until_stopped(reqs, stop)
    while True:
        wave = [r for _, r in zip(range(c), it)]
        if len(wave) < c:
            break
        traces += _wave(bare, wave)
    dump(out, traces)
    out.with_suffix(".calls.json").write_text(json.dumps(calls))


def group_of(pid: int) -> list[int]:
    return [pid]


def conduct(model: Path, c: int, slot: float, rounds: int, outdir: Path, systems: list[str]) -> None:
    from bench.llama_server import cached_binary
    from bench.processes import free_ports
    from bench.server_peer import healthy, server_command
    from engine.llama_handles import weight_placement

    outdir.mkdir(parents=True, exist_ok=True)
    stop = outdir / "stop"
    stop.unlink(missing_ok=True)
    ports = free_ports(2)
    py = sys.executable
    me = os.path.abspath(__file__)
    procs: dict[str, list[subprocess.Popen]] = {}
    logs = lambda n: open(outdir / f"{n}.log", "w")  # noqa: E731
    if "node" in systems:
        addr = f"tcp://127.0.0.1:{ports[0]}"
        node = subprocess.Popen([py, "-m", "neuron_tai.cli", "serve", str(model), "--bind", addr, "--threads", "2",
                                 "--log-level", "warning", "--max-sessions", str(SLOTS), "--max-waiting", str(SLOTS),
                                 "--kv-cells", "4096", "--lease", "600"], stdout=logs("node"), stderr=subprocess.STDOUT)
        time.sleep(1)
        wait_for(lambda: node_up(addr))
        procs["node"] = [node, subprocess.Popen([py, me, "drive-node", addr, str(model), str(c), str(stop),
                                                 str(outdir / "node.json")], stdout=logs("node-client"),
                                                stderr=subprocess.STDOUT)]
    if "server" in systems:
        cmd = server_command(cached_binary(), model, ports[1], SLOTS, CTX_PER_SLOT, 2, weight_placement(model))
        srv = subprocess.Popen(cmd, stdout=logs("server"), stderr=subprocess.STDOUT)
        wait_for(lambda: healthy(ports[1]))
        procs["server"] = [srv, subprocess.Popen([py, me, "drive-server", str(ports[1]), str(model), str(c), str(stop),
                                                  str(outdir / "server.json")], stdout=logs("server-client"),
                                                 stderr=subprocess.STDOUT)]
    if "bare" in systems:
        procs["bare"] = [subprocess.Popen([py, me, "drive-bare", str(model), str(c), str(stop),
                                           str(outdir / "bare.json")], stdout=logs("bare"), stderr=subprocess.STDOUT)]
    names = list(procs)
    send = lambda n, s: [p.send_signal(s) for p in procs[n]]  # noqa: E731
    for n in names:  # warm: each alone for a few slots' time, then stopped
        for m in names:
            send(m, signal.SIGSTOP if m != n else signal.SIGCONT)
        time.sleep(3 * slot)
        send(n, signal.SIGSTOP)
    windows: list[tuple[str, int, float, float]] = []
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            send(n, signal.SIGCONT)
            t0 = time.perf_counter()
            time.sleep(slot)
            snap = node_stats(addr) if n == "node" else None
            t1 = time.perf_counter()
            send(n, signal.SIGSTOP)
            windows.append((n, r, t0, t1, snap))
            time.sleep(0.05)
    stop.write_text("stop")
    for n in names:
        send(n, signal.SIGCONT)
    for n in names:
        procs[n][-1].wait(timeout=900)
        for p in procs[n][:-1]:
            p.terminate()
            p.wait(timeout=60)
    report(outdir, names, windows)
    attribute(outdir, windows)


def attribute(outdir: Path, windows) -> None:
    """Calls, rows, time inside llama_decode and outside it, summed over each system's windows."""
    stops = {}  # name -> list of (t0, t1)
    for n, r, t0, t1, snap in windows:
        stops.setdefault(n, []).append((t0, t1, snap))
    out = {}
    if "node" in stops:
        w = stops["node"]
        active = calls = rows = dec = 0.0
        for (a0, a1, sa), (b0, b1, sb) in zip(w, w[1:]):
            gap = b0 - a1
            d = sb["llama_decode_seconds_total"] - sa["llama_decode_seconds_total"]
            if d > (b1 - b0) + 0.5:
                d -= gap
            active += b1 - a1 - gap
            calls += sb["batches_total"] - sa["batches_total"]
            rows += sb["decode_rows_total"] - sa["decode_rows_total"] + sb["prefill_tokens_total"] - sa["prefill_tokens_total"]
            dec += d
        out["node"] = dict(active_s=active, calls=calls, rows_per_call=rows / calls, ms_per_call=1000 * dec / calls,
                           in_decode_share=dec / active, calls_per_s=calls / active)
    if "bare" in stops and (outdir / "bare.calls.json").exists():
        log = json.loads((outdir / "bare.calls.json").read_text())
        active = calls = rows = dec = 0.0
        prev_end = None
        for t0, t1, _ in stops["bare"]:
            active += t1 - t0
            inside = [c for c in log if t0 <= c[0] < t1]
            for t_end, dt, n, _pre in inside:
                if dt > (t1 - t0) + 0.5 and prev_end is not None:
                    dt -= t0 - prev_end
                calls += 1
                rows += n
                dec += dt
            prev_end = t1
        out["bare"] = dict(active_s=active, calls=calls, rows_per_call=rows / calls, ms_per_call=1000 * dec / calls,
                           in_decode_share=dec / active, calls_per_s=calls / active)
    (outdir / "attribution.json").write_text(json.dumps(out, indent=1))
    for k, v in out.items():
        print(k, {a: round(b, 3) for a, b in v.items()})


def node_stats(addr: str) -> dict:
    import trio

    from neuron_tai.client import open_client

    async def get() -> dict:
        async with open_client(addr, timeout_s=30) as client:
            s = await client.stats()
        return {k: s.get(k) for k in ("batches_total", "decode_batches_total", "decode_rows_total",
                                      "prefill_tokens_total", "llama_decode_seconds_total", "preemptions_total", "decode_halved_total", "padding_rows_total")}

    return trio.run(get)


def node_up(addr: str) -> bool:
    import trio

    from neuron_tai.client import open_client

    async def ping() -> bool:
        try:
            with trio.fail_after(5):
                async with open_client(addr, timeout_s=5) as client:
                    await client.stats()
            return True
        except Exception:
            return False

    return trio.run(ping)


def wait_for(ok) -> None:
    for _ in range(600):
        if ok():
            return
        time.sleep(0.5)
    raise RuntimeError("never came up")


def report(outdir: Path, names: list[str], windows) -> None:
    import bisect

    times = {n: json.loads((outdir / f"{n}.json").read_text()) for n in names}
    rates: dict[str, dict[int, float]] = {n: {} for n in names}
    for n, r, t0, t1, _ in windows:
        ts = times[n]
        count = bisect.bisect_left(ts, t1) - bisect.bisect_left(ts, t0)
        rates[n][r] = count / (t1 - t0)
    rows = {"windows": windows, "rates": rates}
    (outdir / "sliced.json").write_text(json.dumps(rows, indent=1))
    for n in names:
        v = list(rates[n].values())
        print(f"{n:7s} tok/s per slot: median {statistics.median(v):.2f} mean {statistics.mean(v):.2f} "
              f"min {min(v):.2f} max {max(v):.2f}")
    for a in names:
        for b in names:
            if a < b:
                ratios = [rates[a][r] / rates[b][r] for r in rates[a] if rates[b].get(r)]
                print(f"{a} / {b}: per-round median {statistics.median(ratios):.3f} "
                      f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}); "
                      f"ratio of means {statistics.mean(rates[a].values()) / statistics.mean(rates[b].values()):.3f}")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "drive-node":
        drive_node(args[0], Path(args[1]), int(args[2]), Path(args[3]), Path(args[4]))
    elif cmd == "drive-server":
        drive_server(int(args[0]), Path(args[1]), int(args[2]), Path(args[3]), Path(args[4]))
    elif cmd == "drive-bare":
        drive_bare(Path(args[0]), int(args[1]), Path(args[2]), Path(args[3]))
    elif cmd == "conduct":
        conduct(Path(args[0]), int(args[1]), float(args[2]), int(args[3]), Path(args[4]), args[5:] or ["node", "server", "bare"])
    elif cmd == "report":
        w = json.loads((Path(args[0]) / "sliced.json").read_text())["windows"]
        report(Path(args[0]), args[1:], w)
        attribute(Path(args[0]), w)
