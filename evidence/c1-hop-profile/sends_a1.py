"""The head's sends in chain_trace.sh's run, by socket: how long each took, and whether the slow ones
started or ended while the head's compute thread ran a job (t-TAG-head.json from serve_trace.py)."""
import json, statistics as st, sys
d = json.load(open(f"/tmp/probe2/t-{sys.argv[1]}-head.json"))
jobs = [j for j in d["jobs"] if len(j) == 4]
inside = lambda t: any(j[1] <= t <= j[2] for j in jobs)
for fd in sorted({s[2] for s in d["send"]}):
    xs = sorted(t1 - t0 for t0, t1, f, n in d["send"] if f == fd)
    slow = [(t0, t1) for t0, t1, f, n in d["send"] if f == fd and t1 - t0 > 0.5e-3]
    print(f"fd {fd}: {len(xs)} sends, p50 {1000*st.median(xs):.3f} p90 {1000*xs[int(.9*len(xs))]:.3f} max {1000*xs[-1]:.3f} ms;"
          f" over 0.5 ms: {len(slow)}, of them started during a job: {sum(inside(a) for a, b in slow)}, ended during a job: {sum(inside(b) for a, b in slow)}")
