#!/bin/bash
# The 1B shape's decode-heavy chain at c=1 against the one-core node, 3 pairs, without and with
# the PM QoS latency request held at 0 (the idle cores poll instead of halting the vCPU).
cd /work/main
idle() { grep -h . /sys/devices/system/cpu/cpu[01]/cpuidle/state[01]/usage | paste -sd' '; }
one() {
  echo "== $1 $(date -u +%T) idle-state usage (cpu0 poll, halt; cpu1 poll, halt): $(idle)"
  .venv/bin/python -m bench.multihost --model llama-3.2-1b --workload decode --concurrency 8 --delays none \
    --reps 3 --per-client 2 --tag r$2 --out /tmp/qos8/$1.json 2>&1 | grep -E "scale-out|^ *decode" 
  echo "-- $1 $(date -u +%T) idle-state usage: $(idle)"
}
one halting a
.venv/bin/python /tmp/qos/hold_latency.py 0 & holder=$!
sleep 1
one polling b
kill $holder; wait $holder
one halting-again c
