#!/bin/bash
# Before (4aa9407) and after (2d74320), alternating, twice each.
HERE=$(cd "$(dirname "$0")" && pwd)
for round in 1 2; do
  for side in before:/tmp/wt-4aa9407 after:/work/main; do
    name=${side%%:*}; checkout=${side#*:}
    echo "== $name ($checkout), round $round"
    "$HERE/sequence.sh" "$checkout" "$HERE/$name-$round" 5710
  done
done
