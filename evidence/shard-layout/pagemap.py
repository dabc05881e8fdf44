"""Which of a shard's tensors a stage holds resident, by /proc/self/pagemap.

Loads SHARD as bench.stage_cost's stage_memory does (its context, a 512-row prefill, four
8-row decode steps), then reads the present bit of every page of llama.cpp's mapping of the
file and sums it per tensor kind, and prints one in 64 pages of layer 0's tensors.
Usage: python pagemap.py SHARD
"""

import collections
import struct
import sys
from pathlib import Path

import numpy as np

from bench.stage_cost import CONTEXT
from engine.backend import Output, Segment, StageBackend
from neuron_tai.shard import open_header

path = Path(sys.argv[1]).resolve()
backend = StageBackend(path, CONTEXT)
info, n = backend.info, CONTEXT.n_batch
out = Output.TOKEN if info.last else Output.HIDDEN
seqs = [backend.open_sequence() for _ in range(8)]
rng = np.random.default_rng(7)


def segment(seq: int, pos: int, rows: int) -> Segment:
    if info.first:
        return Segment(seq, pos, tokens=(np.arange(rows, dtype=np.int32) + 100) % info.n_vocab, output=out)
    return Segment(seq, pos, hidden=rng.standard_normal((rows, info.n_embd)).astype(np.float32), output=out)


backend.decode([segment(seqs[0], 0, n)])
for step in range(4):
    backend.decode([segment(s, n + step if s == seqs[0] else step, 1) for s in seqs])

header = open_header(path)  # read and unmapped: llama.cpp's is the only mapping of the file left
maps = [line.split() for line in open("/proc/self/maps")]
mapped = [(int(f[0].split("-")[0], 16), int(f[0].split("-")[1], 16), int(f[2], 16)) for f in maps if f[-1] == str(path)]
present: dict[int, bool] = {}  # file page -> resident
with open("/proc/self/pagemap", "rb") as pagemap:
    for lo, hi, offset in mapped:
        pagemap.seek((lo >> 12) * 8)
        raw = pagemap.read(((hi - lo) >> 12) * 8)
        for i in range((hi - lo) >> 12):
            present[(offset >> 12) + i] = bool(struct.unpack_from("<Q", raw, i * 8)[0] >> 63)
names = {0: "F32", 12: "Q4_K", 14: "Q6_K"}
held, size = collections.Counter(), collections.Counter()
for t in header.tensors:
    start = header.data_offset + t.offset
    pages = range(start >> 12, (start + t.nbytes + 4095) >> 12)
    kind = names.get(t.ggml_type, str(t.ggml_type)) + (" head" if t.name == "token_embd.weight" else "")
    held[kind] += sum(present.get(p, False) for p in pages) * 4096
    size[kind] += t.nbytes
    if t.name.startswith("blk.0."):
        print(f"{t.name:24} {kind:5} {''.join('1' if present.get(p) else '0' for p in pages[::64])}")
print(f"{path.name}: resident MiB of each kind's tensors (of their size)")
for kind in size:
    print(f"  {kind:10} {held[kind] / 2**20:7.1f} of {size[kind] / 2**20:7.1f}")
print(f"  all pages of the file: {sum(present.values()) * 4096 / 2**20:.1f} MiB resident")
backend.close()
