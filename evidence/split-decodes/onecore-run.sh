#!/bin/bash
# onecore.sh for 4aa9407 and the change, alternating, twice each.
HERE=$(cd "$(dirname "$0")" && pwd)
for round in 1 2; do
  for side in before:/tmp/wt-4aa9407 after:/work/main; do
    name=${side%%:*}; checkout=${side#*:}
    echo "== $name ($checkout), round $round, $(date -u +%T)"
    "$HERE/onecore.sh" "$checkout" "$HERE/onecore-$name-$round" 5711
  done
done
