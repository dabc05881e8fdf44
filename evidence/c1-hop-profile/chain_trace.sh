#!/bin/bash
# chain_trace.sh TAG: 1B shape 0:12/12:16 chain (head core 0, tail core 1, 1 thread), traced; decode-heavy c=1.
cd /work/main
S=/tmp/fresh17/.bench/shards/llama-3.2-1b-shape-q4_k_m-fb0dcf5f
TAG=$1; F="--threads 1 --max-sessions 16 --kv-cells 8192 --log-level warning"
run() { TIMED_OUT=/tmp/probe2/t-$TAG-$1.json PYTHONPATH=/work/main taskset -c $2 .venv/bin/python /tmp/probe2/serve_trace.py serve "${@:3}" > /tmp/probe2/t-$TAG-$1.log 2>&1 & }
wait_ready() { for i in $(seq 200); do grep -q ready $1 && return; sleep 0.2; done; }
run tail 1 $S/llama-3.2-1b-shape-q4_k_m.layers-12-16.gguf --bind tcp://127.0.0.1:5861 $F; wait_ready /tmp/probe2/t-$TAG-tail.log
run head 0 $S/llama-3.2-1b-shape-q4_k_m.layers-0-12.gguf --bind tcp://127.0.0.1:5860 --next tcp://127.0.0.1:5861 $F; wait_ready /tmp/probe2/t-$TAG-head.log
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5860 --concurrency 1 --requests 2 --max-new 64 --workload decode --seed 12 > /tmp/probe2/t-$TAG-load.json
pkill -INT -f "bind tcp://127.0.0.1:586[01]"; sleep 3
