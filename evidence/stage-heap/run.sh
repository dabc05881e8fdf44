#!/bin/bash
# The runs of run.log, in turn: as the node runs, with glibc's mmap threshold fixed at 256 KiB,
# with one malloc arena, and with both stages at --n-ubatch 64 and the fixed threshold.
S=$1
for i in 1 2; do
  evidence/stage-heap/chain.sh as-is $S
  MALLOC_MMAP_THRESHOLD_=262144 evidence/stage-heap/chain.sh mmap-256k $S
  MALLOC_ARENA_MAX=1 evidence/stage-heap/chain.sh arena-1 $S
  EXTRA="--n-ubatch 64" MALLOC_MMAP_THRESHOLD_=262144 evidence/stage-heap/chain.sh ubatch-64+mmap-256k $S
done
