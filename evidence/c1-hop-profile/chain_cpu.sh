#!/bin/bash
# chain_cpu.sh TAG: the loopback chain, untraced; per-thread CPU of both stages over a decode-heavy c=1 run.
cd /work/main
S=/tmp/fresh17/.bench/shards/llama-3.2-1b-shape-q4_k_m-fb0dcf5f
TAG=$1; F="--threads 1 --max-sessions 16 --kv-cells 8192 --log-level warning"
run() { PYTHONPATH=/work/main taskset -c $2 .venv/bin/python -m neuron_tai.cli serve "${@:3}" > /tmp/probe2/c-$TAG-$1.log 2>&1 & echo $! > /tmp/probe2/c-$TAG-$1.pid; }
wait_ready() { for i in $(seq 200); do grep -q ready $1 && return; sleep 0.2; done; }
snap() { for p in head tail; do pid=$(cat /tmp/probe2/c-$TAG-$p.pid); for t in /proc/$pid/task/*; do echo "$1 $p $(basename $t)-$(cat $t/comm | tr ' ' _) $(awk '{print $14, $15}' $t/stat) $(grep -E '^(voluntary|nonvoluntary)' $t/status | awk '{print $2}' | tr '\n' ' ')"; done; done; }
run tail 1 $S/llama-3.2-1b-shape-q4_k_m.layers-12-16.gguf --bind tcp://127.0.0.1:5861 $F; wait_ready /tmp/probe2/c-$TAG-tail.log
run head 0 $S/llama-3.2-1b-shape-q4_k_m.layers-0-12.gguf --bind tcp://127.0.0.1:5860 --next tcp://127.0.0.1:5861 $F; wait_ready /tmp/probe2/c-$TAG-head.log
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5860 --concurrency 1 --requests 1 --max-new 16 --workload decode --seed 12 > /dev/null
snap before > /tmp/probe2/c-$TAG-cpu.txt
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5860 --concurrency 1 --requests 4 --max-new 64 --workload decode --seed 12 > /tmp/probe2/c-$TAG-load.json
snap after >> /tmp/probe2/c-$TAG-cpu.txt
pkill -INT -f "bind tcp://127.0.0.1:586[01]"; sleep 3
python3 - /tmp/probe2/c-$TAG-cpu.txt <<'PY'
import sys, json
rows = [l.split() for l in open(sys.argv[1])]
b = {(r[1], r[2]): r for r in rows if r[0] == "before"}
for r in rows:
    if r[0] != "after": continue
    o = b.get((r[1], r[2]))
    if not o: continue
    d = [int(x) - int(y) for x, y in zip(r[3:], o[3:])]
    if any(d): print(r[1], r[2], "utime+stime ticks", d[0], d[1], "vol/invol switches", d[2], d[3])
PY
grep -o '"tok_s": [0-9.]*' /tmp/probe2/c-$TAG-load.json; grep -o '"tokens": {' /tmp/probe2/c-$TAG-load.json | wc -l
