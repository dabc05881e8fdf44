#!/bin/bash
# One default node through the report's concurrencies in order (1, 2, 4, 8, 16), its counters around each run; twice.
cd /work/main
M=~/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf
L="--max-sessions 16 --max-waiting 16 --kv-cells 8192"
.venv/bin/python -m neuron_tai.cli serve $M --bind tcp://127.0.0.1:5703 --threads 2 --log-level warning $L > /tmp/ab/seq-node.log 2>&1 &
A=$!
until grep -q '^ready' /tmp/ab/seq-node.log; do sleep 1; done
for r in 0 1; do for c in 1 2 4 8 16; do
  .venv/bin/python -m bench.chain_load stats tcp://127.0.0.1:5703 > /tmp/ab/seq-$r-$c-before.json
  .venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5703 --concurrency $c --requests 16 --max-new 128 --max-prompt 256 --seed 12 --workload decode --per-client 1 --tag s$c > /tmp/ab/seq-$r-$c.json
  .venv/bin/python -m bench.chain_load stats tcp://127.0.0.1:5703 > /tmp/ab/seq-$r-$c-after.json
  python3 - $r $c <<'PY'
import json,sys
r,c=sys.argv[1:]
b=list(json.load(open(f'/tmp/ab/seq-{r}-{c}-before.json'))['stats'].values())[0]
a=list(json.load(open(f'/tmp/ab/seq-{r}-{c}-after.json'))['stats'].values())[0]
run=json.load(open(f'/tmp/ab/seq-{r}-{c}.json'))['runs'][0]
d={k:round(a[k]-b[k],2) for k in a}
print(r, c, run['tok_s'], d, flush=True)
PY
done; done
kill $A; wait
