import sys, time
from pathlib import Path
from neuron_tai.layer_costs import measure_costs, Measure
model = Path.home() / ".cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf"
t = time.perf_counter()
c = measure_costs(model, Measure.for_chain(8, 2, 1))
print(f"{sys.argv[1]}: {time.perf_counter() - t:.1f}s layers sum {1000*sum(l.decode for l in c.layers):.2f} head {1000*c.head.decode:.2f} stage {1000*c.stage.decode:.3f} emb {1000*c.embedding.decode:.3f} ms/row", flush=True)
