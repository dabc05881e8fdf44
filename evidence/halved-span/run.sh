#!/usr/bin/env bash
# The decode-heavy reports of both models at this commit (a halved iteration priced from its
# first call's start to its second's end), written under /tmp, then the calls and ratios of each.
set -u
out=${1:-/tmp/halved-span}
echo "== $(git log --oneline -1 | cut -c1-70) | $(date -u '+%F %H:%M:%S') UTC"
.venv/bin/python -m bench.report full --workload decode --out "$out/gemma" > "$out-gemma.log" 2>&1
.venv/bin/python -m bench.report full --workload decode --model llama-3.2-1b --out "$out/1b" > "$out-1b.log" 2>&1
echo "== done $(date -u '+%F %H:%M:%S') UTC"
python3 evidence/halved-span/gap.py "$out" gemma 1b
