"""`neuron-tai serve` with timestamps along a hop: decode calls, compute jobs, socket sends/recvs, engine requests."""
import atexit, json, os, sys, time
import engine.llama_handles as lh
import engine.compute_thread as ct
import engine.engine as eng
import transport.trio_zmq as tz
from neuron_tai.cli import main

out = os.environ["TIMED_OUT"]
ev = {"calls": [], "jobs": [], "send": [], "recv": [], "req": []}
pc = time.perf_counter
orig = lh.LlamaContext.decode
def decode(self, batch):
    n = batch.n_tokens; t0 = pc()
    rc = orig(self, batch)
    ev["calls"].append((n, t0, pc()))
    return rc
lh.LlamaContext.decode = decode
orig_run = ct.ComputeThread.run
async def run(self, fn, *args):
    t_submit = pc()
    rec = [t_submit]
    def wrapped(*a):
        rec.append(pc())
        try:
            return fn(*a)
        finally:
            rec.append(pc())
    r = await orig_run(self, wrapped, *args)
    rec.append(pc())
    ev["jobs"].append(rec)
    return r
ct.ComputeThread.run = run
o_send = tz.TrioSocket.try_send
def try_send(self, frames):
    t0 = pc(); ok = o_send(self, frames)
    if ok: ev["send"].append((t0, pc(), self._fd, sum(len(f) for f in frames)))
    return ok
tz.TrioSocket.try_send = try_send
o_recv = tz.TrioSocket.try_recv
def try_recv(self):
    t0 = pc(); fr = o_recv(self)
    if fr is not None: ev["recv"].append((t0, pc(), self._fd, sum(len(f) for f in fr)))
    return fr
tz.TrioSocket.try_recv = try_recv
o_req = eng.Engine.request
async def request(self, req):
    t0 = pc(); r = await o_req(self, req)
    ev["req"].append((t0, pc(), type(req).__name__))
    return r
eng.Engine.request = request
atexit.register(lambda: json.dump(ev, open(out, "w")))
sys.exit(main(sys.argv[1:]))
