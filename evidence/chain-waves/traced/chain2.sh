#!/bin/bash
# chain2.sh WORKLOAD C PER_CLIENT TAG -- traced loopback chain 0:9/9:16 (cores 0/1) then traced single (core 0), same load
cd /work/main
pkill -f "serve_traced" ; sleep 1
M=~/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf
SPLIT=${SPLIT:-9}; W=$1; C=$2; PC=$3; T=$4; shift 4
MAXNEW=32; [ "$W" = decode ] && MAXNEW=128
O="--threads 1 --max-sessions 16 --max-waiting 16 --kv-cells 8192"
(taskset -c 1 env TRACE=/tmp/probe/$T-tail.jsonl PYTHONPATH=. .venv/bin/python /tmp/probe/serve_traced.py serve $M --layers $SPLIT:16 --bind tcp://127.0.0.1:5712 $O $CARGS "$@" > /tmp/probe/tail.log 2>&1 &)
sleep 2
(taskset -c 0 env TRACE=/tmp/probe/$T-head.jsonl PYTHONPATH=. .venv/bin/python /tmp/probe/serve_traced.py serve $M --layers 0:$SPLIT --next tcp://127.0.0.1:5712 --bind tcp://127.0.0.1:5711 $O $CARGS "$@" > /tmp/probe/head.log 2>&1 &)
for i in $(seq 60); do sleep 1; .venv/bin/python -m neuron_tai.cli stats --addr tcp://127.0.0.1:5711 --json >/dev/null 2>&1 && break; done
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5711 --concurrency $C --requests 16 --max-new $MAXNEW --max-prompt 256 --seed 12 --workload $W --per-client $PC > /tmp/probe/$T-chain.json
pkill -f "serve_traced"; sleep 1
[ -n "$NOSINGLE" ] && { python3 -c "import json; r=json.load(open('/tmp/probe/$T-chain.json'))['runs'][0]; print('$T', {k:v for k,v in r.items() if k not in ('tokens','requests')})"; exit 0; }
(taskset -c 0 env TRACE=/tmp/probe/$T-single.jsonl PYTHONPATH=. .venv/bin/python /tmp/probe/serve_traced.py serve $M --bind tcp://127.0.0.1:5701 $O "$@" > /tmp/probe/node.log 2>&1 &)
for i in $(seq 60); do sleep 1; .venv/bin/python -m neuron_tai.cli stats --addr tcp://127.0.0.1:5701 --json >/dev/null 2>&1 && break; done
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5701 --concurrency $C --requests 16 --max-new $MAXNEW --max-prompt 256 --seed 12 --workload $W --per-client $PC > /tmp/probe/$T-single.json
pkill -f "serve_traced"
python3 /tmp/probe/chain2_sum.py $T
