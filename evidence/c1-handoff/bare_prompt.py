"""The bench's bare loop (run_waves) on chain_load's prompt-heavy requests (seed 12) at c=1, every call timed."""
import statistics as st
import sys
import time
from pathlib import Path

import llama_cpp as lc

import bench.bare_loop as bl
from bench.workload import CORPUS, WORKLOADS, make_requests
from engine.backend import ContextConfig
from engine.llama_handles import Vocabulary

model = Path(sys.argv[1])
bare = bl.BareLoop(model, ContextConfig(n_seq_max=16, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=2))
calls = []
orig = lc.llama_decode
def timed(ctx, batch):
    t0 = time.perf_counter(); rc = orig(ctx, batch); calls.append((batch.n_tokens, time.perf_counter() - t0)); return rc
bl.lc.llama_decode = timed
vocab = lc.llama_model_get_vocab(bare.model.ptr)
def tok(text, special):
    buf = (lc.llama_token * 8192)()
    n = lc.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 8192, special, True)
    return list(buf[:n])
corpus = tok(CORPUS, False); start = tok("", True)
reqs = make_requests(corpus, 16, 32, seed=12, bos=start[0] if start else None, buckets=WORKLOADS["prompt"].buckets)
bl.run_waves(bare, reqs[:1], 1)  # warm
for rep in range(int(sys.argv[2])):
    calls.clear()
    traces, wall = bl.run_waves(bare, reqs, 1)
    dec = [c for c in calls if c[0] == 1]; pre = [c for c in calls if c[0] > 1]
    print(f"bare: {512 / wall:.2f} tok/s wall {wall:.3f} | {len(calls)} calls; 1-row {len(dec)} median {1000*st.median(c[1] for c in dec):.2f} mean {1000*st.mean(c[1] for c in dec):.2f} ms; prefill {len(pre)} calls {sum(c[1] for c in pre):.3f} s rows {sum(c[0] for c in pre)}; inside all {sum(c[1] for c in calls):.3f} s")
