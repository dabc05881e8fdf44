#!/bin/bash
# Node at c=8 decode-heavy, 1B shape, 2 threads: --split-decodes (default) against --no-split-decodes, alternating.
cd /work/main
M=~/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf
L="--max-sessions 16 --max-waiting 16 --kv-cells 8192"
.venv/bin/python -m neuron_tai.cli serve $M --bind tcp://127.0.0.1:5701 --threads 2 --log-level warning $L > /tmp/ab/split.log 2>&1 &
A=$!
.venv/bin/python -m neuron_tai.cli serve $M --bind tcp://127.0.0.1:5702 --threads 2 --log-level warning $L --no-split-decodes > /tmp/ab/nosplit.log 2>&1 &
B=$!
until grep -q '^ready' /tmp/ab/split.log && grep -q '^ready' /tmp/ab/nosplit.log; do sleep 1; done
one() { # name port
  .venv/bin/python -m bench.chain_load stats tcp://127.0.0.1:$2 > /tmp/ab/$1-$r-before.json
  .venv/bin/python -m bench.chain_load run tcp://127.0.0.1:$2 --concurrency ${C:-8} --requests 16 --max-new 128 --max-prompt 256 --seed 12 --workload decode --per-client 1 --tag $1 > /tmp/ab/$1-$r.json
  .venv/bin/python -m bench.chain_load stats tcp://127.0.0.1:$2 > /tmp/ab/$1-$r-after.json
  python3 -c "import json,sys; d=json.load(open('/tmp/ab/$1-$r.json')); r=d['runs'][0]; print('$1', $r, r['concurrency'], r['tok_s'], r['itl_p50_ms'], flush=True)"
}
for r in 0 1 2 3 4 5; do
  if [ $((r % 2)) = 0 ]; then one split 5701; one nosplit 5702; else one nosplit 5702; one split 5701; fi
done
kill $A $B; wait
