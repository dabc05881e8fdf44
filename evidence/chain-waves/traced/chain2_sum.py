import json, sys, collections
T = sys.argv[1]
for sysname in ("single", "chain"):
    r = json.load(open(f"/tmp/probe/{T}-{sysname}.json"))["runs"][0]
    print(sysname, {k: v for k, v in r.items() if k not in ("tokens", "requests")})
for who in ("single", "head", "tail"):
    rows = [json.loads(l) for l in open(f"/tmp/probe/{T}-{who}.jsonl")][1:]
    t0, t1 = rows[0]["t"] - rows[0]["ms"] / 1000, rows[-1]["t"]
    busy = sum(x["ms"] for x in rows) / 1000
    dec = [x for x in rows if x["p"] == 0]; mix = [x for x in rows if x["p"] and x["d"]]; pre = [x for x in rows if x["p"] and not x["d"]]
    f = lambda xs: (len(xs), sum(x["d"] for x in xs), sum(x["p"] for x in xs), round(sum(x["ms"] for x in xs) / 1000, 2))
    print(f"{who}: calls {len(rows)} span {t1-t0:.1f}s busy {busy:.1f}s ({busy/(t1-t0):.2f}); decode-only n,d,p,s {f(dec)}; mixed {f(mix)}; prefill-only {f(pre)}")
    h = collections.Counter((x["d"], min(x["p"], 999) // 16 * 16) for x in rows)
    print("   top shapes (d, p//16*16):", h.most_common(12))
