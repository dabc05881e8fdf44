#!/bin/bash
# One node (the Llama-3.2-1B shape, 2 threads, the report's limits) through the report's
# concurrencies in order, decode-heavy, its counters read around every run.
# ./sequence.sh CHECKOUT OUTDIR PORT   (the node runs CHECKOUT's code, the client this one's)
set -e
CHECKOUT=$1; OUT=$2; PORT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
mkdir -p "$OUT"
M=~/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf
ADDR=tcp://127.0.0.1:$PORT
DECISIONS=$OUT/decisions.log PYTHONPATH=$CHECKOUT .venv/bin/python "$HERE/traced_serve.py" serve "$M" --bind $ADDR \
  --threads 2 --log-level warning --max-sessions 16 --max-waiting 16 --kv-cells 8192 > "$OUT/node.log" 2>&1 &
NODE=$!
until grep -q '^ready' "$OUT/node.log"; do sleep 1; done
for c in 1 2 4 8 16; do
  .venv/bin/python -m bench.chain_load stats $ADDR > "$OUT/c$c-before.json"
  echo "$(date -u +%T) c=$c starts at monotonic $(python3 -c 'import time; print(f"{time.monotonic():.3f}")')"
  .venv/bin/python -m bench.chain_load run $ADDR --concurrency $c --requests 16 --max-new 128 --max-prompt 256 \
    --seed 12 --workload decode --per-client 1 --tag c$c > "$OUT/c$c.json"
  .venv/bin/python -m bench.chain_load stats $ADDR > "$OUT/c$c-after.json"
  python3 "$HERE/summary.py" "$OUT" $c
done
kill $NODE; wait
