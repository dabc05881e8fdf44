#!/bin/bash
# The 1B shape's multi-host suite at c=8 only, decode-heavy, 2 pairs, for the change and for 4aa9407.
HERE=$(cd "$(dirname "$0")" && pwd)
for side in after:/work/main before:/tmp/wt-4aa9407; do
  name=${side%%:*}; checkout=${side#*:}
  echo "== $name ($checkout), $(date -u +%T)"
  (cd "$checkout" && PYTHONPATH=$checkout /work/main/.venv/bin/python -m bench.multihost --per-client 2 --delays none \
    --concurrency 8 --reps 2 --model llama-3.2-1b --workload decode --out "$HERE/suite-c8-$name.json" 2>&1 \
    | grep -a "scale-out\|efficiency\|CRASH" )
done
