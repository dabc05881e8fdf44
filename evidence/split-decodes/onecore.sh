#!/bin/bash
# One node on one core with one thread (as the multi-host suite's single node), decode-heavy,
# c=8, 16 requests (2 per client), every split decision of 2 or more rows traced.
# ./onecore.sh CHECKOUT OUTDIR PORT
set -e
CHECKOUT=$1; OUT=$2; PORT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
mkdir -p "$OUT"
M=~/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf
ADDR=tcp://127.0.0.1:$PORT
MIN_ROWS=2 DECISIONS=$OUT/decisions.log PYTHONPATH=$CHECKOUT taskset -c 0 .venv/bin/python "$HERE/traced_serve.py" serve "$M" \
  --bind $ADDR --threads 1 --log-level warning --max-sessions 16 --max-waiting 16 --kv-cells 8192 > "$OUT/node.log" 2>&1 &
NODE=$!
until grep -q '^ready' "$OUT/node.log"; do sleep 1; done
c=8
.venv/bin/python -m bench.chain_load stats $ADDR > "$OUT/c$c-before.json"
taskset -c 1 .venv/bin/python -m bench.chain_load run $ADDR --concurrency $c --requests 16 --max-new 128 --max-prompt 256 \
  --seed 12 --workload decode --per-client 2 --tag c$c > "$OUT/c$c.json"
.venv/bin/python -m bench.chain_load stats $ADDR > "$OUT/c$c-after.json"
python3 "$HERE/summary.py" "$OUT" $c
kill $NODE; wait
