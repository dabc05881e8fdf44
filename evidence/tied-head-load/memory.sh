#!/usr/bin/env bash
# bench.stage_cost --memory-only on both models, the page cache dropped before each model's run
# (as evidence/tail-ubatch/memory.sh; here a stage holding a tied head reads its file into memory).
set -u
for model in gemma-3-270m ~/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf; do
  sync; echo 3 > /proc/sys/vm/drop_caches
  echo "== $(git log --oneline -1 | cut -c1-60) | model $model | $(date -u '+%F %H:%M:%S') UTC"
  NEURON_TAI_BENCH_MODEL=$model .venv/bin/python -m bench.stage_cost --memory-only 2>&1 | grep '^memory'
done
