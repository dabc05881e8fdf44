"""One run's line: tok/s, and the node's calls and seconds in them over the run (its stats before and after)."""

import json
import sys

out, c = sys.argv[1], sys.argv[2]
before = next(iter(json.load(open(f"{out}/c{c}-before.json"))["stats"].values()))
after = next(iter(json.load(open(f"{out}/c{c}-after.json"))["stats"].values()))
run = json.load(open(f"{out}/c{c}.json"))["runs"][0]
used = {k.removesuffix("_total"): round(after[k] - before[k], 2) for k in after}
print(f"c={c} tok/s {run['tok_s']} ITL p50 {run['itl_p50_ms']} ms", used, flush=True)
