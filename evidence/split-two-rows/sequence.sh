#!/bin/bash
# One gemma-3-270m node (2 threads, the report's limits) at c=1 then c=2, decode-heavy, every
# split decision of 2 rows or more traced (../split-decodes/traced_serve.py), counters around each run.
# ./sequence.sh OUTDIR PORT
set -e
OUT=$1; PORT=$2
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
mkdir -p "$OUT"
M=$(.venv/bin/python -c "from bench.common import gemma_path; print(gemma_path())")
ADDR=tcp://127.0.0.1:$PORT
MIN_ROWS=2 DECISIONS=$OUT/decisions.log PYTHONPATH=. .venv/bin/python "$HERE/../split-decodes/traced_serve.py" serve "$M" --bind $ADDR \
  --threads 2 --log-level warning --max-sessions 16 --max-waiting 16 --kv-cells 8192 > "$OUT/node.log" 2>&1 &
NODE=$!
until grep -q '^ready' "$OUT/node.log"; do sleep 1; done
for c in 1 2; do
  .venv/bin/python -m bench.chain_load stats $ADDR > "$OUT/c$c-before.json"
  echo "$(date -u +%T) c=$c starts at monotonic $(python3 -c 'import time; print(f"{time.monotonic():.3f}")')"
  .venv/bin/python -m bench.chain_load run $ADDR --concurrency $c --requests 16 --max-new 128 --max-prompt 256 \
    --seed 12 --workload decode --per-client 1 --tag c$c > "$OUT/c$c.json"
  .venv/bin/python -m bench.chain_load stats $ADDR > "$OUT/c$c-after.json"
  python3 "$HERE/../split-decodes/summary.py" "$OUT" $c
done
kill $NODE; wait
