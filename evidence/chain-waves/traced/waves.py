"""Per 5-second window of a traced chain run: each stage's share of the window inside llama_decode,
and the decode and prompt rows its calls carried; then each node's decode-only calls by rows
(median ms per layer) and its prompt-only calls (ms per layer and row).

    python3 waves.py TAG   # reads TAG-head.jsonl, TAG-tail.jsonl, TAG-single.jsonl (chain2.sh's traces)
"""
import collections
import json
import math
import sys

tag = sys.argv[1]
load = lambda who: [json.loads(line) for line in open(f"{tag}-{who}.jsonl")][1:]  # noqa: E731
head, tail = load("head"), load("tail")
t0 = min(head[0]["t"] - head[0]["ms"] / 1000, tail[0]["t"] - tail[0]["ms"] / 1000)
end = max(head[-1]["t"], tail[-1]["t"])
W = 5


def busy(calls, a, b):
    return sum(max(0.0, min(c["t"], b) - max(c["t"] - c["ms"] / 1000, a)) for c in calls)


for k in range(math.ceil((end - t0) / W)):
    a, b = t0 + k * W, t0 + (k + 1) * W
    hx, tx = [c for c in head if a <= c["t"] < b], [c for c in tail if a <= c["t"] < b]
    print(f"{k * W:3d}-{(k + 1) * W:3d} s: head busy {busy(head, a, b) / W:.2f}, tail {busy(tail, a, b) / W:.2f}; "
          f"rows decode/prompt: head {sum(c['d'] for c in hx)}/{sum(c['p'] for c in hx)}, "
          f"tail {sum(c['d'] for c in tx)}/{sum(c['p'] for c in tx)}")
for who, layers in (("single", 16), ("head", 9), ("tail", 7)):
    calls = load(who)
    by = collections.defaultdict(list)
    for c in calls:
        if c["p"] == 0:
            by[c["d"]].append(c["ms"])
    print(f"{who} ({layers} layers) decode-only calls, rows: (count, median ms / layer):",
          {d: (len(v), round(sorted(v)[len(v) // 2] / layers, 1)) for d, v in sorted(by.items())})
    print(f"  prompt-only calls of 32+ rows, (rows, ms / layer / row):",
          [(c["p"], round(c["ms"] / c["p"] / layers, 2)) for c in calls if c["p"] >= 32 and c["d"] == 0])
