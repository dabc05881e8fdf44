#!/usr/bin/env bash
# Each stage's resident memory (bench.stage_cost --memory-only, one fresh process per shard) with
# shards in the source's tensor order (a checkout of b3db8c4, the commit before shards grouped
# their tensors by type) and grouped (this commit), on gemma-3-270m and the 1B shape. The page
# cache is dropped before each run, so every shard is loaded from disk as a node's first start does.
# Usage: run.sh OLD_CHECKOUT NEW_CHECKOUT
set -u
old=$1 new=$2
for model in gemma-3-270m ~/.cache/neuron-tai/shapes/llama-3.2-1b-shape-q4_k_m.gguf; do
  for tree in "$old" "$new"; do
    sync; echo 3 > /proc/sys/vm/drop_caches
    echo "== $(git -C "$tree" log --oneline -1 | cut -c1-60) | model $model | $(date -u +%H:%M:%S)"
    (cd "$tree" && NEURON_TAI_BENCH_MODEL=$model .venv/bin/python -m bench.stage_cost --memory-only 2>&1 | grep '^memory')
  done
done
