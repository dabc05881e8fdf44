"""Measure the 1B shape's costs afresh N times (as `neuron-tai plan` does) and print each one's head/layer parts and splits."""
import sys, time
from pathlib import Path
from neuron_tai.layer_costs import measure_costs, Measure
from neuron_tai.placement import Host, Workload, plan
from bench.multihost import WORKLOADS, FULL
import statistics
model = Path.home() / ".cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf"
how = Measure.for_chain(8, 2, 1)
for i in range(int(sys.argv[1])):
    t = time.perf_counter()
    c = measure_costs(model, how)
    out = []
    for w in ("prompt", "decode"):
        prompt = statistics.fmean(min((lo + hi) / 2, FULL.max_prompt) for lo, hi in WORKLOADS[w].buckets)
        p = plan(c, [Host(), Host()], Workload(prompt, FULL.new_tokens(w)))
        out.append(f"{w} {p.bounds}")
    print(f"run {i}: {time.perf_counter() - t:.1f}s layers sum {1000*sum(l.decode for l in c.layers):.2f} head {1000*c.head.decode:.2f} stage {1000*c.stage.decode:.3f} emb {1000*c.embedding.decode:.3f} ms/row | " + " | ".join(out), flush=True)
