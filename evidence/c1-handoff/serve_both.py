"""`neuron-tai serve` with every llama_decode call's and every socket send's start and end (perf_counter), to OUT at exit."""
import atexit, json, os, sys, time
import engine.llama_handles as lh
import transport.trio_zmq as tz
from neuron_tai.cli import main

out = os.environ["TIMED_OUT"]
calls, sends = [], []
orig_decode, orig_send = lh.LlamaContext.decode, tz.TrioSocket.try_send
def decode(self, batch):
    t0 = time.perf_counter(); rc = orig_decode(self, batch); calls.append((batch.n_tokens, t0, time.perf_counter())); return rc
def try_send(self, frames):
    t0 = time.perf_counter(); r = orig_send(self, frames); sends.append((t0, time.perf_counter())); return r
lh.LlamaContext.decode, tz.TrioSocket.try_send = decode, try_send
atexit.register(lambda: json.dump({"calls": calls, "sends": sends}, open(out, "w")))
sys.exit(main(sys.argv[1:]))
