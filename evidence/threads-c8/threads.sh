#!/bin/bash
# per-thread CPU seconds of the processes matching $1
for pid in $(pgrep -f "$1"); do
  echo "pid $pid: $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-150)"
  for t in /proc/$pid/task/*; do
    s=($(sed 's/.*) //' $t/stat)); comm=$(cat $t/comm)
    printf "   %-18s utime %6.2f stime %6.2f  nvcsw %s nivcsw %s\n" "$comm" $(echo "${s[11]}/100" | bc -l) $(echo "${s[12]}/100" | bc -l) "$(grep '^voluntary' $t/status | awk '{print $2}')" "$(grep nonvoluntary $t/status | awk '{print $2}')"
  done
done
