#!/bin/bash
# A single node with filler rows (the default) and with --no-filler-rows, alternating, under the
# report's decode-heavy load (16-token prompts, 128 new tokens) at one concurrency.
#   evidence/filler-rows/ab.sh MODEL CONCURRENCY PER_CLIENT ROUNDS
# Per run: tokens/s (bench.chain_load), then from the node's stats: llama_decode calls, seconds
# inside llama_decode, filler rows.
set -euo pipefail
MODEL=$1; C=$2; PER_CLIENT=$3; ROUNDS=$4; ADDR=tcp://127.0.0.1:5702
for round in $(seq "$ROUNDS"); do
  order=("" "--no-filler-rows"); [ $((round % 2)) -eq 0 ] && order=("--no-filler-rows" "")
  for flags in "${order[@]}"; do
    neuron-tai serve "$MODEL" --bind $ADDR --threads 2 --max-sessions 16 --max-waiting 16 --kv-cells 4096 $flags \
      > /tmp/filler-ab-node.log 2>&1 &
    node=$!
    for _ in $(seq 120); do sleep 1; neuron-tai stats --addr $ADDR --json > /dev/null 2>&1 && break; done
    python -m bench.chain_load run $ADDR --concurrency "$C" --requests 16 --max-new 128 --max-prompt 256 \
      --seed 12 --workload decode --per-client "$PER_CLIENT" > /tmp/filler-ab-load.json
    neuron-tai stats --addr $ADDR --json > /tmp/filler-ab-stats.json
    kill -INT $node; wait $node || true
    python - "$round" "${flags:-fillers}" "$C" <<'PY'
import json, sys
run = json.load(open("/tmp/filler-ab-load.json"))["runs"][0]
stats = json.load(open("/tmp/filler-ab-stats.json"))
print(f"c={sys.argv[3]} round {sys.argv[1]} {sys.argv[2]:17} tok/s {run['tok_s']:6.2f}  calls {stats['batches_total']:4d}  "
      f"llama_decode {stats['llama_decode_seconds_total']:6.2f} s  filler rows {stats['padding_rows_total']}", flush=True)
PY
  done
done
