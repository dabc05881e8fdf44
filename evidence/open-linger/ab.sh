#!/bin/bash
# A single node before and after lingering for newly opened sessions (ea34866 against f32bb7e),
# alternating, under one closed-loop load.
#   evidence/open-linger/ab.sh BEFORE_TREE MODEL WORKLOAD CONCURRENCY PER_CLIENT ROUNDS
# BEFORE_TREE: a worktree of ea34866 (git worktree add /tmp/wt-before ea34866); the "after" is
# this checkout. Per run: tokens/s and TTFT p50 (bench.chain_load), then from the node's stats:
# llama_decode calls, seconds inside llama_decode.
set -euo pipefail
BEFORE=$1; MODEL=$2; W=$3; C=$4; PER_CLIENT=$5; ROUNDS=$6; ADDR=tcp://127.0.0.1:5703
AFTER=$(cd "$(dirname "$0")/../.." && pwd)
MAXNEW=32; [ "$W" = decode ] && MAXNEW=128
for round in $(seq "$ROUNDS"); do
  order=("$AFTER" "$BEFORE"); [ $((round % 2)) -eq 0 ] && order=("$BEFORE" "$AFTER")
  for tree in "${order[@]}"; do
    (cd "$tree" && exec python -m neuron_tai.cli serve "$MODEL" --bind $ADDR --threads 2 --max-sessions 16 \
      --max-waiting 16 --kv-cells 4096) > /tmp/open-linger-node.log 2>&1 &
    node=$!
    for _ in $(seq 120); do sleep 1; neuron-tai stats --addr $ADDR --json > /dev/null 2>&1 && break; done
    python -m bench.chain_load run $ADDR --concurrency "$C" --requests 16 --max-new $MAXNEW --max-prompt 256 \
      --seed 12 --workload "$W" --per-client "$PER_CLIENT" > /tmp/open-linger-load.json
    neuron-tai stats --addr $ADDR --json > /tmp/open-linger-stats.json
    kill -INT $node; wait $node || true
    python - "$round" "$([ "$tree" = "$AFTER" ] && echo after || echo before)" "$W" "$C" <<'PY'
import json, sys
run = json.load(open("/tmp/open-linger-load.json"))["runs"][0]
stats = json.load(open("/tmp/open-linger-stats.json"))
print(f"{sys.argv[3]} c={sys.argv[4]} round {sys.argv[1]} {sys.argv[2]:6} tok/s {run['tok_s']:6.2f}  "
      f"ttft p50 {run['ttft_p50_ms']:7.1f} ms  calls {stats['batches_total']:4d}  "
      f"llama_decode {stats['llama_decode_seconds_total']:6.2f} s", flush=True)
PY
  done
done
