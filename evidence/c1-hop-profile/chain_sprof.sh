#!/bin/bash
cd /work/main
S=/tmp/fresh17/.bench/shards/llama-3.2-1b-shape-q4_k_m-fb0dcf5f
TAG=$1; F="--threads 1 --max-sessions 16 --kv-cells 8192 --log-level warning"
run() { PROF_OUT=/tmp/probe2/sp-$TAG-$1.out PYTHONPATH=/work/main taskset -c $2 .venv/bin/python /tmp/probe2/serve_prof.py serve "${@:3}" > /tmp/probe2/sp-$TAG-$1.log 2>&1 & echo $! > /tmp/probe2/sp-$TAG-$1.pid; }
wait_ready() { for i in $(seq 200); do grep -q ready $1 && return; sleep 0.2; done; }
run tail 1 $S/llama-3.2-1b-shape-q4_k_m.layers-11-16.gguf --bind tcp://127.0.0.1:5861 $F; wait_ready /tmp/probe2/sp-$TAG-tail.log
run head 0 $S/llama-3.2-1b-shape-q4_k_m.layers-0-11.gguf --bind tcp://127.0.0.1:5860 --next tcp://127.0.0.1:5861 $F; wait_ready /tmp/probe2/sp-$TAG-head.log
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5860 --concurrency 1 --requests 1 --max-new 16 --workload decode --seed 12 > /dev/null
kill -USR1 $(cat /tmp/probe2/sp-$TAG-head.pid) $(cat /tmp/probe2/sp-$TAG-tail.pid)
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5860 --concurrency 1 --requests 4 --max-new 64 --workload decode --seed 12 > /tmp/probe2/sp-$TAG-load.json
kill -USR2 $(cat /tmp/probe2/sp-$TAG-head.pid) $(cat /tmp/probe2/sp-$TAG-tail.pid); sleep 1
pkill -INT -f "bind tcp://127.0.0.1:586[01]"; sleep 3
