"""One unified KV cache against a stream per sequence (llama-server's default with -np N), bare loop.

c sequences of a 16-token prompt, prefilled in one call, then 127 decode calls of c rows;
the two contexts alternate in one process. Prints the mean decode call (ms) per run.
"""
import sys, time
from pathlib import Path
import llama_cpp as lc
from engine.backend import ContextConfig, context_params
from engine.llama_handles import LlamaModel, ensure_backend

M, C, ROUNDS = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ensure_backend()
model = LlamaModel(M, "auto")
batch = lc.llama_batch_init(512, 0, 1)

def context(unified):
    p = context_params(ContextConfig(n_seq_max=16, n_ctx=16 * 512, n_threads=2))
    p.kv_unified = unified
    return lc.llama_init_from_model(model.ptr, p)

def fill(rows):
    batch.n_tokens = len(rows)
    for i, (seq, pos, tok, out) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
        batch.seq_id[i][0] = seq

def run(ctx):
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    fill([(s, p, 100 + (7 * s + p) % 500, p == 15) for s in range(C) for p in range(16)])
    assert lc.llama_decode(ctx, batch) == 0
    took = []
    for step in range(127):
        fill([(s, 16 + step, 200 + (s + step) % 300, True) for s in range(C)])
        t = time.perf_counter(); assert lc.llama_decode(ctx, batch) == 0; took.append(time.perf_counter() - t)
    return 1000 * sum(took) / len(took), 1000 * sum(took[:16]) / 16, 1000 * sum(took[-16:]) / 16

ctxs = {"unified": context(True), "per-sequence": context(False)}
print(f"model {M.name}, c={C}: mean decode call (ms), all 127 / first 16 / last 16", flush=True)
for r in range(ROUNDS):
    for name in (("unified", "per-sequence") if r % 2 == 0 else ("per-sequence", "unified")):
        print(f"round {r + 1} {name:13} " + " / ".join(f"{x:.1f}" for x in run(ctxs[name])), flush=True)
