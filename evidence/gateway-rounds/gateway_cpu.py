"""c=8 through the gateway (gemma-3-270m, 16 requests of 128 tokens): the gateway process's CPU
seconds per token from /proc, and 20 s of py-spy (250 Hz, on-CPU samples only) summarised. Usage:
    PYTHONPATH=. .venv/bin/python evidence/gateway-rounds/gateway_cpu.py"""
import os, subprocess, sys, time
from dataclasses import replace
from pathlib import Path
import trio
from bench.common import bench_model
from bench.gateway_bench import FULL, closed_loop, gateway_command, workload
from bench.processes import open_processes, free_ports, serve_command, node_ready

conc = int(sys.argv[1]) if len(sys.argv) > 1 else 8
model = bench_model(False)
plan = replace(FULL, max_new=128)
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
with open_processes(Path("/tmp/gateway-cpu-logs")) as procs:
    p = free_ports(2)
    addr = f"tcp://127.0.0.1:{p[0]}"
    flags = ["--max-sessions", "8", "--max-waiting", "64", "--kv-cells", "4096", "--log-level", "warning"]
    assert procs.start("single", serve_command(model, addr, threads=2, flags=flags), node_ready)
    assert procs.start("gw", gateway_command(model, addr, p[1]), node_ready)
    gw_pid = procs.running["gw"].pid
    print("gw pid", gw_pid, flush=True)
    url = f"http://127.0.0.1:{p[1]}/v1/completions"
    reqs = trio.run(workload, addr, plan)[:16]
    c0, t0 = cpu(gw_pid), time.time()
    spy = subprocess.Popen([".venv/bin/py-spy", "record", "-p", str(gw_pid), "-r", "250", "-d", "20", "-f", "raw", "-o", "/tmp/gateway-cpu-pyspy.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    g = trio.run(closed_loop, url, model.stem, reqs, conc)
    spy.wait()
    c1, t1 = cpu(gw_pid), time.time()
    print(g, flush=True)
    print(f"gateway CPU {c1-c0:.2f} s over {t1-t0:.1f} s, {g['tokens']} tokens: {1000*(c1-c0)/g['tokens']:.3f} ms CPU per token", flush=True)
samples = [(line.rsplit(" ", 1)[0].split(";"), int(line.rsplit(" ", 1)[1])) for line in open("/tmp/gateway-cpu-pyspy.txt")]
total = sum(n for _, n in samples)
print(f"py-spy: {total} on-CPU samples of 5000 (20 s at 250 Hz): {100 * total / 5000:.1f}% of a core")
for part in ("EpollIOManager.get_events", "SocketStream.send_all", "H11Protocol.stream_send", "Requester.run", "detokenize"):
    n = sum(c for frames, c in samples if any(f.startswith(part + " ") for f in frames))
    print(f"  {part}: {n} samples")
