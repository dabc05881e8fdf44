"""`neuron-tai serve` with every llama_decode call timed: (rows, n_kv-ish unknown, seconds, thread cpu) to OUT at exit."""
import atexit, json, os, sys, time
import engine.llama_handles as lh
from neuron_tai.cli import main

out = os.environ["TIMED_OUT"]
calls = []
orig = lh.LlamaContext.decode

def decode(self, batch):
    n = batch.n_tokens
    t0 = time.perf_counter(); c0 = time.thread_time()
    rc = orig(self, batch)
    calls.append((n, time.perf_counter() - t0, time.thread_time() - c0))
    return rc

lh.LlamaContext.decode = decode
atexit.register(lambda: json.dump(calls, open(out, "w")))
sys.exit(main(sys.argv[1:]))
