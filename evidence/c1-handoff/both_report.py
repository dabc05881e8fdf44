"""Where each socket send fell: inside a llama_decode call, or in the gap between two calls (and then how long)."""
import bisect, json, statistics as st, sys
d = json.load(open(sys.argv[1])); calls, sends = d["calls"], d["sends"]
starts = [c[1] for c in calls]
inside, gap = [], []
for s0, s1 in sends:
    i = bisect.bisect_right(starts, s0) - 1
    (inside if i >= 0 and s0 < calls[i][2] else gap).append(s1 - s0)
for name, xs in (("inside a call", inside), ("between calls", gap)):
    if xs:
        print(f"{name}: {len(xs)} sends, wall p50 {1000*st.median(xs):.3f} mean {1000*st.mean(xs):.3f} ms, over 0.5 ms: {sum(x > 0.0005 for x in xs)}, total {sum(xs):.3f} s")
load = json.load(open(sys.argv[2]))["runs"][0]
print({k: v for k, v in load.items() if k != "tokens"})
