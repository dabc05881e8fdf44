import sys, time, dataclasses, numpy as np
from pathlib import Path
from engine.process_memory import resident_memory
from bench.stage_cost import CONTEXT
from engine.backend import StageBackend, Segment, Output
path = Path(sys.argv[1]); ub = int(sys.argv[2])
cfg = dataclasses.replace(CONTEXT, n_ubatch=ub)
b = StageBackend(path, cfg)
info, n = b.info, cfg.n_batch
out = Output.TOKEN if info.last else Output.HIDDEN
seqs = [b.open_sequence() for _ in range(8)]
rng = np.random.default_rng(7)
def seg(seq, pos, rows):
    if info.first:
        return Segment(seq, pos, tokens=(np.arange(rows, dtype=np.int32) + 100) % info.n_vocab, output=out)
    return Segment(seq, pos, hidden=rng.standard_normal((rows, info.n_embd)).astype(np.float32), output=out)
t = []
for k in range(3):
    s0 = time.perf_counter(); b.decode([seg(seqs[k], 0, n)]); t.append(time.perf_counter() - s0)
m = resident_memory()
print(f"{path.name} ubatch {ub}: rss {m.rss/2**20:.1f} compute {b.compute_buffer_bytes/2**20:.1f} MiB; {n}-row prefill s {[round(x,2) for x in t]}", flush=True)
import re, collections
agg = collections.Counter()
cur = None
for line in open("/proc/self/smaps"):
    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
        parts = line.split()
        cur = parts[5] if len(parts) > 5 else "[anon]"
        cur = cur.split("/")[-1]
    elif line.startswith("Rss:"):
        agg[cur] += int(line.split()[1])
for k, v in agg.most_common(14):
    print(f"  {v/1024:8.1f} MiB  {k}")
