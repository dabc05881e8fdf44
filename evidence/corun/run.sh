#!/bin/bash
# Decode speed of the whole 1B shape on core 0, alone and with a twin on core 1.
B=~/.cache/neuron-tai/llama-server-0.3.36/llama-batched-bench
M=~/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf
args="-m $M -t 1 -tb 1 -c 4096 -npp 16 -ntg 64 -npl 1,8"
one() { taskset -c $1 $B $args 2>/dev/null | grep -E "^[|] +[0-9]"; }
for round in 1 2 3; do
  echo "== round $round: alone on core 0"; one 0
  echo "== round $round: core 0 with a twin on core 1"
  one 1 > twin.out & t=$!
  sleep 2; one 0; wait $t
  echo "-- twin on core 1:"; cat twin.out
done
