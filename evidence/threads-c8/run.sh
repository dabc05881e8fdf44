#!/bin/bash
# node under c=8 decode load; per-thread CPU before/after; the client's CPU
set -euo pipefail
cd /work/main; source .venv/bin/activate
M=${M:-/root/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf}; C=${C:-8}; ADDR=tcp://127.0.0.1:5712
neuron-tai serve "$M" --bind $ADDR --threads 2 --max-sessions 16 --max-waiting 16 --kv-cells 4096 $EXTRA > /tmp/probe/thr-node.log 2>&1 &
node=$!
for _ in $(seq 120); do sleep 1; neuron-tai stats --addr $ADDR --json > /dev/null 2>&1 && break; done
bash /tmp/probe/threads.sh "bin/neuron-tai serve" > /tmp/probe/thr8_before.txt
neuron-tai stats --addr $ADDR --json > /tmp/probe/thr8_s0.json
/usr/bin/time -v python -m bench.chain_load run $ADDR --concurrency "$C" --requests 16 --max-new 128 --max-prompt 256 \
      --seed 12 --workload decode --per-client 2 > /tmp/probe/thr8_load.json 2> /tmp/probe/thr8_time.txt
bash /tmp/probe/threads.sh "bin/neuron-tai serve" > /tmp/probe/thr8_after.txt
neuron-tai stats --addr $ADDR --json > /tmp/probe/thr8_s1.json
kill -INT $node; wait $node || true
python - <<'PY'
import json
r=json.load(open("/tmp/probe/thr8_load.json"))["runs"][0]; a=json.load(open("/tmp/probe/thr8_s0.json")); b=json.load(open("/tmp/probe/thr8_s1.json"))
d={k:b[k]-a[k] for k in ("batches_total","llama_decode_seconds_total","preemptions_total") if k in b}
print("tok/s", r["tok_s"], d, "ms/call", 1000*d["llama_decode_seconds_total"]/d["batches_total"])
PY
grep -E "User time|System time|Percent of CPU|Elapsed|Involuntary" /tmp/probe/thr8_time.txt
diff <(cat /tmp/probe/thr8_before.txt) <(cat /tmp/probe/thr8_after.txt) | cat
