import json, sys, statistics as st
from collections import Counter
tag = sys.argv[1]
H = json.load(open(f"t-{tag}-head.json")); T = json.load(open(f"t-{tag}-tail.json"))
for name, d in (("head", H), ("tail", T)):
    print(name, "send fds", Counter((s[2], s[3] // 1000) for s in d["send"]).most_common(6), "recv fds", Counter((s[2], s[3] // 1000) for s in d["recv"]).most_common(6))
def after(xs, t, key=lambda x: x[0], pred=lambda x: True):
    for x in xs:
        if key(x) >= t and pred(x): return x
    return None
hjobs = sorted([j for j in H["jobs"] if len(j) == 4]); tjobs = sorted([j for j in T["jobs"] if len(j) == 4])
hcalls = [c for c in H["calls"] if c[0] == 1]
names = ["H resumed->H req exit", "H req exit->H send start", "H send", "H send end->T recv end", "T recv->T req enter",
         "T req enter->T submit", "T submit->T call", "T call end->T resumed", "T resumed->T req exit", "T req exit->T send start", "T send",
         "T send end->H recv end", "H recv->H req enter", "H req enter->H submit", "H submit->H call"]
parts = {n: [] for n in names}
for c in hcalls:
    j = next((j for j in hjobs if j[1] <= c[1] and c[2] <= j[2]), None)
    if not j: continue
    r = j[3]
    try:
        hx = after(H["req"], r, key=lambda x: x[1], pred=lambda x: x[2] == "StepRequest")
        if not hx: continue
        hs = after(H["send"], hx[1], pred=lambda x: x[3] > 4000)
        tr = after(T["recv"], hs[0], key=lambda x: x[1], pred=lambda x: x[3] > 4000)
        tq = after(T["req"], tr[1])
        tj = after(tjobs, tq[0])
        tc = after(T["calls"], tj[1], key=lambda x: x[1])
        tx = after(T["req"], tj[3], key=lambda x: x[1])
        ts = after(T["send"], tx[1])
        hr = after(H["recv"], ts[0], key=lambda x: x[1], pred=lambda x: x[2] == hs[2])
        hq = after(H["req"], hr[1])
        nj = after(hjobs, hq[0])
        nc = after(H["calls"], nj[1], key=lambda x: x[1])
    except (TypeError, IndexError):
        continue
    if not (nj and nc) or nc[1] - c[2] > 0.06: continue
    v = [hx[1]-r, hs[0]-hx[1], hs[1]-hs[0], tr[1]-hs[1], tq[0]-tr[1], tj[0]-tq[0], tc[1]-tj[0], tj[3]-tc[2], tx[1]-tj[3], ts[0]-tx[1], ts[1]-ts[0], hr[1]-ts[1], hq[0]-hr[1], nj[0]-hq[0], nc[1]-nj[0]]
    for n, x in zip(names, v): parts[n].append(x)
tot = 0
for n, xs in parts.items():
    tot += st.median(xs)
    print(f"{n:28s} p50 {1000*st.median(xs):6.3f}  mean {1000*st.mean(xs):6.3f} ms (n {len(xs)})")
print("sum of p50", round(tot*1000, 3))
