#!/bin/bash
# A single node on the 1B shape with llama.cpp's KV cache debug log on, one closed-loop run (default:
# decode-heavy, c=16, one request per client), then each find_slot's used_max_p1 (the cells attention
# spans, before padding), used cells and head.  W=prompt C=8 PC=2 OUT=name: another workload.
cd "$(dirname "$0")/../.."
W=${W:-decode}; C=${C:-16}; PC=${PC:-1}; OUT=${OUT:-find_slot}; MAXNEW=32; [ "$W" = decode ] && MAXNEW=128
M=~/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf
(LLAMA_KV_CACHE_DEBUG=1 PYTHONPATH=. .venv/bin/python evidence/kv-packing/serve_kvdbg.py serve $M --bind tcp://127.0.0.1:5701 \
  --threads 2 --max-sessions 16 --max-waiting 16 --kv-cells 4096 --log-level debug > /tmp/kvdbg.log 2>&1 &)
for i in $(seq 60); do sleep 1; .venv/bin/python -m neuron_tai.cli stats --addr tcp://127.0.0.1:5701 --json >/dev/null 2>&1 && break; done
.venv/bin/python -m bench.chain_load run tcp://127.0.0.1:5701 --concurrency $C --requests 16 --max-new $MAXNEW --max-prompt 256 \
  --seed 12 --workload $W --per-client $PC > /tmp/kvdbg_out.json
pkill -f 5701
grep "find_slot: stream\[0\], n = " /tmp/kvdbg.log | sed 's/.*n = *\([0-9]*\), used = *\([0-9]*\), head = *\([0-9]*\).*/\1 \2 \3/' > evidence/kv-packing/$OUT.txt
awk '{d=$1-$2; if(d>m)m=d; if($1>mx)mx=$1} END{print NR" find_slot calls; largest used_max_p1 - used: "m+0"; largest used_max_p1: "mx}' evidence/kv-packing/$OUT.txt
