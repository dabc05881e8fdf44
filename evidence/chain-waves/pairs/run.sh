#!/bin/bash
# alternating pairs of the multi-host suite's prompt part at c=8: network namespaces, then loopback
cd /work/main
for i in 1 2; do
  for mode in ns lo; do
    extra=""; [ $mode = lo ] && extra="--loopback"
    echo "== $mode $i $(date -u +%T)"
    .venv/bin/python -m bench.multihost --model llama-3.2-1b --workload prompt --concurrency 8 --delays none --per-client 2 --tag m$i$mode $extra --out /tmp/mh2/$mode$i.json 2>&1 | grep "^scale-out"
  done
done
echo "== done $(date -u +%T)"
