#!/bin/bash
# A local 2-stage chain of the 1B shape (head 0:11 on core 0, tail 11:16 on core 1, one thread
# each), one closed-loop prompt-heavy run at c=8 (16 requests of 32 new tokens), then what each
# stage's `stats` says of its memory, and the tail's resident set by kind of mapping.
#   usage: [EXTRA="serve flags"] [env VAR=...] evidence/stage-heap/chain.sh TAG SHARD_DIR
# Run from the checkout's root, with its .venv.
TAG=$1 S=$2
PY=.venv/bin/python
F="${EXTRA} --threads 1 --max-sessions 16 --max-waiting 16 --kv-cells 4096"
LOGS=$(mktemp -d)
taskset -c 1 $PY -m neuron_tai.cli serve $S/*layers-11-16.gguf --bind tcp://127.0.0.1:5702 $F > $LOGS/tail.log 2>&1 &
T=$!
taskset -c 0 $PY -m neuron_tai.cli serve $S/*layers-0-11.gguf --bind tcp://127.0.0.1:5701 --next tcp://127.0.0.1:5702 $F > $LOGS/head.log 2>&1 &
H=$!
for i in $(seq 60); do grep -q ready $LOGS/head.log && grep -q ready $LOGS/tail.log && break; sleep 1; done
$PY -m bench.chain_load run tcp://127.0.0.1:5701 --concurrency 8 --requests 16 --max-new 32 --workload prompt --seed 3 > /dev/null
for a in 5701 5702; do
  .venv/bin/neuron-tai stats tcp://127.0.0.1:$a --json | python3 -c "
import json, sys
s = json.load(sys.stdin)
m = lambda k: round((s.get(k) or 0) / 2**20, 1)
print('$TAG', 'head' if '$a' == '5701' else 'tail', 'weights', m('weights_bytes'), 'KV', m('kv_budget_bytes'),
      'RSS', m('rss_bytes'), 'peak', m('rss_peak_bytes'), 'private', m('rss_anon_bytes'), 'files', m('rss_file_bytes'),
      'target', round(1.25 * (m('weights_bytes') + m('kv_budget_bytes')), 1), 'MiB')"
done
python3 - $T $TAG <<'PY'
import collections, sys
pid, tag = sys.argv[1], sys.argv[2]
rss, cur = collections.Counter(), None
for line in open(f"/proc/{pid}/smaps"):
    parts = line.split()
    if "-" in parts[0] and ":" not in parts[0]:
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        name = parts[5] if len(parts) > 5 else ""
        cur = name if name.startswith("[") else "files" if name.startswith("/") else "anonymous >= 8 MiB" if hi - lo >= 8 << 20 else "anonymous < 8 MiB"
    elif parts[0] == "Rss:":
        rss[cur] += int(parts[1])
print(tag, "tail by mapping (MiB):", ", ".join(f"{k} {v / 1024:.1f}" for k, v in rss.most_common(5)))
PY
kill -INT $H $T; wait
rm -rf $LOGS
