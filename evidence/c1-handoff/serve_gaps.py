"""`neuron-tai serve` with each llama_decode's start and end, and each compute job's submit and start, to OUT at exit."""
import atexit, json, os, sys, time
import engine.llama_handles as lh
import engine.compute_thread as ct
from neuron_tai.cli import main

out = os.environ["TIMED_OUT"]
calls, jobs = [], []
orig = lh.LlamaContext.decode
def decode(self, batch):
    n = batch.n_tokens; t0 = time.perf_counter()
    rc = orig(self, batch)
    calls.append((n, t0, time.perf_counter()))
    return rc
lh.LlamaContext.decode = decode
orig_run = ct.ComputeThread.run
async def run(self, fn, *args):
    t_submit = time.perf_counter()
    def wrapped(*a):
        t_start = time.perf_counter()
        try:
            return fn(*a)
        finally:
            jobs.append((t_submit, t_start, time.perf_counter()))
    r = await orig_run(self, wrapped, *args)
    jobs[-1] = jobs[-1] + (time.perf_counter(),)
    return r
ct.ComputeThread.run = run
atexit.register(lambda: json.dump({"calls": calls, "jobs": jobs}, open(out, "w")))
sys.exit(main(sys.argv[1:]))
